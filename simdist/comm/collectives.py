"""``Collectives``: simdist's collective operations on flat float32 buffers.

Validates arguments, optionally cross-checks them between ranks (``check=True``), chooses
the algorithm and dispatches to it. All operations work in place on 1-D contiguous float32
arrays.

Determinism. For "ring", "rhd", "hierarchical" and "shm" an all-reduce IS reduce-scatter +
all-gather over ``partition(len(buf), world)``, and averaging happens once, on the finished
owned block (see ``algorithm.average_block``). Each element's summation order therefore
depends only on the algorithm, the rank that owns its block and the world size (ring: a
chain starting after the owner; rhd: one fixed tree; hierarchical: the owner's chain inside
each node, then across nodes; shm: a chain starting at the owner; see ``ring.py``,
``rhd.py``, ``hierarchical.py``, ``shm.py``). Data
parallelism (all-reduce) and ZeRO (reduce-scatter over the same bounds + all-gather) get
bit-identical results, every replica gets the same bits, and runs repeat bit for bit.
"native" (MPI's own collectives) is the reference backend and makes none of these promises.

Traffic goes over a private duplicate of the caller's communicator, so simdist's messages
never match the application's.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
from mpi4py import MPI

from simdist.kernels.optim import sum_of_squares

from . import hierarchical, native, rhd, ring, shm  # noqa: F401  (importing registers them)
from .algorithm import ALGORITHMS, Algorithm, average_block
from .cost import choose_algorithm
from .hierarchical import check_placement
from .p2p import Exchanger
from .partition import bounds_list, partition
from .shm import check_single_node
from .topology import Placement
from .topology import placement as find_placement

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "allreduce_scalars")
_BLOCKED = ("allreduce", "reduce_scatter", "allgather")  # ops that work on bounds


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with arguments that do not agree (raised on every rank)."""


_UNCHANGED = nullcontext()  # half_wire with the wire already in place (reusable)


