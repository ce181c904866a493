"""Shared-memory collectives: the ranks of one node read each other's buffers directly.

MPI-3 shared-memory windows (``MPI_Win_allocate_shared``) map every rank's segment into
every other rank's address space, so a collective needs no messages at all, only loads and
stores and a few synchronisation points ("fences": ``Win_sync``, barrier, ``Win_sync``,
the MPI-3 pattern for the unified memory model). This is the CPU analogue of NCCL's
peer-to-peer "two-shot" all-reduce inside an NVLink node:

- reduce-scatter: fence (every input is there); rank r sums block r of all ranks' inputs
  into its own buffer; fence (nobody still reads an input);
- all-gather: fence (every owned block is there); each rank copies the other blocks from
  their owners; fence;
- all-reduce: fence; sum (and average) the owned block and write it into the other
  ranks' buffers (each rank only ever reads its own block's range of the others, so
  nobody reads what is being written); fence. Two fences, and the result lands in every
  buffer by stores: nobody reads a block its owner has just written.

A buffer from ``SharedMemory.allocate`` (``Collectives.buffer``: the gradients and
parameters of a training run) IS a window segment, and the collective works on it in place
("zero-copy": per rank and all-reduce, one pass over the owned block of every rank's input
and one store of the result into each other rank's buffer, against the ring's 2 (p-1)/p n
of messages, each copied into and out of MPI's own shared buffers). Any other buffer is
staged through a reused window first: what the peers need is copied in, the owned result
copied out.

Summation order: block r's elements are ``(..((x[r] + x[r+1]) + x[r+2]) + ..) + x[r-1]``
(rank indices mod p): it depends only on the owner r, so an all-reduce, a reduce-scatter +
all-gather and a reduce-scatter over any sub-range with the same owners give the same bits
(DP = ZeRO-1 = ZeRO-2), and at p = 2 they are the ring's bits.

``bytes_sent`` counts what crosses between this rank's memory and the others' (their parts
of its input, read by them; its reduced block, read by them or written by it, p - 1 times):
for equal blocks 2 (p-1)/p n per all-reduce, as the ring sends.

Needs every rank on one node (shared memory); a buffer passed as "registered" must be the
same view (same offset into its window) on every rank, which holds for buffers carved from
one layout.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from simdist.kernels.half import round_half
from simdist.kernels.optim import LANES, sum_of_squares
from simdist.kernels.reduce import add_divide, add_divide_store

from .algorithm import Algorithm, average_block, register_algorithm
from .p2p import Exchanger
from .topology import Placement

# Where MPICH (and Open MPI's session directory, when it can) back shared windows: a tmpfs
# whose size is often capped (Docker: 64 MB). Touching window pages beyond it is SIGBUS, so
# windows are only created when they fit.
SHM_DIR = "/dev/shm"
SHM_MARGIN = 16 << 20  # bytes left free for MPI's own shared segments


def shared_memory_free() -> int | None:
    """Bytes free in ``SHM_DIR`` (None: no such filesystem here, nothing to check)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def window_room_error(nbytes: int) -> str | None:
    """Why a window of ``nbytes`` in all (every rank's segment) cannot be created, or None."""
    free = shared_memory_free()
    if free is None or nbytes + SHM_MARGIN <= free:
        return None
    return (
        f"a shared-memory window of {nbytes / 2**20:.1f} MiB does not fit in {SHM_DIR} "
        f"({free / 2**20:.1f} MiB free); enlarge it (docker run --shm-size=..., or "
        f"mount -o remount,size=... {SHM_DIR})"
    )


def check_single_node(place: Placement | None) -> None:
    """Raise ValueError unless every rank shares one node's memory."""
    if place is not None and place.num_nodes > 1:
        raise ValueError(
            "the shm algorithm needs every rank on one node (shared memory); this run "
            f"has {place.num_nodes} nodes (use collective_algorithm auto, ring, rhd or "
            "hierarchical)"
        )


def _address(buf: np.ndarray) -> int:
    return buf.__array_interface__["data"][0]


class SharedMemoryFullError(MemoryError):
    """The shared-memory filesystem has no room for a window (raised on every rank)."""


