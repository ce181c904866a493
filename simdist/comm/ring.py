"""Ring algorithms: each rank only talks to its neighbours r - 1 and r + 1.

Reduce-scatter: in step s = 0 .. p-2, rank r sends block (r - s - 1) mod p to r + 1 and adds
block (r - s - 2) mod p received from r - 1 into its own copy. After p - 1 steps rank r holds
its block r fully reduced, having sent p - 1 blocks ((p-1)/p of the buffer).

Summation order (what makes the bits reproducible): block b starts as rank b+1's values and
travels b+1 -> b+2 -> ... -> b, each rank adding its own values, so its elements are

    (...((x[b+1] + x[b+2]) + x[b+3]) + ...) + x[b]        (rank indices mod p)

It depends only on the owner b and p, never on timing, message sizes or segmentation.

All-gather: in step s rank r forwards block (r - s) mod p to r + 1 and receives block
(r - s - 1) mod p from r - 1 straight into place.

Broadcast: the root sends block i of the default partition to rank i, then a ring
all-gather (bandwidth-optimal for large buffers: ~2 (p-1)/p of the buffer per rank).
"""

from __future__ import annotations

import numpy as np

from .algorithm import Algorithm, register_algorithm
from .partition import partition


@register_algorithm
class Ring(Algorithm):
    name = "ring"

    def reduce_scatter(self, buf: np.ndarray, bounds: list[int]) -> None:
        r, p, x = self.rank, self.world, self.p2p
        right, left = (r + 1) % p, (r - 1) % p
        b = bounds
        for s in range(p - 1):
            sb, rb = (r - s - 1) % p, (r - s - 2) % p
            x.reduce(buf[b[sb] : b[sb + 1]], right, buf[b[rb] : b[rb + 1]], left)

    def allgather(self, buf: np.ndarray, bounds: list[int]) -> None:
        r, p, x = self.rank, self.world, self.p2p
        right, left = (r + 1) % p, (r - 1) % p
        b = bounds
        for s in range(p - 1):
            sb, rb = (r - s) % p, (r - s - 1) % p
            x.copy(buf[b[sb] : b[sb + 1]], right, buf[b[rb] : b[rb + 1]], left)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        r, p, x = self.rank, self.world, self.p2p
        bounds = partition(buf.size, p).tolist()
        if r == root:
            for i in range(p):
                if i != root:
                    x.copy(buf[bounds[i] : bounds[i + 1]], i, None, 0)
        else:
            x.copy(None, 0, buf[bounds[r] : bounds[r + 1]], root)
        self.allgather(buf, bounds)
