"""Synchronous data parallelism and ZeRO-1/2/3 as "which slice and which collective".

| level | gradients held        | sync                                    | optimizer state |
|-------|-----------------------|-----------------------------------------|-----------------|
| 0 DP  | whole buffer          | all-reduce of the whole buffer          | whole buffer    |
| 1     | whole buffer          | reduce-scatter to own slice; all-gather | own slice       |
|       |                       | of the updated parameter slices         |                 |
| 2     | own slice + 1 bucket  | reduce-scatter each gradient group as   | own slice       |
|       |                       | backward finishes it; all-gather params |                 |
| 3     | own slice + 1 bucket  | as 2; parameters: own slice only, each  | own slice       |
|       |                       | stage's groups all-gathered into a      |                 |
|       |                       | window before its forward and backward  |                 |

simdist's all-reduce is reduce-scatter + all-gather over the slice boundaries
(``Layout.bounds``), and a reduce-scatter restricted to one group's range sums every element
in the same order as the whole-buffer one (the order depends only on the element's owner),
so levels 0, 1 and 2 train to bit-identical parameters (gradient accumulation aside: ZeRO-2
reduces every micro-batch, which is what keeps its gradient memory at one slice). Level 3
gathers copies of exactly the values levels 1/2 hold after their all-gather, so the model
computes the same bits from them (``PartitionedParameters``; the gather schedule is
``simdist.param_gather``).
"""

from __future__ import annotations

import numpy as np

from simdist.comm import Collectives, partition
from simdist.kernels.half import pack_half, unpack_half
from simdist.kernels.optim import sum_of_squares

from .arena import Layout
from .models.base import GradientGroup, GradientViews
from .param_gather import BACKWARD, FORWARD, GatherPlan, WindowCache, stage_gathers
from .precision import read_words, write_words


class GradientSync:
    def __init__(
        self, coll: Collectives, layout: Layout, level: int, algorithm: str, shared: bool = False
    ):
        self.coll, self.layout, self.level = coll, layout, level
        self.partition = layout.shard(coll.rank)  # this rank's ZeRO slice / all-reduce chunk
        # the flat range this rank's optimizer updates
        self.update_range = self.partition if level > 0 else (0, layout.padded)
        # One algorithm for every gradient collective: "auto" picks by message size, and a
        # per-group reduce-scatter must sum in the same order as the whole-buffer one.
        # ``shared``: the run allocates their buffers with coll.buffer (shared memory).
        if algorithm == "auto":
            algorithm = coll.choose("reduce_scatter", 4 * layout.padded, shared)
        self.algorithm = algorithm
        # the all-reduce's blocks (default partition) are the ZeRO slices: its per-block sum
        # of squares is this rank's share of the global norm
        self._sumsq_is_own = bool(
            np.array_equal(partition(layout.padded, coll.world), layout.bounds)
        )

    def reduce_gradients(self, grads: np.ndarray | None) -> tuple[np.ndarray, float | None]:
        """Average gradients across replicas; returns the gradients for update_range and,
        where the collective took it on the way (DP), the sum of squares of this rank's
        ``partition`` of them (else None: the caller computes it)."""
        if self.level == 0:
            own = self.coll.allreduce(
                grads, average=True, algorithm=self.algorithm, sumsq=self._sumsq_is_own
            )
            return grads, own
        if self.level == 1:
            return self.coll.reduce_scatter(
                grads, bounds=self.layout.bounds, average=True, algorithm=self.algorithm
            ), None
        return self.sharded.finish_step(), None

    def global_norm(self, reduced: np.ndarray) -> float:
        """L2 norm of the averaged gradient, each element counted once across ranks."""
        lo, hi = self.partition
        offset = self.update_range[0]
        partial = sum_of_squares(reduced[lo - offset : hi - offset])
        total = self.coll.allreduce_scalars(np.array([partial], np.float64))[0]
        return float(np.sqrt(total))

    def gather_parameters(self, params: np.ndarray | None, words: bool = False) -> None:
        """Levels 1-2: all-gather the updated slices (``words``: ``params`` holds 16-bit
        words, two per float32 element, so every bound halves; the layout's bounds are
        even). Level 3 gathers nothing here (each stage gathers its own before it runs):
        the windows are stale from now on."""
        if self.level == 3:
            self.partitioned.cache.invalidate()
        elif self.level > 0:
            bounds = self.layout.bounds // 2 if words else self.layout.bounds
            self.coll.allgather(params, bounds=bounds, algorithm=self.algorithm)

    def make_sharded(self, groups: list[GradientGroup], alloc) -> ShardedGradients:
        self.sharded = ShardedGradients(self, groups, alloc)
        return self.sharded


