"""The MPI link and shared-memory peer access, timed as simdist's collectives use them
(``LinkProbe``), and the fits that turn the probes into a profile's link figures (α, β,
size-keyed rate tables; see ``simdist.calibrate``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _table_rows(rates: dict[int, float], peak: float) -> list[list[float]]:
    """[min size, rate / peak] rows, largest size first, the smallest keyed 0 (it covers
    everything below)."""
    sizes = sorted(rates, reverse=True)
    if not sizes:  # nothing measured above the latency: the plain rate everywhere
        return [[0, 1.0]]
    return [[0 if s == sizes[-1] else s, rates[s] / peak] for s in sizes]


def fit_alpha_beta(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Least squares t = α + n·β with relative (1/t) weights; α clamped at 0."""
    n = np.asarray(sizes, float)
    t = np.asarray(times, float)
    design = np.stack([1.0 / t, n / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # refit β alone through the origin
        alpha = 0.0
        beta = float(np.sum(n / t) / np.sum((n / t) ** 2))
    return float(alpha), float(beta)


# The link sweeps: 8 B .. 8 KiB in steps of 4x (the latency), then every power of 2 to 16 MiB
# (the schedule model reads the rate at each message's size); p2p's reduce exchange from
# 32 KiB; direct peer access (shm) 128 KiB .. 8 MiB.
MESSAGE_SIZES = [8 * 4**k for k in range(6)] + [2**k for k in range(15, 25)]
REDUCE_SIZES = [2**k for k in range(15, 25)]
DIRECT_SIZES = [2**k for k in range(17, 24)]
DIRECT_MODES = ("copy", "add", "store")  # LinkProbe.direct: load, load and add, store


class LinkProbe:
    """The link's primitives, each timed as simdist's collective steps run them: between
    the first two blocks of one buffer just written (as backward leaves the gradients),
    both ranks starting together, the slower rank's time. Ranks pair up (r with r ^ 1, every
    pair at once, as in a collective's step: at 2 ranks exactly the ring's and shm's own
    accesses; at more, ring steps pair r with r + 1 instead); an unpaired last rank only
    joins the collective calls and the synchronisation.

    ``measure_link`` calibrates the profile with it; ``scripts/validate_sim.py`` re-measures
    the link with it on a collective's own buffer, between that collective's calls: on a
    virtual machine a buffer's rates depend on the pages under it (transparent huge pages
    or 4 KiB ones; shared-memory windows never get huge pages) and on the neighbours'
    load, which changes within a minute."""

    def __init__(self, comm: Any, exchanger: Any = None):
        """``exchanger``: the ``p2p.Exchanger`` whose reduce to time (a ``Collectives``'
        own, to time it on the scratch its collectives use: its ``bytes_sent`` then counts
        the probes' bytes too); default: a new one."""
        from mpi4py import MPI

        from simdist.comm.p2p import Exchanger

        self.comm = comm.Dup()  # its messages cannot match anyone else's
        self.rank = comm.Get_rank()
        peer = self.rank ^ 1
        self.peer = peer if peer < comm.Get_size() else None
        self._exchanger = exchanger if exchanger is not None else Exchanger(self.comm)
        self._max = MPI.MAX

    def free(self) -> None:
        self.comm.Free()

    def _slowest(self, dt: float) -> float:
        return self.comm.allreduce(dt, op=self._max)

    def _timed(self, fn: Callable[[], Any], everyone: bool = False) -> float:
        """The slowest rank's seconds of ``fn``, all ranks starting together; only paired
        ranks call it unless ``everyone`` (a collective call)."""
        self.comm.Barrier()
        t0 = time.perf_counter()
        if everyone or self.peer is not None:
            fn()
        return self._slowest(time.perf_counter() - t0)

    def _offsets(self, nbytes: int, size: int) -> tuple[int, int, int]:
        """(elements per block, this rank's block start, the peer's block start)."""
        n = nbytes // 4
        if 2 * n > size:
            raise ValueError(f"a probe of {nbytes} B needs a buffer of {8 * n} B or more")
        return (n, 0, n) if self.rank % 2 == 0 else (n, n, 0)

    def exchange(self, buf: np.ndarray, nbytes: int) -> float:
        """A Sendrecv: this rank's block to the peer, the peer's into the other block (the
        step of a 2-rank ring all-gather), as the exchanger's ``copy`` runs it: one
        message inside a node, 1 MiB pieces between nodes where it has been placed."""
        n, mine, theirs = self._offsets(nbytes, buf.size)
        send, recv = buf[mine : mine + n], buf[theirs : theirs + n]
        buf[: 2 * n].fill(1.0)
        x, peer = self._exchanger, self.peer
        return self._timed(lambda: x.copy(send, peer, recv, peer))

    def gather(self, buf: np.ndarray, nbytes: int) -> float:
        """The Sendrecv of ``exchange`` as an all-reduce's second half runs it: right after
        an untimed reduce exchange on the same blocks (its first half: this rank's block
        summed in place, the peer's only read by the sends), with no write between. On
        an AMD EPYC (Zen 3) it ran 5-17 % slower than on freshly written blocks at
        32 KiB-16 MiB, so the all-gather inside an all-reduce is priced by this probe and one
        called alone by ``exchange``."""
        n, mine, theirs = self._offsets(nbytes, buf.size)
        send, recv = buf[mine : mine + n], buf[theirs : theirs + n]
        buf[: 2 * n].fill(1.0)
        x, peer = self._exchanger, self.peer
        self.comm.Barrier()
        if peer is not None:  # the first half: send the peer's block, sum into this one's
            x.reduce(recv, peer, send, peer)
        return self._timed(lambda: x.copy(send, peer, recv, peer))

    def reduce(self, buf: np.ndarray, nbytes: int) -> float:
        """p2p's reduce exchange (pipelined in segments above one segment): send the peer's
        block, add the peer's values of this rank's block into it (the step of a 2-rank
        ring reduce-scatter)."""
        n, mine, theirs = self._offsets(nbytes, buf.size)
        send, acc = buf[theirs : theirs + n], buf[mine : mine + n]
        buf[: 2 * n].fill(1.0)
        x, peer = self._exchanger, self.peer
        return self._timed(lambda: x.reduce(send, peer, acc, peer))

    def direct(
        self, views: list[np.ndarray], fence: Callable[[], None], nbytes: int, mode: str = "copy"
    ) -> float:
        """A pass between this rank's and the peer's segments of a shared buffer (``views``:
        every rank's, with its ``fence``), as the shm algorithm makes them: ``copy`` loads
        the peer's block into this rank's segment (a 2-rank all-gather), ``add`` adds the
        peer's values of this rank's block into it (a reduce-scatter), ``store`` writes this
        rank's block into the peer's segment (an all-reduce's second half, after its first:
        the untimed ``add`` before it leaves those lines in this rank's cache, as the
        all-reduce's own addition does). The fences around it are not timed."""
        own = views[self.rank]
        n, mine, theirs = self._offsets(nbytes, own.size)
        other = views[self.peer] if self.peer is not None else own
        if mode == "copy":
            dst, src = own[theirs : theirs + n], other[theirs : theirs + n]
        elif mode == "add":
            dst, src = own[mine : mine + n], other[mine : mine + n]
        elif mode == "store":
            dst, src = other[mine : mine + n], own[mine : mine + n]
        else:
            raise ValueError(f"mode must be copy, add or store, got {mode!r}")
        own[: 2 * n].fill(1.0)
        fence()
        if mode == "store" and self.peer is not None:
            np.add(src, dst, out=src)
        t0 = time.perf_counter()
        if self.peer is not None:
            if mode == "add":
                np.add(dst, src, out=dst)
            else:
                np.copyto(dst, src)
        dt = time.perf_counter() - t0
        fence()
        return self._slowest(dt)

    def latencies(
        self,
        coll: Any,
        tiny: np.ndarray,
        repeats: int,
        warmup: int = 3,
        written: np.ndarray | None = None,
    ) -> dict[str, float]:
        """Best of ``repeats``: the bare Sendrecv of 32 B (``raw``); simdist's ring
        all-gather of 16 floats less its p - 1 such steps (``call``: the call's own Python,
        paid once per collective); where ``coll`` shares memory, the bare fence (``fence``)
        and ``step``, a fence as the shm algorithm pays it: half of its reduce-scatter of 16
        floats less the addition inside it (``direct`` on 32 B), which the size probes
        already time. ``tiny``: 16 floats from ``coll.buffer``; ``warmup`` calls of each
        first, not counted.

        ``written``: each primitive runs right after this buffer is written, as a
        collective runs right after its buffer is (backward's gradients): once the stores
        outgrow the last-level cache they evict the call's own Python and MPI state, and the
        fixed costs grow with them (Zen 5, validate_sim's 16 MiB cases: the ring call 13-33 us
        and the shm step 14-29 us, against 6-8 us at 1 and 4 MiB and 4.6 / 5.5 us in a
        tight loop)."""
        views, fence = coll.peer_views(tiny) if coll.registered(tiny) else (None, None)
        peer = self.peer if self.peer is not None else self.rank
        steps = self.comm.Get_size() - 1
        best = {k: float("inf") for k in ("raw", "ring", "shm", "add", "fence")}

        def sendrecv() -> None:
            self.comm.Sendrecv(tiny[:8], dest=peer, recvbuf=tiny[8:], source=peer)

        probes: dict[str, Callable[[], float]] = {
            "raw": lambda: self._timed(sendrecv),
            "ring": lambda: self._timed(lambda: coll.allgather(tiny, algorithm="ring"), True),
        }
        if fence is not None:
            probes["shm"] = lambda: self._timed(
                lambda: coll.reduce_scatter(tiny, algorithm="shm"), True
            )
            probes["add"] = lambda: self.direct(views, fence, 32, "add")
            probes["fence"] = lambda: self._timed(fence, True)
        for i in range(warmup + repeats):
            tiny.fill(i)
            for k, probe in probes.items():
                if written is not None:
                    written.fill(1.0)  # ordinary stores, as the collectives' callers write
                t = probe()
                if i >= warmup:
                    best[k] = min(best[k], t)
        out = {"raw": best["raw"], "call": max(0.0, best["ring"] - steps * best["raw"])}
        if fence is not None:
            step = max(best["fence"], (best["shm"] - best["add"]) / 2)
            out.update(step=step, fence=best["fence"])
        return out


def measure_link(comm: Any, repeats: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The ``intra`` link between ranks 0 and 1 (and every other pair at once): ping-pong,
    then ``LinkProbe`` rounds over every size (Sendrecv, reduce exchange; best per size:
    a burst of load spoils one round's sample, not a whole size), then direct peer access
    on a shared buffer and the latencies. Returns (mpi, direct); direct is None where the
    ranks share no memory."""
    from simdist.comm import Collectives

    rank = comm.Get_rank()
    sizes = MESSAGE_SIZES
    pool = np.ones(2 * max(sizes) // 4, np.float32)
    pingpong = []
    for nbytes in sizes:
        n = nbytes // 4
        sbuf, rbuf = (pool[:n], pool[n : 2 * n]) if rank == 0 else (pool[n : 2 * n], pool[:n])
        reps = max(3, min(200, (1 << 24) // max(nbytes, 1)))
        best = float("inf")
        for _ in range(repeats):
            comm.Barrier()
            if rank < 2:
                t0 = time.perf_counter()
                for _ in range(reps):
                    if rank == 0:
                        comm.Send(sbuf, dest=1)
                        comm.Recv(rbuf, source=1)
                    else:
                        comm.Recv(rbuf, source=0)
                        comm.Send(sbuf, dest=0)
                best = min(best, (time.perf_counter() - t0) / reps / 2)
        pingpong.append(best)
    probe = LinkProbe(comm)
    sendrecv = dict.fromkeys(sizes, float("inf"))
    reduce = dict.fromkeys(REDUCE_SIZES, float("inf"))
    gather = dict.fromkeys(REDUCE_SIZES, float("inf"))
    for i in range(3 + 10 * repeats):
        for nbytes in sizes:
            t = probe.exchange(pool, nbytes)
            sendrecv[nbytes] = min(sendrecv[nbytes], t) if i >= 3 else sendrecv[nbytes]
            if nbytes in reduce:
                t = probe.reduce(pool, nbytes)
                reduce[nbytes] = min(reduce[nbytes], t) if i >= 3 else reduce[nbytes]
                t = probe.gather(pool, nbytes)
                gather[nbytes] = min(gather[nbytes], t) if i >= 3 else gather[nbytes]
    coll = Collectives(comm)
    lat = probe.latencies(coll, coll.buffer(16), 100 * repeats)
    mpi = mpi_results(
        sizes,
        [sendrecv[s] for s in sizes],
        REDUCE_SIZES,
        [reduce[s] for s in REDUCE_SIZES],
        lat["call"],
        gather=[gather[s] for s in REDUCE_SIZES],
    )
    mpi.update(pingpong=pingpong, pingpong_fit=fit_alpha_beta(sizes, pingpong))
    direct = None
    if coll.shared:
        shared = coll.buffer(2 * max(DIRECT_SIZES) // 4)
        views, fence = coll.peer_views(shared)
        best = {m: dict.fromkeys(DIRECT_SIZES, float("inf")) for m in DIRECT_MODES}
        for i in range(3 + 3 * repeats):
            for nbytes in DIRECT_SIZES:
                for mode, by_size in best.items():
                    t = probe.direct(views, fence, nbytes, mode)
                    by_size[nbytes] = min(by_size[nbytes], t) if i >= 3 else by_size[nbytes]
        direct = {
            "sizes": DIRECT_SIZES,
            **{m: [best[m][s] for s in DIRECT_SIZES] for m in DIRECT_MODES},
            "step": lat["step"],
            "fence": lat["fence"],
        }
    coll.free()
    probe.free()
    return mpi, direct


def message_rates(sizes: list[int], times: list[float], alpha: float) -> dict[int, float]:
    """Bytes per second after the latency, for the messages where bandwidth dominates
    (>= 32 KiB: below it the latency term is most of the time and the rate is noise)."""
    return {
        s: s / (t - alpha) for s, t in zip(sizes, times, strict=True) if s >= 32768 and t > alpha
    }


def mpi_link(mpi: dict[str, Any], reduce_bw: float) -> dict[str, Any]:
    """A profile's ``links.intra`` entry (the loader's units: GB/s, us, [min bytes, fraction]
    rows, largest first) from ``measure_link``'s MPI results: the Sendrecv's rates after
    the latency (``size_efficiency``), the reduce exchange's (``reducing_efficiency``) and
    the Sendrecv's right after one (``gather_efficiency``, where measured), all as
    fractions of the fastest; ``reduce_bw``: the add rate in bytes reduced per second
    (``reduce_gbs``, the γ of the closed forms)."""
    a_sr, b_sr = mpi["sendrecv_fit"]
    rates = message_rates(mpi["sizes"], mpi["sendrecv"], a_sr)
    reducing = message_rates(mpi["reduce_sizes"], mpi["reduce"], a_sr)
    gather = message_rates(mpi["reduce_sizes"], mpi["gather"], a_sr) if "gather" in mpi else {}
    bw = max([*rates.values(), *reducing.values(), *gather.values()], default=1 / b_sr)
    link = {
        "bandwidth_gbs": bw / 1e9,
        "latency_us": a_sr * 1e6,
        "efficiency": 1.0,
        "reduce_gbs": reduce_bw / 1e9,
        "call_overhead_us": mpi["call"] * 1e6,
        "size_efficiency": _table_rows(rates, bw),
    }
    if reducing:  # else reducing steps cost the copy plus γ
        link["reducing_efficiency"] = _table_rows(reducing, bw)
    if gather:  # else an all-reduce's all-gather steps cost what one alone does
        link["gather_efficiency"] = _table_rows(gather, bw)
    return link


def mpi_results(
    sizes: list[int],
    sendrecv: list[float],
    reduce_sizes: list[int],
    reduce: list[float],
    call: float,
    gather: list[float] | None = None,
) -> dict[str, Any]:
    """``measure_link``'s MPI results from its probes' times (seconds per size): what
    ``mpi_link`` reads, the α-β fit of the Sendrecv included. ``gather``: the Sendrecv
    after a reduce exchange (``LinkProbe.gather``) at ``reduce_sizes``, where taken."""
    out = {
        "sizes": sizes,
        "sendrecv": sendrecv,
        "sendrecv_fit": fit_alpha_beta(sizes, sendrecv),
        "reduce_sizes": reduce_sizes,
        "reduce": reduce,
        "call": call,
    }
    if gather is not None:
        out["gather"] = gather
    return out


def direct_link(direct: dict[str, Any], reduce_bw: float) -> dict[str, Any]:
    """The ``links.intra.direct`` entry from ``measure_link``'s shared-memory results: the
    rates of loads (``size_efficiency``), stores (``store_efficiency``) and loads that add
    (``reducing_efficiency``), as fractions of the fastest."""
    sizes = direct["sizes"]

    def rates(mode: str) -> dict[int, float]:
        return {s: s / t for s, t in zip(sizes, direct[mode], strict=True)}

    copy, store, add = rates("copy"), rates("store"), rates("add")
    bw = max([*copy.values(), *store.values(), *add.values()])
    return {
        "bandwidth_gbs": bw / 1e9,
        "latency_us": direct["step"] * 1e6,
        "efficiency": 1.0,
        "reduce_gbs": reduce_bw / 1e9,
        "size_efficiency": _table_rows(copy, bw),
        "store_efficiency": _table_rows(store, bw),
        "reducing_efficiency": _table_rows(add, bw),
    }


def intra_link(
    mpi: dict[str, Any], direct: dict[str, Any] | None, reduce_bw: float
) -> dict[str, Any]:
    """``mpi_link`` with its ``direct`` entry where the ranks share memory."""
    link = mpi_link(mpi, reduce_bw)
    if direct:
        link["direct"] = direct_link(direct, reduce_bw)
    return link


__all__ = [
    "DIRECT_MODES",
    "DIRECT_SIZES",
    "MESSAGE_SIZES",
    "REDUCE_SIZES",
    "LinkProbe",
    "direct_link",
    "fit_alpha_beta",
    "intra_link",
    "measure_link",
    "message_rates",
    "mpi_link",
    "mpi_results",
]
