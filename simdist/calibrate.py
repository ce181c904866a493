"""Measure this machine and write the ``host`` device profile.

    python -m simdist.calibrate [--out simdist/device/profiles/host.yaml]
    mpiexec -n 2 python -m simdist.calibrate        # also measures the MPI link (α, β)

What is measured (one thread, as each simdist rank runs):

* GEMM: float32 ``np.dot(a, b, c)`` inside numba (the kernels' call) for n = 64 … 1024, best
  of N; the best rate is the matrix peak and each size's fraction of it forms the size-keyed
  efficiency table (so the host profile's table, unlike the GPU ones, is fitted to
  whole-kernel times and is used with the roofline max). A second sweep times GEMMs with one
  small dimension s = 16 … 512 (the other two 512) for each axis (m, k, n) and each layout
  the kernels use (a @ b, a @ b.T, a.T @ b): ``matrix_shape_efficiency``, used for the
  models' GEMMs, whose shapes are known (32 rows run at about half the rate of 32 inner
  dimensions).
* Elementwise: a numba degree-8 polynomial per element on a cache-resident array (the SIMD
  peak, ``vector_tflops``) and the Python-to-kernel call overhead (``kernel_launch_us``,
  added per call: ``launch_mode: serial``); reductions, which stay scalar without fastmath
  (``scalar_tflops``): ``rowops.row_sum`` for fp32, the gradient norm's float64
  ``sum_of_squares`` for fp64.
* Memory: ``np.copyto`` and ``np.add`` from cache-sized to 64 MiB arrays, bytes read plus
  written per second; the best rate is the bandwidth, each size's fraction its efficiency.
* MPI (only under ``mpiexec -n 2``): ping-pong (one-way = half the round trip, in a loop)
  and bidirectional ``Sendrecv`` sweeps from 8 B to 16 MiB, best of N per size, then α and β
  by least squares on t = α + n·β weighted by 1/t (relative error, so the small messages pin
  α and the large ones β). Each Sendrecv is timed as a collective's step runs: its send
  buffer just written, both ranks starting together, the slower rank's time, the messages
  slices of one large buffer (as blocks are of the gradient buffer). The Sendrecv fit is the
  ``intra`` link, because simdist's ring and halving-doubling steps are Sendrecv exchanges.
  Run serially, the previous profile's link figures are kept (or left null if there is
  none) and the file says so. The sweep's rates after the latency become the link's
  ``size_efficiency`` table. p2p's pipelined reduce exchange (``Exchanger.reduce``, a ring
  reduce-scatter's step) is timed at the same sizes as a whole: ``reducing_efficiency``
  (its addition partly overlaps the transfer, and its 1 MiB segments can beat one plain
  Sendrecv; the schedule model reads both tables at each message's size).
* Shared memory (only under ``mpiexec -n 2``): in a buffer of simdist's shm algorithm,
  copying the peer's freshly written block into this rank's, adding it into this rank's
  block, and storing this rank's block into the peer's, 128 KiB to 8 MiB, and the latency
  per fence of simdist's own shm reduce-scatter of 16 floats (fence plus the call's
  Python, less its addition): the ``intra`` link's ``direct`` figures, which cost the "shm"
  collectives.
* The probes (``LinkProbe``) run in rounds over all sizes, best per size. On a virtual
  machine the link's rates change with the pages under a buffer (transparent huge pages or
  4 KiB ones) and with the neighbours' load; ``scripts/validate_sim.py --calibrate`` runs
  the same probes on each collective's own buffer, between its calls.

Shared machines are noisy (research/simulators.md saw 10x swings in BLAS throughput): the
1-minute load average is recorded and a warning printed when it exceeds the core count.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from simdist.device.profile import PROFILE_DIR

DEFAULT_OUT = PROFILE_DIR / "host.yaml"


def best_time(fn: Callable[[], Any], repeats: int, min_time: float = 0.02) -> float:
    """Best-of-``repeats`` seconds per call, each sample long enough to time reliably."""
    fn()  # warm up (page faults, BLAS thread start-up, JIT)
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - t0 >= min_time or calls >= 1 << 20:
            break
        calls *= 2
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def measure_gemm(sizes: list[int], repeats: int) -> dict[int, float]:
    """FLOP/s of float32 n x n x n GEMM per size (numba's ``np.dot``, the kernels' call)."""
    nn = _gemm_kernels()["nn"]
    rng = np.random.default_rng(0)
    out = {}
    for n in sizes:
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        c = np.empty((n, n), np.float32)
        t = best_time(lambda a=a, b=b, c=c: nn(a, b, c), repeats)
        out[n] = 2.0 * n**3 / t
    return out


SHAPE_BIG = 512  # the other two dimensions of the shape sweep


def _gemm_kernels() -> dict[str, Callable]:
    """``np.dot(a, b, c)`` inside numba, as simdist's kernels call BLAS, per layout."""
    from numba import njit

    jit = njit(cache=False, nogil=True, error_model="numpy", boundscheck=False)

    @jit
    def nn(a, b, c):  # pragma: no cover - compiled
        np.dot(a, b, c)

    @jit
    def nt(a, b, c):  # pragma: no cover - compiled
        np.dot(a, b.T, c)

    @jit
    def tn(a, b, c):  # pragma: no cover - compiled
        np.dot(a.T, b, c)

    return {"nn": nn, "nt": nt, "tn": tn}