class ShardedGradients(GradientViews):
    """ZeRO-2 gradient sink: a group's gradients are written into a bucket and, once the
    model calls ``done``, reduce-scattered straight into this rank's gradient slice.

    Only one non-held group is open at a time, so all of them share one bucket region the
    size of the largest; held groups (tied embeddings) get their own region.
    """

    def __init__(self, sync: GradientSync, groups: list[GradientGroup], alloc):
        super().__init__()
        layout = sync.layout
        self.sync, self.layout = sync, layout
        lo, hi = sync.partition
        self.slice = alloc("gradients", "grad_slice", hi - lo)
        specs = {s.name: s for s in layout.specs}
        covered = [n for g in groups for n in g.names]
        if sorted(covered) != sorted(specs):
            missing = sorted(set(specs) - set(covered)) or sorted(covered)
            raise ValueError(f"gradient_groups must name every parameter once: {missing[:3]}")
        self.ranges = []  # per group: (flat start, flat end, bucket offset)
        held_total, shared = 0, 0
        for g in groups:
            a = layout.offsets[g.names[0]]
            b = a
            for n in g.names:  # a group must be one contiguous flat range, in layout order
                if layout.offsets[n] != b:
                    raise ValueError(f"gradient group {g.names} is not contiguous in the layout")
                b += specs[n].numel
            if g.held:
                self.ranges.append((a, b, held_total))
                held_total += b - a
            else:
                self.ranges.append((a, b, None))
                shared = max(shared, b - a)
        self.ranges = [(a, b, held_total if off is None else off) for a, b, off in self.ranges]
        self.bucket = alloc("buckets", "grad_bucket", held_total + shared, shared=True)
        self.groups = groups
        self.group_of = {n: i for i, g in enumerate(groups) for n in g.names}
        for i, g in enumerate(groups):
            a, _, off = self.ranges[i]
            for n in g.names:
                start = off + layout.offsets[n] - a
                self[n] = self.bucket[start : start + specs[n].numel].reshape(specs[n].shape)
        self.micro = 0
        self._done = [False] * len(groups)
        self.before_reduce = None  # mixed precision: stores a group's gradients half

    def done(self, names) -> None:
        i = self.group_of[names[0]]
        if self._done[i]:
            raise RuntimeError(f"gradient group {self.groups[i].names} finished twice in a step")
        self._done[i] = True
        a, b, off = self.ranges[i]
        region = self.bucket[off : off + b - a]
        if self.before_reduce is not None:
            self.before_reduce(region)
        # The group's range cut by the slice boundaries: rank r receives [a, b) ∩ slice r.
        bounds = np.clip(self.layout.bounds - a, 0, b - a)
        mine = self.sync.coll.reduce_scatter(
            region, bounds=bounds, average=True, algorithm=self.sync.algorithm
        )
        if mine.size:
            lo = self.sync.partition[0]
            start = a + int(bounds[self.sync.coll.rank]) - lo
            target = self.slice[start : start + mine.size]
            if self.micro == 0:
                np.copyto(target, mine)
            else:
                np.add(target, mine, out=target)

    def finish_step(self) -> np.ndarray:
        if not all(self._done):
            missing = [g.names for g, d in zip(self.groups, self._done, strict=True) if not d]
            raise RuntimeError(f"backward never finished gradient groups {missing}")
        self._done = [False] * len(self.groups)
        return self.slice

    def begin_micro_batch(self, micro: int) -> None:
        if micro > 0:
            self.finish_step()  # the previous micro-batch must have finished every group
        self.micro = micro


