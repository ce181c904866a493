"""MPI's own collectives: the reference backend for correctness and speed.

MPI chooses its algorithm (and with it the summation order) by message size, so native
all-reduce is NOT guaranteed to match reduce-scatter + all-gather bit for bit; use it to
cross-check and to benchmark against, not where DP and ZeRO must agree exactly.

``bytes_sent`` cannot see inside MPI: native calls add the volume a bandwidth-optimal
algorithm (the ring) would send, so communication-volume reports stay comparable.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .algorithm import Algorithm, average_block, register_algorithm


@register_algorithm
class Native(Algorithm):
    name = "native"

    def allreduce(self, buf: np.ndarray, bounds: list[int], average: bool) -> None:
        self.comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], op=MPI.SUM)
        if average:
            average_block(buf, self.world, self.p2p.half)
        r, q = self.rank, (self.rank + 1) % self.world
        own, nxt = bounds[r + 1] - bounds[r], bounds[q + 1] - bounds[q]
        self.p2p.bytes_sent += 4 * (2 * buf.size - own - nxt)

    def reduce_scatter(self, buf: np.ndarray, bounds: list[int]) -> None:
        counts = [bounds[i + 1] - bounds[i] for i in range(self.world)]
        lo, n = bounds[self.rank], counts[self.rank]
        # Out of place: with MPI_IN_PLACE the result would land at the start of buf and need
        # an overlapping move; a reused scratch block costs the same single copy.
        out = self.p2p.scratch(n)[:n]
        self.comm.Reduce_scatter([buf, MPI.FLOAT], [out, MPI.FLOAT], counts, op=MPI.SUM)
        buf[lo : lo + n] = out
        self.p2p.bytes_sent += 4 * (buf.size - n)

    def allgather(self, buf: np.ndarray, bounds: list[int]) -> None:
        counts = [bounds[i + 1] - bounds[i] for i in range(self.world)]
        self.comm.Allgatherv(MPI.IN_PLACE, [buf, (counts, bounds[:-1]), MPI.FLOAT])
        nxt = counts[(self.rank + 1) % self.world]
        self.p2p.bytes_sent += 4 * (buf.size - nxt)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.comm.Bcast([buf, MPI.FLOAT], root=root)
        if self.rank == root:
            self.p2p.bytes_sent += 4 * buf.size

    def barrier(self) -> None:
        self.comm.Barrier()
