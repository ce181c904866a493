"""Synchronous data parallelism and ZeRO-1/2 as "which slice and which collective".

| level | gradients after sync        | optimizer state | parameters after update      |
|-------|-----------------------------|-----------------|------------------------------|
| 0 DP  | all-reduce (every element)  | whole buffer    | updated everywhere           |
| 1     | reduce-scatter -> own slice | own slice       | all-gather of the slices     |
| 2     | reduce-scatter -> own slice | own slice       | all-gather of the slices     |

ZeRO-2 additionally keeps only the owned gradient slice between steps (see train.py). The
all-reduce of simdist's own algorithms is reduce-scatter + all-gather over the same slice
boundaries (``Layout.bounds``), and every element is reduced in the same order either way, so
levels 0, 1 and 2 train to bit-identical parameters.
"""

from __future__ import annotations

import numpy as np

from simdist.comm import Collectives
from simdist.kernels.optim import sum_of_squares

from .arena import Layout


class GradientSync:
    def __init__(self, coll: Collectives, layout: Layout, level: int):
        self.coll, self.layout, self.level = coll, layout, level
        self.partition = layout.shard(coll.rank)  # this rank's ZeRO slice / all-reduce chunk
        # the flat range this rank's optimizer updates
        self.update_range = self.partition if level > 0 else (0, layout.padded)

    def reduce_gradients(self, grads: np.ndarray) -> np.ndarray:
        """Average gradients across replicas; returns the gradients for update_range."""
        if self.level == 0:
            self.coll.allreduce(grads, average=True)
            return grads
        return self.coll.reduce_scatter(grads, bounds=self.layout.bounds, average=True)

    def global_norm(self, reduced: np.ndarray) -> float:
        """L2 norm of the averaged gradient, each element counted once across ranks."""
        lo, hi = self.partition
        offset = self.update_range[0]
        partial = sum_of_squares(reduced[lo - offset : hi - offset])
        total = self.coll.allreduce_scalars(np.array([partial], np.float64))[0]
        return float(np.sqrt(total))

    def gather_parameters(self, params: np.ndarray) -> None:
        if self.level > 0:
            self.coll.allgather(params, bounds=self.layout.bounds)