class StageWindows:
    """Parameters a model reads only through its stages (``simdist.models.stages``): before a
    stage's forward, and again before its backward, the gradient groups it reads are loaded
    into one of two float32 windows (``simdist.param_gather``: which groups, when, where),
    and the stage reads views of that window. How a group is loaded is the subclass's
    ``_load``: ZeRO-3 all-gathers it from the ranks' slices (``PartitionedParameters``),
    mixed precision's 16-bit weights unpack it (``simdist.packed_params``).

    ``forward_stage`` / ``backward_stage`` are wrapped on the model instance, and what the
    caller passes as ``params`` is this object, which refuses lookups: every read of a
    parameter must come through a stage.
    """

    def __init__(self, layout: Layout, model, window_buffer, count: int = 2):
        """``window_buffer(n)``: a float32 buffer of ``n`` elements for all ``count``
        windows (2: one computes while the next stage's groups arrive; 1: no prefetch)."""
        self.layout, self.model = layout, model
        self.plan = GatherPlan(layout, model.stages(), model.gradient_groups())
        width = self.plan.window
        buf = window_buffer(count * width)
        self.windows = [buf[i * width : (i + 1) * width] for i in range(count)]
        self.cache = WindowCache(self.plan, count)
        self.views: list[dict[str, np.ndarray]] = [{}, {}]
        self.training = True
        self._numel = {s.name: s for s in layout.specs}
        self._n_stages = len(self.plan.stages)
        fwd, bwd = model.forward_stage, model.backward_stage

        def forward_stage(k: int, params):
            if k == 0 and not self.training:
                self._eval_pass()
            w = self._before(k, FORWARD)
            return fwd(k, self.views[w] if w is not None else {})

        def backward_stage(k: int, params, grads, dloss: float):
            w = self._before(k, BACKWARD)
            return bwd(k, self.views[w] if w is not None else {}, grads, dloss)

        model.forward_stage, model.backward_stage = forward_stage, backward_stage

    def _before(self, k: int, phase: str) -> int | None:
        w, loads = stage_gathers(self.plan, self.cache, k, phase, self.training)
        for g in loads:
            region = self.windows[g.window][g.offset : g.offset + g.b - g.a]
            self._load(g, region)
            if g.offset == 0:  # the window is being reloaded: its old views are gone
                self.views[g.window] = {}
            views = self.views[g.window]
            for n in self.plan.names[g.group]:
                spec = self._numel[n]
                start = self.layout.offsets[n] - g.a
                views[n] = region[start : start + spec.numel].reshape(spec.shape)
        return w

    def _load(self, g, region: np.ndarray) -> None:
        """Fill ``region`` with group ``g.group``'s parameters (flat range [g.a, g.b))."""
        raise NotImplementedError

    def _eval_pass(self) -> None:
        """An evaluation forward pass starts (ZeRO-3: the ranks agree who runs one)."""

    def __getitem__(self, name: str) -> np.ndarray:
        raise KeyError(
            f"parameter {name!r} read outside a stage (the parameters are loaded per stage: "
            "read them through forward_stage / backward_stage)"
        )

    def evaluating(self, on: bool) -> None:
        """Evaluation: no backward follows the forward (prefetch stops at the head)."""
        self.training = not on


def fill_tensors(init, rng, specs, write) -> None:
    """Run ``init(params, rng)`` (a model's ``init_parameters``) one tensor at a time: each
    tensor is filled in a temporary float32 array, then ``write(name, value)`` takes it, so
    no whole float32 copy of the model ever exists. ``specs``: name -> ParamSpec."""

    class Filler(dict):
        def __init__(self):
            super().__init__()
            self.current: tuple[str, np.ndarray] | None = None
            self.written: set[str] = set()

        def __getitem__(self, name: str) -> np.ndarray:
            if self.current is not None and self.current[0] == name:
                return self.current[1]
            if name in self.written:  # its values are gone: a fresh array would zero them
                raise RuntimeError(
                    f"init_parameters went back to {name!r} after another tensor; "
                    "initialise each tensor in one go"
                )
            self.flush()
            self.current = (name, np.zeros(specs[name].shape, np.float32))
            self.written.add(name)
            return self.current[1]

        def flush(self) -> None:
            if self.current is not None:
                write(*self.current)
                self.current = None

    filler = Filler()
    init(filler, rng)
    filler.flush()


