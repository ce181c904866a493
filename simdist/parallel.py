"""Synchronous data parallelism and ZeRO-1/2 as "which slice and which collective".

| level | gradients held        | sync                                    | optimizer state |
|-------|-----------------------|-----------------------------------------|-----------------|
| 0 DP  | whole buffer          | all-reduce of the whole buffer          | whole buffer    |
| 1     | whole buffer          | reduce-scatter to own slice; all-gather | own slice       |
|       |                       | of the updated parameter slices         |                 |
| 2     | own slice + 1 bucket  | reduce-scatter each gradient group as   | own slice       |
|       |                       | backward finishes it; all-gather params |                 |

simdist's all-reduce is reduce-scatter + all-gather over the slice boundaries
(``Layout.bounds``), and a reduce-scatter restricted to one group's range sums every element
in the same order as the whole-buffer one (the order depends only on the element's owner),
so levels 0, 1 and 2 train to bit-identical parameters (gradient accumulation aside: ZeRO-2
reduces every micro-batch, which is what keeps its gradient memory at one slice).
"""

from __future__ import annotations

import numpy as np

from simdist.comm import Collectives, partition
from simdist.kernels.optim import sum_of_squares

from .arena import Layout
from .models.base import GradientGroup, GradientViews


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

    def gather_parameters(self, params: np.ndarray) -> None:
        if self.level > 0:
            self.coll.allgather(params, bounds=self.layout.bounds, algorithm=self.algorithm)

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

    def done(self, names) -> None:
        i = self.group_of[names[0]]
        if self._done[i]:
            raise RuntimeError(f"gradient group {self.groups[i].names} finished twice in a step")
        self._done[i] = True
        a, b, off = self.ranges[i]
        region = self.bucket[off : off + b - a]
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