class _Window:
    """One shared window of ``n`` float32 per rank, with every rank's segment mapped here."""

    def __init__(self, comm: MPI.Comm, n: int):
        # every rank sees the same filesystem (one node), so all raise alike before the
        # collective allocation instead of one rank dying of SIGBUS on a page it touches
        error = window_room_error(4 * max(n, 1) * comm.Get_size())
        if error:
            raise SharedMemoryFullError(f"{error}, or use the ring or rhd algorithm")
        self.n = n
        self.win = MPI.Win.Allocate_shared(4 * max(n, 1), 4, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch, so Win_sync may be called
        self.segments = []
        for q in range(comm.Get_size()):
            mem, _ = self.win.Shared_query(q)
            self.segments.append(np.frombuffer(mem, dtype=np.float32, count=n))
        self.base = _address(self.segments[comm.Get_rank()])

    def offset_of(self, addr: int, size: int) -> int | None:
        """Element offset of the ``size`` floats at address ``addr`` inside this rank's
        segment, or None if they are not inside."""
        off, extra = divmod(addr - self.base, 4)
        if extra or off < 0 or off + size > self.n:
            return None
        return off

    def free(self) -> None:
        self.segments = []
        self.win.Unlock_all()
        self.win.Free()


@register_algorithm
class SharedMemory(Algorithm):
    name = "shm"

    @classmethod
    def placement_error(cls, placement: Placement) -> str | None:
        try:
            check_single_node(placement)
        except ValueError as e:
            return str(e)
        return None

    def __init__(self, comm: MPI.Comm, p2p: Exchanger, placement: Placement | None = None):
        super().__init__(comm, p2p, placement)
        check_single_node(placement)
        self._registered: list[_Window] = []
        self._stage: _Window | None = None
        self._lanes = np.zeros(LANES)  # add_divide_store's scratch (the norm's lanes)
        # registered arrays seen before: id -> (the array, its views, window). Held, so the
        # id is not reused while cached. A step calls with the same few arrays, and once
        # backward has streamed its data through the CPU caches, building the address
        # (numpy's interface dict) and the views is one of the slowest parts of a call's
        # Python; a hit is one dict lookup.
        self._known: dict[int, tuple[np.ndarray, list[np.ndarray], _Window]] = {}

    # ------------------------------------------------------------------ buffers

    def allocate(self, n: int) -> np.ndarray:
        """Collective: a zeroed float32 buffer of ``n`` elements in a new window; the
        collectives work on it (and on views of it) without staging."""
        w = _Window(self.comm, int(n))
        w.segments[self.rank][:] = 0.0
        self._registered.append(w)
        self._fence(w)
        return w.segments[self.rank]

    def is_registered(self, buf: np.ndarray) -> bool:
        return self._peers(buf)[1] is not None

    def _peers(self, buf: np.ndarray) -> tuple[list[np.ndarray], _Window | None]:
        """Every rank's view of ``buf`` if it is registered (and the window), else ([], None)."""
        hit = self._known.get(id(buf))
        if hit is not None and hit[0] is buf:
            return hit[1], hit[2]
        addr = _address(buf)  # once: numpy builds the interface dict on every access
        for w in self._registered:
            off = w.offset_of(addr, buf.size)
            if off is not None:
                views = [s[off : off + buf.size] for s in w.segments]
                if len(self._known) >= 64:  # views made per call: keep the table small
                    self._known.clear()
                self._known[id(buf)] = (buf, views, w)
                return views, w
        return [], None

    def views(self, buf: np.ndarray) -> tuple[list[np.ndarray], Callable[[], None]] | None:
        """Every rank's view of a registered ``buf`` and the fence of its window, or None."""
        src, w = self._peers(buf)
        if w is None:
            return None
        return src, lambda: self._fence(w)

    def _staging(self, n: int) -> tuple[list[np.ndarray], _Window]:
        """The reused staging window, grown (collectively: ``n`` agrees on all ranks)."""
        w = self._stage
        if w is None or w.n < n:
            if w is not None:
                w.free()
            w = self._stage = _Window(self.comm, max(n, 2 * w.n if w else n))
        return [s[:n] for s in w.segments], w

    def _fence(self, w: _Window) -> None:
        w.win.Sync()
        self.comm.Barrier()
        w.win.Sync()

    def free(self) -> None:
        self._known.clear()
        for w in self._registered:
            w.free()
        self._registered = []
        if self._stage is not None:
            self._stage.free()
            self._stage = None

    # ------------------------------------------------------------------ operations

    @property
    def _elem(self) -> int:
        """Bytes of an element as the collective's format counts it (2: a half wire)."""
        return 2 if self.p2p.half else 4

    def _sum_owned(
        self,
        src: list[np.ndarray],
        out: np.ndarray,
        lo: int,
        hi: int,
        average: bool = False,
        store_sumsq: bool = False,
    ) -> float | None:
        """``out`` (holding this rank's values of block [lo, hi)) += the other ranks', in
        the order r+1, r+2, .. (mod p); with ``average`` the last addition is fused with
        ``average_block``'s division (the same bits, one pass fewer). ``store_sumsq`` (with
        ``average``, float32): that last pass also stores the result over the last peer's
        values it has just read (``add_divide_store``: each piece is added before it is
        stored, and no other rank reads this range there) and returns ``sum_of_squares`` of
        the result; the caller stores into the other peers. Else returns None."""
        r, p, half = self.rank, self.world, self.p2p.half
        if hi > lo:
            for k in range(1, p):
                x = src[(r + k) % p][lo:hi]
                if average and k == p - 1 and not half:
                    if store_sumsq:
                        return add_divide_store(out, x, np.float32(p), x, self._lanes)
                    add_divide(out, x, np.float32(p))
                else:
                    np.add(out, x, out=out)
                    if half:  # a half-precision reduction stores every partial sum
                        round_half(out, half)
            if average and half:
                average_block(out, p, half)
        return None

    def _copy_others(self, src: list[np.ndarray], buf: np.ndarray, bounds: list[int]) -> None:
        for q in range(self.world):
            if q != self.rank and bounds[q + 1] > bounds[q]:
                np.copyto(buf[bounds[q] : bounds[q + 1]], src[q][bounds[q] : bounds[q + 1]])

    def _stage_all_but(self, buf: np.ndarray, lo: int, hi: int) -> tuple[list, _Window]:
        """Staged inputs: the peers read every block of this rank's values but its own."""
        src, w = self._staging(buf.size)
        mine = src[self.rank]
        mine[:lo] = buf[:lo]
        mine[hi:] = buf[hi:]
        return src, w

    def reduce_scatter(self, buf: np.ndarray, bounds: list[int]) -> None:
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        src, w = self._peers(buf)
        if w is None:
            src, w = self._stage_all_but(buf, lo, hi)
        self._fence(w)
        self._sum_owned(src, buf[lo:hi], lo, hi)
        self._fence(w)
        self.p2p.bytes_sent += self._elem * (buf.size - (hi - lo))

    def allgather(self, buf: np.ndarray, bounds: list[int]) -> None:
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        src, w = self._peers(buf)
        if w is None:
            src, w = self._staging(buf.size)
            np.copyto(src[self.rank][lo:hi], buf[lo:hi])
        self._fence(w)
        self._copy_others(src, buf, bounds)
        self._fence(w)
        self.p2p.bytes_sent += self._elem * (self.world - 1) * (hi - lo)

    def allreduce(
        self, buf: np.ndarray, bounds: list[int], average: bool, sumsq: bool = False
    ) -> float | None:
        """Sum (and average) the owned block, then store it into the other ranks' buffers:
        two fences, the reduce-scatter's bits. ``sumsq``: also return ``sum_of_squares`` of
        the owned block of the result, taken while it is still in cache."""
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        src, w = self._peers(buf)
        staged = w is None
        if staged:
            src, w = self._stage_all_but(buf, lo, hi)
        self._fence(w)
        owned = buf[lo:hi]
        # the DP gradient path (average, sumsq, float32) stores into the last peer and takes
        # the norm's share in its last addition's pass: one pass over the block, not three
        fused = sumsq and average and not self.p2p.half and hi > lo
        partial = self._sum_owned(src, owned, lo, hi, average, store_sumsq=fused)
        if sumsq and not fused:
            partial = sum_of_squares(owned)
        if hi > lo:
            done = (self.rank - 1) % self.world if fused else self.rank  # stored by the pass
            for q in range(self.world):
                if q != self.rank and q != done:
                    np.copyto(src[q][lo:hi], owned)
        self._fence(w)
        if staged:  # the others' blocks arrived in this rank's staging segment
            mine = src[self.rank]
            buf[:lo] = mine[:lo]
            buf[hi:] = mine[hi:]
        self.p2p.bytes_sent += self._elem * (buf.size - (hi - lo) + (self.world - 1) * (hi - lo))
        return partial

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        src, w = self._peers(buf)
        if w is None:
            src, w = self._staging(buf.size)
            if self.rank == root:
                np.copyto(src[root], buf)
        self._fence(w)
        if self.rank != root:
            np.copyto(buf, src[root])
        else:
            self.p2p.bytes_sent += self._elem * (self.world - 1) * buf.size
        self._fence(w)