def measure_gemm_shapes(smalls: list[int], repeats: int) -> dict[str, dict[str, dict]]:
    """FLOP/s of float32 GEMMs with one dimension ``s`` and the other two ``SHAPE_BIG``, per
    layout (nn: a @ b; nt: a @ b.T; tn: a.T @ b, the transposed operand an F-contiguous
    view, as the kernels pass it) and per axis of the small one (m: a micro-batch's rows;
    k: a weight gradient's inner dimension; n: few output columns)."""
    rng = np.random.default_rng(1)
    big = SHAPE_BIG
    out: dict[str, dict[str, dict]] = {}
    for layout, fn in _gemm_kernels().items():
        out[layout] = {"m": {}, "k": {}, "n": {}}
        for s in smalls:
            shapes = ((s, big, big), (big, s, big), (big, big, s))
            for axis, (m, k, n) in zip("mkn", shapes, strict=True):
                a_shape = (k, m) if layout == "tn" else (m, k)
                b_shape = (n, k) if layout == "nt" else (k, n)
                a = rng.standard_normal(a_shape, dtype=np.float32)
                b = rng.standard_normal(b_shape, dtype=np.float32)
                c = np.empty((m, n), np.float32)
                t = best_time(lambda a=a, b=b, c=c, fn=fn: fn(a, b, c), repeats)
                out[layout][axis][s] = 2.0 * m * k * n / t
    return out