class PartitionedParameters(StageWindows):
    """ZeRO-3's parameters: this rank's slice of the flat buffer (rank-private memory) and
    two gather windows (``simdist.param_gather``), shared memory where the ranks share a
    node so the "shm" all-gather reads peers' blocks in place. A stage's group is loaded
    by an all-gather of the ranks' blocks of it.

    Mixed precision: the slice is 16-bit ``words`` of format ``fmt`` (the caller allocates
    them), unpacked into the window before the gather, and ``master`` (the optimizer's fp32
    master of the slice, set by the caller) is what ``write`` fills with the values.
    """

    def __init__(self, sync: GradientSync, model, alloc, words=None, fmt: int = 0):
        self.sync = sync
        self.lo, self.hi = sync.partition
        self.fmt = fmt if words is not None else 0
        self.slice = (
            alloc("parameters", "param_slice", self.hi - self.lo) if words is None else words
        )
        self.master: np.ndarray | None = None
        super().__init__(
            sync.layout, model, lambda n: alloc("parameters", "param_window", n, shared=True)
        )
        self.wire = 0  # mixed precision: the gathers' 16-bit format (Collectives.half_wire)
        self.gathers = 0  # all-gather calls so far (tests, bench)
        sync.partitioned = self

    # -- the gathers ----------------------------------------------------------------------
    def _load(self, g, region: np.ndarray) -> None:
        bounds = self.plan.block_bounds(g.group)
        r = self.sync.coll.rank
        s, e = int(bounds[r]), int(bounds[r + 1])
        if e > s:  # this rank's block of the group, from its slice
            own = self.slice[g.a + s - self.lo : g.a + e - self.lo]
            if self.fmt:
                unpack_half(region[s:e], own, self.fmt)
            else:
                np.copyto(region[s:e], own)
        with self.sync.coll.half_wire(self.wire):
            self.sync.coll.allgather(region, bounds=bounds, algorithm=self.sync.algorithm)
        self.gathers += 1

    def __getitem__(self, name: str) -> np.ndarray:
        raise KeyError(
            f"ZeRO-3: parameter {name!r} read outside a stage (its values live in slices; "
            "read parameters through forward_stage / backward_stage)"
        )

    # -- around the steps -----------------------------------------------------------------
    def initialize(self, init, rng) -> None:
        """Run ``init(params, rng)`` (the model's ``init_parameters``) keeping only this
        rank's slice (``fill_tensors``: no rank ever holds more than one whole tensor
        extra). Every rank draws the same numbers in the same order, so the slices are
        those of the whole buffer ZeRO 0-2 initialise (and broadcast)."""
        fill_tensors(init, rng, self._numel, self.write_tensor)
        self.cache.invalidate()

    def write_tensor(self, name: str, value: np.ndarray) -> None:
        """Copy this rank's part of parameter ``name`` (whole tensor given) into the slice."""
        self.write(self.layout.offsets[name], value.reshape(-1))

    def write(self, a: int, values: np.ndarray) -> None:
        """Flat elements [a, a + values.size) are ``values`` (float32): this rank's part of
        them into the slice (words: rounded; and as they are into ``master``)."""
        if self.fmt:
            write_words(self.slice, self.lo, a, values, self.fmt, self.master, self.lo)
            return
        s, e = max(a, self.lo), min(a + values.size, self.hi)
        if e > s:
            self.slice[s - self.lo : e - self.lo] = values[s - a : e - a]

    def values(self, s: int, e: int) -> np.ndarray:
        """Flat elements [s, e) of this rank's slice as float32 (words: unpacked)."""
        own = self.slice[s - self.lo : e - self.lo]
        return read_words(own, self.fmt) if self.fmt else own

    def store(self, master: np.ndarray) -> None:
        """Words: the optimizer updated the slice's ``master``; the words its rounding."""
        pack_half(self.slice, master, self.fmt)

    def gather_to_root(self, comm) -> StreamedParameters | None:
        """Collective: every parameter by name on rank 0 (checkpoints), else None.

        No rank ever holds the model: rank 0 gets a mapping whose ``items()`` receives each
        tensor's pieces from their owners as the checkpoint writer reaches it; the other
        ranks send their pieces in the same (layout) order, blocking until rank 0 takes
        them, then return."""
        if comm.Get_rank() == 0:
            return StreamedParameters(self, comm)
        for _, s, e in self._pieces():
            if e > s:
                comm.Send(self.values(s, e), dest=0, tag=CHECKPOINT_TAG)
        return None

    def _pieces(self, rank: int | None = None):
        """(name, lo, hi) of parameter name's flat elements in ``rank``'s slice."""
        lo, hi = (self.lo, self.hi) if rank is None else self.layout.shard(rank)
        for spec in self.layout.specs:
            a = self.layout.offsets[spec.name]
            yield spec.name, max(a, lo), min(a + spec.numel, hi)

    def _eval_pass(self) -> None:
        self._join_pass(active=True)

    def _join_pass(self, active: bool) -> bool:
        """Before every eval forward pass the ranks agree whether anyone still runs one
        (ranks score different numbers of batches, but every gather needs all of them)."""
        flag = np.array([1.0 if active else 0.0])
        return bool(self.sync.coll.allreduce_scalars(flag)[0] > 0)

    def join(self) -> None:
        """After this rank's last eval batch: run gather-only passes while others run."""
        while self._join_pass(active=False):
            for k in range(self._n_stages):
                self._before(k, FORWARD)


CHECKPOINT_TAG = 0x2E3  # point-to-point tag of ZeRO-3's checkpoint gather


class StreamedParameters:
    """Rank 0's view of ZeRO-3's parameters for the checkpoint writer: ``items()`` yields
    each tensor whole, received from the ranks whose slices hold it (one tensor at a time
    in memory). Iterate it once, on rank 0, while the other ranks send."""

    def __init__(self, store: PartitionedParameters, comm):
        self.store, self.comm = store, comm

    def items(self):
        st, layout = self.store, self.store.layout
        pieces = [list(st._pieces(r)) for r in range(self.comm.Get_size())]
        for i, spec in enumerate(layout.specs):
            a = layout.offsets[spec.name]
            flat = np.empty(spec.numel, np.float32)
            for r, mine in enumerate(pieces):
                _, s, e = mine[i]
                if e <= s:
                    continue
                if r == 0:
                    flat[s - a : e - a] = st.values(s, e)
                else:
                    self.comm.Recv(flat[s - a : e - a], source=r, tag=CHECKPOINT_TAG)
            yield spec.name, flat.reshape(spec.shape)