class Collectives:
    """Collective operations over ``comm``; see the module docstring for the guarantees.

    ``algorithm``: "ring", "rhd", "hierarchical", "shm", "native" or "auto" (default for every
    call; each call may override it). ``placement``: which node each rank is on; by default
    found from MPI's shared-memory split (collective), or given, e.g. ``Placement.blocks``
    to treat groups of ranks of one machine as nodes.

    ``check``: how ranks make sure they are in the same call before any data moves; on a
    difference every rank raises ``CollectiveMismatchError`` (a rank whose own arguments
    are invalid raises its own error) instead of hanging or silently mixing data.

    - ``False`` or "cheap" (the default): one 16-byte max-all-reduce of a hash of (call
      number, op, algorithm, length, dtype, root/average flag, arguments valid), holding the
      hash and its negation, so max == -max(-h) says all agree. A different length used to
      hang the job; the check costs one latency-bound message round per call (measured
      with scripts/bench_collectives.py; see the commit that added it).
    - ``True`` or "full": exchange the whole call signature (also a hash of the block
      bounds) with an Allgather every call, and name each rank's view in the error.
    - "off": no exchange at all (zero cost). Ranks that disagree then hang or mix data.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        algorithm: str = "auto",
        check: bool | str = False,
        placement: Placement | None = None,
    ):
        modes = {False: "cheap", True: "full", "cheap": "cheap", "full": "full", "off": "off"}
        if not isinstance(check, bool | str) or check not in modes:
            raise ValueError(f"check must be True, False, 'cheap', 'full' or 'off', not {check!r}")
        if algorithm != "auto" and algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown collective algorithm {algorithm!r}; choose from {['auto', *ALGORITHMS]}"
            )
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.world: int = comm.Get_size()
        self.placement = placement if placement is not None else find_placement(comm)
        if self.placement.world != self.world or self.placement.rank != self.rank:
            raise ValueError(
                f"placement is for rank {self.placement.rank} of {self.placement.world}, "
                f"this is rank {self.rank} of {self.world}"
            )
        if algorithm == "hierarchical":
            check_placement(self.placement)
        if algorithm == "shm":
            check_single_node(self.placement)
        self.algorithm = algorithm
        self.check: str = modes[check]
        self.calls = 0  # collective calls made on this rank (all ops)
        self._comm = comm.Dup()
        self._p2p = Exchanger(self._comm)
        self._impls: dict[str, Algorithm] = {}
        self._bounds: dict[int, list[int]] = {}  # default partition per length
        self._choices: dict[tuple[bool, int, bool], str] = {}  # "auto" decisions per length
        self._row = np.zeros(_NFIELDS, dtype=np.int64)
        self._table = np.zeros((self.world, _NFIELDS), dtype=np.int64)
        self._sig = np.zeros(2, dtype=np.int64)  # [h, -h] for the cheap check
        self._sig_spec = [self._sig, MPI.INT64_T]
        self._alg_index = {a: i for i, a in enumerate(ALGORITHMS)}

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has sent through simdist collectives (native: nominal)."""
        return self._p2p.bytes_sent

    @property
    def exchanger(self) -> Exchanger:
        """The pairwise exchanges (and their reused scratch) its algorithms run on."""
        return self._p2p

    def reserve_scratch(self, nbytes: int) -> int:
        """Grow the reused point-to-point scratch to at least ``nbytes`` now; it only grows
        when a call needs more, so a caller that reserves the largest need up front can
        account it once (simulated device workspace). Returns its size in bytes."""
        return int(self._p2p.scratch(-(-int(nbytes) // 4)).nbytes)

    @property
    def shared(self) -> bool:
        """Whether ``buffer`` hands out shared memory here (world > 1, all on one node)."""
        return self.world > 1 and self.placement.num_nodes == 1

    def can_share(self, nbytes: int) -> bool:
        """Collective: whether buffers of ``nbytes`` in all per rank can be shared memory
        here (``shared``, and the node's shared-memory filesystem has room for every rank's
        share); the same answer on every rank."""
        if not self.shared:
            return False
        ok = shm.window_room_error(int(nbytes) * self.world) is None
        return bool(self._comm.allreduce(ok, op=MPI.LAND))

    def buffer(self, n: int) -> np.ndarray:
        """Collective: a zeroed float32 buffer of ``n`` elements that the "shm" algorithm
        reduces in place, without staging (a shared-memory window segment, as NCCL's
        registered buffers), when every rank is on one node; a plain array otherwise. Any
        algorithm accepts it. Valid until ``free``."""
        if self.shared:
            impl = self._impl("shm")
            assert isinstance(impl, shm.SharedMemory)
            return impl.allocate(n)
        return np.zeros(int(n), dtype=np.float32)

    def registered(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` lies in a ``buffer`` (the "shm" algorithm needs no staging)."""
        impl = self._impls.get("shm")
        return isinstance(impl, shm.SharedMemory) and impl.is_registered(buf)

    def peer_views(self, buf: np.ndarray) -> tuple[list[np.ndarray], Callable[[], None]]:
        """Every rank's view of ``buf`` (from ``buffer``), indexed by rank, and the fence
        that orders loads and stores to them: what the "shm" algorithm itself works with
        (``simdist.calibrate`` times its primitives on them). Collective: the fence is."""
        impl = self._impls.get("shm")
        views = impl.views(buf) if isinstance(impl, shm.SharedMemory) else None
        if views is None:
            raise ValueError("peer_views needs a buffer from Collectives.buffer on one node")
        return views

    def choose(self, op: str, nbytes: int, registered: bool = False) -> str:
        """The algorithm "auto" runs for ``op`` on ``nbytes`` here (``cost.choose_algorithm``
        with this communicator's world size and placement, for a buffer from ``buffer``
        if ``registered``); the same on every rank."""
        return choose_algorithm(op, nbytes, self.world, self.placement, registered)

    def free(self) -> None:
        """Release the private communicator and shared windows (collective; the object and
        the arrays ``buffer`` returned are unusable after)."""
        for impl in self._impls.values():
            impl.free()
        self._impls.clear()
        if self._comm != MPI.COMM_NULL:
            self._comm.Free()

    # ------------------------------------------------------------------ operations

    def half_wire(self, fmt: int) -> AbstractContextManager[None]:
        """Collectives inside carry 16-bit words of format ``fmt`` (``kernels.half.BF16`` /
        ``F16``; 0: float32) and store every partial sum in it (``p2p``): a device reducing
        half-precision gradients. The buffers stay float32 holding values of that format.
        MPI's native algorithm has no half-precision sum: it moves float32 and rounds once.
        The wire already in place (float32 in a float32 run) changes nothing: no generator
        is made, as every step enters a few of these."""
        if fmt == self._p2p.half:
            return _UNCHANGED
        return self._switched_wire(fmt)

    @contextmanager
    def _switched_wire(self, fmt: int) -> Iterator[None]:
        before, self._p2p.half = self._p2p.half, fmt
        try:
            yield
        finally:
            self._p2p.half = before

    def allreduce(
        self,
        buf: np.ndarray,
        *,
        average: bool = False,
        algorithm: str | None = None,
        sumsq: bool = False,
    ) -> float | None:
        """Sum (or average) ``buf`` over all ranks, in place.

        ``sumsq``: return the float64 sum of squares of this rank's block of the result
        (``kernels.optim.sum_of_squares`` of ``buf[b[r]:b[r+1]]``, default partition), the
        share of a global norm that counts every element once across ranks; "shm" takes
        it in the reduction's own pass. Otherwise None.
        """
        name, b = self._begin("allreduce", buf, None, int(average), algorithm)
        if self.world > 1 and buf.size:
            impl = self._impl(name)
            if sumsq and isinstance(impl, shm.SharedMemory):
                return impl.allreduce(buf, b, average, sumsq=True)
            impl.allreduce(buf, b, average)
        if not sumsq:
            return None
        return sum_of_squares(buf[b[self.rank] : b[self.rank + 1]]) if buf.size else 0.0

    def reduce_scatter(
        self,
        buf: np.ndarray,
        *,
        bounds: np.ndarray | list[int] | None = None,
        average: bool = False,
        algorithm: str | None = None,
    ) -> np.ndarray:
        """Leave this rank's block of the sum (or average) in ``buf[bounds[r]:bounds[r+1]]``.

        Returns that view. The rest of ``buf`` is scratch afterwards.
        """
        name, b = self._begin("reduce_scatter", buf, bounds, int(average), algorithm)
        view = buf[b[self.rank] : b[self.rank + 1]]
        if self.world == 1 or buf.size == 0:
            return view
        self._impl(name).reduce_scatter(buf, b)
        if average:
            average_block(view, self.world, self._p2p.half)
        return view

    def allgather(
        self,
        buf: np.ndarray,
        *,
        bounds: np.ndarray | list[int] | None = None,
        algorithm: str | None = None,
    ) -> None:
        """Each rank's block ``buf[bounds[r]:bounds[r+1]]`` is valid on entry; all of it on exit."""
        name, b = self._begin("allgather", buf, bounds, 0, algorithm)
        if self.world > 1 and buf.size:
            self._impl(name).allgather(buf, b)

    def broadcast(self, buf: np.ndarray, root: int = 0, *, algorithm: str | None = None) -> None:
        """Copy ``buf`` of rank ``root`` into ``buf`` on every rank."""
        name, _ = self._begin("broadcast", buf, None, root, algorithm)
        if self.world > 1 and buf.size:
            self._impl(name).broadcast(buf, root)

    def barrier(self, *, algorithm: str | None = None) -> None:
        """Return only after every rank has entered the barrier."""
        name, _ = self._begin("barrier", None, None, 0, algorithm)
        if self.world > 1:
            self._impl(name).barrier()

    def allreduce_scalars(self, values: np.ndarray) -> np.ndarray:
        """Sum a few float64 values over ranks: gathered, then added in rank order 0, 1, ..

        Every rank adds the same numbers in the same order, so all get identical bits, and the
        result does not depend on any algorithm choice (use it for losses, norms, counters).
        """
        vals = np.ascontiguousarray(values, dtype=np.float64)
        self._begin("allreduce_scalars", vals, None, 0, "native")
        if self.world == 1:
            return vals.copy()
        table = np.empty((self.world, vals.size), dtype=np.float64)
        self._comm.Allgather([vals, MPI.DOUBLE], [table, MPI.DOUBLE])
        self._p2p.bytes_sent += vals.nbytes * (self.world - 1)
        total = table[0].copy()
        for row in table[1:]:
            total += row
        return total

    # ------------------------------------------------------------------ internals

    def _impl(self, name: str) -> Algorithm:
        impl = self._impls.get(name)
        if impl is None:
            impl = self._impls[name] = ALGORITHMS[name](self._comm, self._p2p, self.placement)
        return impl

    def _default_bounds(self, n: int) -> list[int]:
        hit = self._bounds.get(n)
        if hit is None:
            if len(self._bounds) >= 256:  # bounded: a training run uses a few sizes
                self._bounds.clear()
            hit = self._bounds[n] = partition(n, self.world).tolist()
        return hit

    def _auto(self, op: str, buf: np.ndarray | None) -> str:
        n = int(getattr(buf, "size", 0))
        registered = isinstance(buf, np.ndarray) and self.registered(buf)
        key = (op == "broadcast", n, registered)
        name = self._choices.get(key)
        if name is None:
            if len(self._choices) >= 256:
                self._choices.clear()
            name = self._choices[key] = self.choose(op, 4 * n, registered)
        return name

    def _begin(
        self,
        op: str,
        buf: np.ndarray | None,
        bounds: object,
        extra: int,
        algorithm: str | None,
    ) -> tuple[str, list[int]]:
        """Count the call, resolve the algorithm, validate; with check, compare across ranks.

        Returns the algorithm name and the block bounds as a list (the default partition
        where the op has bounds and the caller gave none).
        """
        self.calls += 1
        requested = algorithm or self.algorithm
        n = int(getattr(buf, "size", 0))
        name = self._auto(op, buf) if requested == "auto" else requested
        b: list[int] = []
        try:
            self._validate(op, buf, name, extra)
            if op in _BLOCKED:
                b = (
                    self._default_bounds(n)
                    if bounds is None
                    else bounds_list(bounds, n, self.world)
                )
            error = None
        except (TypeError, ValueError) as exc:
            error = exc
        if self.world > 1 and self.check != "off":
            if self.check == "full" or not self._agree(op, n, buf, extra, name, error):
                self._cross_check(op, buf, b, extra, name, error)
        if error is not None:
            raise type(error)(f"{op}: {error}") from None
        return name, b

    def _validate(self, op: str, buf: np.ndarray | None, name: str, extra: int) -> None:
        """Raise TypeError / ValueError for arguments no rank could run with."""
        if name not in ALGORITHMS:
            raise ValueError(
                f"unknown collective algorithm {name!r}; choose from {['auto', *ALGORITHMS]}"
            )
        if name == "hierarchical":
            check_placement(self.placement)
        if name == "shm":
            check_single_node(self.placement)
        if op == "broadcast" and not 0 <= extra < self.world:
            raise ValueError(f"root must be in [0, {self.world}), got {extra}")
        if buf is None:
            return
        want = np.float64 if op == "allreduce_scalars" else np.float32
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"buffer must be a numpy array, got {type(buf).__name__}")
        if buf.dtype != want:
            raise TypeError(f"buffer dtype must be {np.dtype(want)}, got {buf.dtype}")
        if buf.ndim != 1:
            raise ValueError(f"buffer must be 1-D, got shape {buf.shape}")
        if not buf.flags.c_contiguous:
            raise ValueError("buffer must be contiguous (pass a flat view, not a strided one)")
        if not buf.flags.writeable and op != "allreduce_scalars":
            raise ValueError("buffer must be writeable (the operation is in place)")

    def _agree(
        self, op: str, n: int, buf: np.ndarray | None, extra: int, name: str, error: object
    ) -> bool:
        """The cheap check: whether every rank hashed the same call (one 16-byte Allreduce).

        Python hashes tuples of ints the same in every process (no per-process salt, unlike
        str), so equal calls give equal hashes. 62 bits keep -h inside int64.
        """
        dtype = buf.dtype.num if isinstance(buf, np.ndarray) else -1
        alg = self._alg_index.get(name, -1)
        # op as its index: str hashes are salted per process (PYTHONHASHSEED)
        h = hash((self.calls, _OP_INDEX[op], alg, n, dtype, extra, error is None)) & _HASH_MASK
        sig = self._sig
        sig[0], sig[1] = h, -h
        self._comm.Allreduce(MPI.IN_PLACE, self._sig_spec, op=MPI.MAX)
        return bool(sig[0] == -sig[1])  # max(h) == min(h): one value on every rank

    def _cross_check(
        self,
        op: str,
        buf: np.ndarray | None,
        bounds: list[int],
        extra: int,
        name: str,
        error: Exception | None,
    ) -> None:
        """One tiny Allgather of each rank's call signature; raise on every rank if any differ."""
        row = self._row
        row[_SEQ] = self.calls
        row[_OP] = OPS.index(op)
        row[_ALG] = list(ALGORITHMS).index(name) if name in ALGORITHMS else -1
        row[_LEN] = -1 if buf is None else int(getattr(buf, "size", -1))
        row[_DTYPE] = np.dtype(buf.dtype).num if isinstance(buf, np.ndarray) else -1
        row[_EXTRA] = extra
        if bounds:
            row[_EXTRA] |= zlib.crc32(np.asarray(bounds, dtype=np.int64).tobytes()) << 1
        row[_OK] = int(error is None)
        table = self._table
        self._comm.Allgather([row, MPI.INT64_T], [table, MPI.INT64_T])
        if (table == row).all() or error is not None:  # a local error is raised by _begin
            return
        raise CollectiveMismatchError(_describe_mismatch(op, table))


# Fields of the check-mode signature row.
_SEQ, _OP, _ALG, _LEN, _DTYPE, _EXTRA, _OK = range(7)
_NFIELDS = 7
_HASH_MASK = (1 << 62) - 1
_OP_INDEX = {op: i for i, op in enumerate(OPS)}


def _describe_mismatch(op: str, table: np.ndarray) -> str:
    """A message naming the operation and every rank's view of the call."""
    algs = list(ALGORITHMS)

    def per_rank(field: int, show=lambda v: str(int(v))) -> str:
        return ", ".join(f"rank {r}: {show(v)}" for r, v in enumerate(table[:, field]))

    lines = [f"collective arguments differ across ranks in {op} (call #{table[0, _SEQ]})"]
    lines.append(f"  lengths: {per_rank(_LEN)}")
    if len(set(table[:, _OP])) > 1:
        lines.append(f"  ops: {per_rank(_OP, lambda v: OPS[v])}")
    if len(set(table[:, _SEQ])) > 1:
        lines.append(f"  call numbers: {per_rank(_SEQ)}")
    if len(set(table[:, _ALG])) > 1:
        lines.append(f"  algorithms: {per_rank(_ALG, lambda v: algs[v] if v >= 0 else '?')}")
    if len(set(table[:, _DTYPE])) > 1:
        lines.append(f"  dtypes: {per_rank(_DTYPE, lambda v: _dtype_name(int(v)))}")
    if len(set(table[:, _EXTRA])) > 1:
        lines.append(f"  bounds, root or average flag: {per_rank(_EXTRA)}")
    bad = [r for r in range(table.shape[0]) if not table[r, _OK]]
    if bad:
        lines.append(f"  invalid arguments (see their own error) on ranks {bad}")
    return "\n".join(lines)


_DTYPE_NAMES = {np.dtype(c).num: np.dtype(c).name for c in np.typecodes["All"] if c not in "MmV"}


def _dtype_name(num: int) -> str:
    return _DTYPE_NAMES.get(num, "not an array" if num < 0 else f"dtype #{num}")