def measure_memory(sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Bytes moved per second (read + write) for copy and add, per array size in bytes."""
    res: dict[str, dict[int, float]] = {"copy": {}, "add": {}}
    # views of one large array, as the kernels' operands are views of the flat buffers and
    # the activation arena
    big = max(sizes) // 4 + 1024
    pool = np.ones(3 * big, np.float32)
    for nbytes in sizes:
        n = nbytes // 4
        a, b, c = pool[:n], pool[big : big + n], pool[2 * big : 2 * big + n]
        t = best_time(lambda a=a, c=c: np.copyto(c, a), repeats)
        res["copy"][nbytes] = 2 * nbytes / t
        t = best_time(lambda a=a, b=b, c=c: np.add(a, b, out=c), repeats)
        res["add"][nbytes] = 3 * nbytes / t
    return res


def measure_scalar(repeats: int) -> dict[str, float]:
    """FLOP/s of reductions, which the kernels compile without fastmath and LLVM therefore
    leaves scalar (a loop-carried dependency): fp32, ``kernels.rowops.row_sum`` (eight
    partial sums, 1 flop per element) on rows of 256 as layernorm and softmax run it; fp64,
    the gradient norm's ``kernels.optim.sum_of_squares`` (2 flops per element). On cached
    data, so the rate is the core's, not memory's."""
    from numba import njit

    from simdist.kernels.optim import sum_of_squares
    from simdist.kernels.rowops import row_sum

    @njit(cache=False, nogil=True, error_model="numpy", boundscheck=False)
    def rows(x, reps):  # pragma: no cover - compiled
        total = np.float32(0.0)
        for _ in range(reps):
            for r in range(x.shape[0]):
                total += row_sum(x[r], x.shape[1])
        return total

    x32 = np.full((64, 256), 1.0000001, np.float32)  # 64 KiB
    rows(x32, 1)
    t32 = best_time(lambda: rows(x32, 100), repeats)
    x64 = np.full(1 << 16, 1.0000001, np.float32)  # 256 KiB: in L2
    t64 = best_time(lambda: sum_of_squares(x64), repeats)
    return {"fp32": 100.0 * x32.size / t32, "fp64": 2.0 * x64.size / t64}


def measure_vector(repeats: int) -> tuple[float, float]:
    """(FLOP/s of vectorised elementwise arithmetic, per-call overhead in seconds).

    The rate is the core's SIMD arithmetic: a degree-8 polynomial per element (Horner: 16
    flops, multiplies and adds, as numba emits them without fastmath) on a 16 KiB array,
    enough work per element that loads and stores do not bound it, as in the kernels'
    exp and tanh polynomials. Memory-bound kernels are bounded by the memory rate instead.
    """
    from numba import njit

    @njit(cache=False, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)
    def poly_loop(a, c, reps):  # pragma: no cover - compiled
        for _ in range(reps):
            for i in range(a.size):
                x = a[i]
                r = np.float32(0.1)
                for _ in range(8):
                    r = r * x + np.float32(0.5)
                c[i] = r

    @njit(cache=False, nogil=True, error_model="numpy")
    def nothing(a):  # pragma: no cover - compiled
        a[0] = a[0]

    n, reps = 4096, 500  # 16 KiB per array: stays in L1/L2
    a = np.full(n, 0.9999999, np.float32)
    c = np.zeros(n, np.float32)
    poly_loop(a, c, 1)
    nothing(a)
    t = best_time(lambda: poly_loop(a, c, reps), repeats)
    overhead = best_time(lambda: nothing(a), repeats, min_time=0.01)
    return 16.0 * n * reps / t, overhead


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
        self._max, self._float = MPI.MAX, MPI.FLOAT

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
        step of a 2-rank ring all-gather)."""
        n, mine, theirs = self._offsets(nbytes, buf.size)
        send, recv = buf[mine : mine + n], buf[theirs : theirs + n]
        buf[: 2 * n].fill(1.0)
        comm, peer, f = self.comm, self.peer, self._float
        return self._timed(lambda: comm.Sendrecv([send, f], peer, 0, [recv, f], peer, 0))

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
        self, coll: Any, tiny: np.ndarray, repeats: int, warmup: int = 3
    ) -> dict[str, float]:
        """Best of ``repeats``: the bare Sendrecv of 32 B (``raw``); simdist's ring
        all-gather of 16 floats less its p - 1 such steps (``call``: the call's own Python,
        paid once per collective); where ``coll`` shares memory, the bare fence (``fence``)
        and ``step``, a fence as the shm algorithm pays it: half of its reduce-scatter of 16
        floats less the addition inside it (``direct`` on 32 B), which the size probes
        already time. ``tiny``: 16 floats from ``coll.buffer``; ``warmup`` calls of each
        first, not counted."""
        views, fence = coll.peer_views(tiny) if coll.registered(tiny) else (None, None)
        peer = self.peer if self.peer is not None else self.rank
        steps = self.comm.Get_size() - 1
        best = {k: float("inf") for k in ("raw", "ring", "shm", "add", "fence")}
        for i in range(warmup + repeats):
            tiny.fill(i)
            got = {
                "raw": self._timed(
                    lambda: self.comm.Sendrecv(tiny[:8], dest=peer, recvbuf=tiny[8:], source=peer)
                ),
                "ring": self._timed(lambda: coll.allgather(tiny, algorithm="ring"), True),
            }
            if fence is not None:
                got["shm"] = self._timed(lambda: coll.reduce_scatter(tiny, algorithm="shm"), True)
                got["add"] = self.direct(views, fence, 32, "add")
                got["fence"] = self._timed(fence, True)
            if i >= warmup:
                for k, v in got.items():
                    best[k] = min(best[k], v)
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
    for i in range(3 + 10 * repeats):
        for nbytes in sizes:
            t = probe.exchange(pool, nbytes)
            sendrecv[nbytes] = min(sendrecv[nbytes], t) if i >= 3 else sendrecv[nbytes]
            if nbytes in reduce:
                t = probe.reduce(pool, nbytes)
                reduce[nbytes] = min(reduce[nbytes], t) if i >= 3 else reduce[nbytes]
    coll = Collectives(comm)
    lat = probe.latencies(coll, coll.buffer(16), 100 * repeats)
    mpi = mpi_results(
        sizes,
        [sendrecv[s] for s in sizes],
        REDUCE_SIZES,
        [reduce[s] for s in REDUCE_SIZES],
        lat["call"],
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
    the latency (``size_efficiency``) and the reduce exchange's (``reducing_efficiency``),
    both as fractions of the faster; ``reduce_bw``: the add rate in bytes reduced per
    second (``reduce_gbs``, the γ of the closed forms)."""
    a_sr, b_sr = mpi["sendrecv_fit"]
    rates = message_rates(mpi["sizes"], mpi["sendrecv"], a_sr)
    reducing = message_rates(mpi["reduce_sizes"], mpi["reduce"], a_sr)
    bw = max([*rates.values(), *reducing.values()], default=1 / b_sr)
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
    return link


def mpi_results(
    sizes: list[int],
    sendrecv: list[float],
    reduce_sizes: list[int],
    reduce: list[float],
    call: float,
) -> dict[str, Any]:
    """``measure_link``'s MPI results from its probes' times (seconds per size): what
    ``mpi_link`` reads, the α-β fit of the Sendrecv included."""
    return {
        "sizes": sizes,
        "sendrecv": sendrecv,
        "sendrecv_fit": fit_alpha_beta(sizes, sendrecv),
        "reduce_sizes": reduce_sizes,
        "reduce": reduce,
        "call": call,
    }


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


def _min_size(size: int) -> str:
    return "the smallest size and below" if size == 0 else f"{size} B"


def _table_rows(rates: dict[int, float], peak: float) -> list[list[float]]:
    """[min size, rate / peak] rows, largest size first, the smallest keyed 0 (it covers
    everything below)."""
    sizes = sorted(rates, reverse=True)
    if not sizes:  # nothing measured above the latency: the plain rate everywhere
        return [[0, 1.0]]
    return [[0 if s == sizes[-1] else s, rates[s] / peak] for s in sizes]


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def render(m: dict[str, Any], previous: dict[str, Any] | None) -> str:
    """The host profile YAML, one comment per number saying how it was obtained."""
    cores = m["cores"]
    now = m["date"]
    gemm, mem = m["gemm"], m["memory"]
    peak_gemm = max(gemm.values())
    best_n = max(gemm, key=gemm.get)
    copy_peak = max(mem["copy"].values())
    add_peak = max(mem["add"].values())
    mem_peak = max(copy_peak, add_peak)
    mem_pts = {s: max(mem["copy"][s], mem["add"][s]) for s in mem["copy"]}
    big = max(mem["copy"])
    lines = [
        "# This machine as a simdist device: one rank = one core, one BLAS/numba thread.",
        f"# Written by `{m['command']}` on {now} (simdist.calibrate).",
        f"# Host: {m['host']}, {cores} cores (ranks beyond {cores} oversubscribe the cores),",
        f"# load average {m['loadavg']} at the start; OPENBLAS_CORETYPE="
        f"{m['openblas_coretype']}, OPENBLAS_L2_SIZE={m['openblas_l2']}.",
        "# All numbers are measured here (best of N); re-run calibrate on another machine.",
        "name: host",
        f"description: this host ({m['cpu']}), one core per simulated device",
        "confidence: measured",
        "sources:",
        f'  calibrate: "simdist.calibrate measurements, {now}"',
        "compute:",
        "  matrix_tflops:",
        f"    fp32: {peak_gemm / 1e12:.6f}  # [calibrate] best float32 GEMM, n={best_n}: "
        f"{peak_gemm / 1e9:.1f} GFLOP/s",
        "    tf32: null          # no such unit on this CPU",
        "    bf16: null          # numpy/BLAS has no bf16 GEMM; kernels run float32",
        "    fp16: null          # numpy/BLAS has no fast fp16 GEMM",
        "  vector_tflops:",
        f"    fp32: {m['vector_flops'] / 1e12:.6f}  # [calibrate] numba degree-8 polynomial "
        f"per element, 16 KiB arrays: {m['vector_flops'] / 1e9:.1f} GFLOP/s",
        "    tf32: null          # not applicable",
        "    bf16: null          # not applicable",
        "    fp16: null          # not applicable",
        "  scalar_tflops:        # reductions: no fastmath, so LLVM leaves them scalar",
        f"    fp32: {m['scalar_flops']['fp32'] / 1e12:.6f}  # [calibrate] rowops.row_sum on "
        f"rows of 256: {m['scalar_flops']['fp32'] / 1e9:.2f} GFLOP/s",
        f"    fp64: {m['scalar_flops']['fp64'] / 1e12:.6f}  # [calibrate] float64 sum of "
        f"squares (the gradient-norm kernel), 256 KiB: {m['scalar_flops']['fp64'] / 1e9:.2f} "
        "GFLOP/s",
        f"  kernel_launch_us: {m['overhead'] * 1e6:.3f}  # [calibrate] Python -> numba call "
        "of an empty kernel",
        "  launch_mode: serial   # the host runs Python and kernel back to back",
        "  combine:              # per kind, as the ECM model has it for a CPU core",
        "    matmul: sum         # BLAS packs its operands first: their traffic adds",
        "    vector: roofline    # streaming loops: the prefetcher hides the traffic",
        "  matrix_efficiency:    # [min op GFLOP, fraction of peak] from the GEMM sweep",
    ]
    for n in sorted(gemm, reverse=True):  # the smallest size stands for everything below
        gflop = 2 * n**3 / 1e9 if n != min(gemm) else 0.0
        eff = gemm[n] / peak_gemm
        lines.append(
            f"    - [{gflop:.6g}, {eff:.4f}]  # [calibrate] n={n}: {gemm[n] / 1e9:.1f} GFLOP/s"
        )
    shapes = m.get("gemm_shapes") or {}
    if shapes:
        lines.append(
            "  matrix_shape_efficiency:  # [dim, fraction of peak] per layout (nn a @ b, nt a @ "
            f"b.T, tn a.T @ b) and small axis, the other two dims {SHAPE_BIG}"
        )
        for layout, axes in shapes.items():
            lines.append(f"    {layout}:")
            for axis, points in axes.items():
                dims = sorted(points, reverse=True)
                rows = ", ".join(
                    f"[{0 if s == dims[-1] else s}, {min(1.0, points[s] / peak_gemm):.4f}]"
                    for s in dims
                )
                rates = ", ".join(f"{s}: {points[s] / 1e9:.0f}" for s in dims)
                lines.append(f"      {axis}: [{rows}]  # [calibrate] GFLOP/s {rates}")
    lines += [
        "  vector_efficiency: null  # elementwise kernels are memory-bound here",
        "memory:",
        f"  capacity_gib: {m['mem_total'] / cores / 2**30:.3f}  # [calibrate] MemTotal "
        f"{m['mem_total'] / 2**30:.2f} GiB / {cores} cores (one rank per core)",
        f"  bandwidth_gbs: {mem_peak / 1e9:.3f}  # [calibrate] best of copy/add over sizes "
        "(read + write bytes)",
        "  efficiency_key: working_set  # a kernel's operands are as far away as the step's "
        "resident bytes reach (read between the sweep's points, linear in log size)",
        "  efficiency:           # [min MB moved, fraction of bandwidth] copy/add sweep",
    ]
    for size in sorted(mem_pts, reverse=True):
        eff = mem_pts[size] / mem_peak
        moved_mb = 2 * size / 1e6 if size != min(mem_pts) else 0.0
        lines.append(
            f"    - [{moved_mb:.6g}, {eff:.4f}]  # [calibrate] {size / 2**20:g} MiB arrays: "
            f"copy {mem['copy'][size] / 1e9:.1f}, add {mem['add'][size] / 1e9:.1f} GB/s"
        )
    lines += ["links:", f"  devices_per_node: {cores}  # [calibrate] os.cpu_count()"]
    mpi = m.get("mpi")
    prev_intra = ((previous or {}).get("links") or {}).get("intra")
    reduce_gbs = add_peak / 3 / 1e9  # an in-place add moves 3 bytes per byte reduced
    if mpi:
        a_pp, b_pp = mpi["pingpong_fit"]
        b_sr = mpi["sendrecv_fit"][1]
        direct = m.get("direct")
        link = intra_link(mpi, direct, reduce_gbs * 1e9)

        def rows(key: str, where: dict, indent: int, note: Callable[[int, float], str]) -> list:
            peak = where["bandwidth_gbs"] * 1e9
            return [
                f"{' ' * indent}- [{size}, {frac:.4f}]  # [calibrate] {note(size, frac * peak)}"
                for size, frac in where[key]
            ]

        def sized(prefix: str) -> Callable[[int, float], str]:
            return lambda s, r: f"{prefix} at {_min_size(s)}: {r / 1e9:.2f} GB/s"

        lines += [
            "  intra:                # MPI between two ranks on this host (shared memory)",
            f"    bandwidth_gbs: {link['bandwidth_gbs']:.4f}  # [calibrate] best rate of the "
            "Sendrecv and reduce exchanges over the sweep, per direction (Sendrecv fit: "
            f"{1 / b_sr / 1e9:.2f}; ping-pong fit {1 / b_pp / 1e9:.2f} GB/s)",
            f"    latency_us: {link['latency_us']:.3f}  # [calibrate] Sendrecv fit; ping-pong "
            f"fit {a_pp * 1e6:.2f} us",
            "    efficiency: 1.0     # the rates are achieved rates",
            f"    reduce_gbs: {reduce_gbs:.3f}  # [calibrate] np.add in place: add rate / 3",
            f"    call_overhead_us: {link['call_overhead_us']:.3f}  # [calibrate] simdist's "
            "ring all-gather of 16 floats minus its bare Sendrecv steps",
            "    size_efficiency:     # [min message bytes, fraction of bandwidth] Sendrecv "
            "sweep, after the latency",
            *rows("size_efficiency", link, 6, sized("Sendrecv")),
        ]
        if "reducing_efficiency" in link:
            lines += [
                "    reducing_efficiency: # [min message bytes, fraction of bandwidth] p2p's "
                "reduce exchange (send, receive and add), after the latency",
                *rows("reducing_efficiency", link, 6, sized("reduce exchange")),
            ]
        if "direct" in link:
            d = link["direct"]
            lines += [
                "    direct:              # peer load/store in a shared-memory window (shm)",
                f"      bandwidth_gbs: {d['bandwidth_gbs']:.4f}  # [calibrate] best rate of the "
                "copies below",
                f"      latency_us: {d['latency_us']:.3f}  # [calibrate] per fence of simdist's "
                "shm reduce-scatter of 16 floats, less its addition (the fence alone: "
                f"{direct['fence'] * 1e6:.2f} us)",
                "      efficiency: 1.0",
                f"      reduce_gbs: {reduce_gbs:.3f}  # [calibrate] as the link's",
                "      size_efficiency:   # [min bytes, fraction of bandwidth] loads: the peer's "
                "freshly written block copied into this rank's segment",
                *rows("size_efficiency", d, 8, sized("load")),
                "      store_efficiency:  # [min bytes, fraction of bandwidth] stores: this "
                "rank's block copied into the peer's segment (the all-reduce's second half)",
                *rows("store_efficiency", d, 8, sized("store")),
                "      reducing_efficiency: # [min bytes, fraction of bandwidth] loads that add: "
                "the peer's block added into this rank's",
                *rows("reducing_efficiency", d, 8, sized("load and add")),
            ]
    elif prev_intra and prev_intra.get("bandwidth_gbs"):
        lines += [
            "  intra:                # kept from the previous calibration (this run was serial)",
            f"    bandwidth_gbs: {prev_intra['bandwidth_gbs']}  # [previous] Sendrecv fit",
            f"    latency_us: {prev_intra.get('latency_us')}  # [previous] Sendrecv fit",
            f"    efficiency: {prev_intra.get('efficiency', 1.0)}  # [previous]",
            f"    reduce_gbs: {reduce_gbs:.3f}  # [calibrate] np.add in place: add rate / 3",
        ]
    else:
        lines += [
            "  intra:                # not measured: run under `mpiexec -n 2` to fit α and β",
            "    bandwidth_gbs: null  # unknown",
            "    latency_us: null    # unknown",
            "    efficiency: null    # unknown",
        ]
    lines += [
        "  inter: null           # no inter-node network measured from one host",
        "  host:                 # the device is the host: staging is a memory copy",
        f"    bandwidth_gbs: {copy_peak / 2 / 1e9:.3f}  # [calibrate] copy rate / 2 (bytes "
        "copied per second)",
        f"    latency_us: {m['overhead'] * 1e6:.3f}  # [calibrate] call overhead",
        "    efficiency: 1.0     # measured rate",
        "streaming: null",
        "calibration:           # raw measurements (ignored by the profile loader)",
        f"  date: {now!r}",
        f"  command: {m['command']!r}",
        f"  loadavg: {m['loadavg']!r}",
        "  gemm_gflops: {" + ", ".join(f"{n}: {r / 1e9:.2f}" for n, r in gemm.items()) + "}",
        "  copy_gbs: {" + ", ".join(f"{s}: {r / 1e9:.2f}" for s, r in mem["copy"].items()) + "}",
        "  add_gbs: {" + ", ".join(f"{s}: {r / 1e9:.2f}" for s, r in mem["add"].items()) + "}",
        f"  large_array_bytes: {big}",
    ]
    if mpi:
        lines += [
            "  mpi_sizes: " + str(mpi["sizes"]),
            "  pingpong_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in mpi["pingpong"]) + "]",
            "  sendrecv_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in mpi["sendrecv"]) + "]",
            "  reduce_sizes: " + str(mpi["reduce_sizes"]),
            "  reduce_exchange_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in mpi["reduce"]) + "]",
        ]
        direct = m.get("direct")
        if direct and direct["copy"]:
            lines += [
                "  direct_sizes: " + str(direct["sizes"]),
                "  direct_copy_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in direct["copy"]) + "]",
                "  direct_add_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in direct["add"]) + "]",
                "  direct_store_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in direct["store"]) + "]",
                f"  direct_fence_us: {direct['fence'] * 1e6:.2f}",
            ]
    elif prev_intra and prev_intra.get("bandwidth_gbs"):
        prev_date = ((previous or {}).get("calibration") or {}).get("date", "unknown date")
        lines.append(f"  link_source: 'kept from the calibration of {prev_date}'")
    else:
        lines.append("  link_source: 'not measured (serial run, no previous profile)'")
    return "\n".join(lines) + "\n"


def _compute_section(text: str) -> str:
    """The ``compute:`` block of a profile's text (up to the ``memory:`` line)."""
    start = text.index("\ncompute:\n") + 1
    return text[start : text.index("\nmemory:\n", start) + 1]


def _mpi_comm() -> Any | None:
    """The world communicator when launched by mpiexec with >= 2 ranks, else None."""
    launched = any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
    if not launched:
        return None
    from simdist.comm.world import world  # simdist.comm owns the mpi4py import

    comm = world()
    return comm if comm.Get_size() >= 2 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="profile YAML to write")
    ap.add_argument("--repeats", type=int, default=5, help="best-of-N samples per point")
    ap.add_argument("--rounds", type=int, default=3, help="sweeps over all sizes (best kept)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds (for tests)")
    ap.add_argument(
        "--link-only",
        metavar="BASE",
        help="re-measure only the links and memory (seconds, under mpiexec -n 2) and keep the "
        "compute section of the profile BASE (a name or YAML)",
    )
    args = ap.parse_args(argv)

    comm = _mpi_comm()
    base_compute = None
    if args.link_only:
        if comm is None:
            raise SystemExit("--link-only measures the MPI link: run under `mpiexec -n 2`")
        from simdist.device.profile import ProfileError, load_profile, profile_path

        try:  # a clear error before any measuring
            base = profile_path(args.link_only)
            load_profile(base)
        except ProfileError as err:
            raise SystemExit(f"--link-only: {err}") from None
        base_compute = _compute_section(base.read_text())
    rank = comm.Get_rank() if comm is not None else 0
    mpi, direct = measure_link(comm, args.repeats) if comm is not None else (None, None)
    if rank != 0:
        comm.Barrier()
        return 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cores = os.cpu_count() or 1
    if load > cores:
        print(f"warning: load average {load:.1f} exceeds {cores} cores; figures will be low")
    if args.quick:
        args.rounds = 1
    gemm_sizes = [64, 256] if args.quick else [64, 128, 256, 512, 1024]
    mem_sizes = [2**18, 2**24] if args.quick else [2**k for k in (18, 20, 21, 22, 23, 24, 25, 26)]
    # several rounds over all sizes, best per size: a burst of load from other processes
    # then spoils one round of one size instead of the whole point
    shape_sizes = [32, 128] if args.quick else [16, 32, 64, 128, 256, 512]
    gemm: dict[int, float] = {}
    shapes: dict[str, dict[str, dict[int, float]]] = {}
    memory: dict[str, dict[int, float]] = {"copy": {}, "add": {}}
    if base_compute is not None:  # compute comes from the base profile: skip its sweeps
        gemm_sizes, shape_sizes = [64], []
    for _ in range(args.rounds):
        for n, rate in measure_gemm(gemm_sizes, args.repeats).items():
            gemm[n] = max(gemm.get(n, 0.0), rate)
        for layout, axes in measure_gemm_shapes(shape_sizes, args.repeats).items():
            for axis, points in axes.items():
                best = shapes.setdefault(layout, {}).setdefault(axis, {})
                for n, rate in points.items():
                    best[n] = max(best.get(n, 0.0), rate)
        for kind, points in measure_memory(mem_sizes, args.repeats).items():
            for size, rate in points.items():
                memory[kind][size] = max(memory[kind].get(size, 0.0), rate)
    vector, overhead = measure_vector(args.repeats)
    scalar = measure_scalar(args.repeats)
    out = Path(args.out)
    previous = None
    if out.is_file():
        try:
            previous = yaml.safe_load(out.read_text())
        except yaml.YAMLError:
            previous = None
    cmd = "python -m simdist.calibrate " + " ".join(argv if argv is not None else sys.argv[1:])
    if comm is not None:
        cmd = f"mpiexec -n {comm.Get_size()} {cmd}"
    measured = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": cmd.strip(),
        "host": platform.node() or "unknown",
        "cpu": platform.processor() or platform.machine(),
        "cores": cores,
        "loadavg": f"{load:.2f}",
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", "(unset)"),
        "openblas_l2": os.environ.get("OPENBLAS_L2_SIZE", "(unset)"),
        "gemm": gemm,
        "gemm_shapes": shapes,
        "memory": memory,
        "vector_flops": vector,
        "scalar_flops": scalar,
        "overhead": overhead,
        "mem_total": _mem_total(),
        "mpi": mpi,
        "direct": direct,
    }
    text = render(measured, previous)
    if base_compute is not None:
        ours = _compute_section(text)
        text = text.replace(ours, base_compute)
        text = text.replace(
            "\nname: host\n",
            f"\n# --link-only: the compute section is {args.link_only}'s\nname: host\n",
            1,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"wrote {out}")
    if base_compute is not None:
        print(f"  compute kept from {args.link_only}")
    print(
        f"  GEMM {max(gemm.values()) / 1e9:.1f} GFLOP/s, memory "
        f"{max(max(v.values()) for v in memory.values()) / 1e9:.1f} GB/s, vector "
        f"{vector / 1e9:.1f} GFLOP/s, call overhead {overhead * 1e6:.2f} us"
    )
    if mpi:
        a, b = mpi["sendrecv_fit"]
        print(f"  MPI Sendrecv: alpha {a * 1e6:.2f} us, beta^-1 {1 / b / 1e9:.2f} GB/s")
    else:
        print("  MPI link not measured (serial run): kept previous figures or left null")
    if comm is not None:
        comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
