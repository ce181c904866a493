"""Recursive halving (reduce-scatter) and recursive doubling (all-gather), Rabenseifner-style.

Let p' be the largest power of two <= p and rem = p - p'. Non-powers of two are folded:
among the first 2*rem ranks each even rank 2i hands its whole buffer to 2i+1, which adds it
and then acts for both; the p' remaining "participants" have new ranks
``nr = r // 2`` (r < 2*rem, odd) or ``nr = r - rem`` (r >= 2*rem). Participant nr is
responsible for a contiguous *super-block* of the caller's blocks: blocks 2nr and 2nr+1 if
nr < rem, else block nr + rem. Any bounds work, empty blocks included.

Reduce-scatter: for mask = p'/2, p'/4, .., 1 the participant exchanges with nr ^ mask: it
keeps the half of its current super-block range that contains nr, sends the other half and
adds the partner's copy of the kept half. log2(p') steps; (p'-1)/p' of the buffer sent.
Finally 2i+1 returns block 2i to rank 2i.

Summation order: one fixed tree for every element, whatever block it is in. Leaves are the
ranks (folded pairs first: x[2i] + x[2i+1] for i < rem); the first level adds the two
participants whose new ranks differ in the highest bit (nr and nr ^ p'/2), the next level
pairs those sums across the next bit, and so on down to bit 0. IEEE addition is commutative,
so which partner holds which operand does not matter: the tree depends only on p.

All-gather: the mirror image: fold the even ranks' blocks in, then mask = 1, 2, .., p'/2
exchanging the super-block range gathered so far, then 2i+1 sends the rest to 2i.

All-reduce skips the two fold messages that would only carry block 2i to rank 2i and back
(rank 2i+1 already holds identical bits): same result as reduce-scatter + all-gather.

Broadcast: binomial tree (ceil(log2 p) rounds of the whole buffer): latency-optimal.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .algorithm import Algorithm, average_block, register_algorithm
from .p2p import Exchanger
from .topology import Placement


@register_algorithm
class RecursiveHalvingDoubling(Algorithm):
    name = "rhd"

    def __init__(self, comm: MPI.Comm, p2p: Exchanger, placement: Placement | None = None):
        super().__init__(comm, p2p, placement)
        p, r = self.world, self.rank
        self.pof2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.pof2
        if r < 2 * self.rem:
            self.newrank = r // 2 if r % 2 else -1  # even ranks sit the halving out
        else:
            self.newrank = r - self.rem

    def _old(self, nr: int) -> int:
        return 2 * nr + 1 if nr < self.rem else nr + self.rem

    def _super_bounds(self, bounds: list[int]) -> list[int]:
        rem = self.rem
        return [bounds[2 * i] if i < rem else bounds[i + rem] for i in range(self.pof2)] + [
            bounds[-1]
        ]

    def _reduce_scatter(self, buf: np.ndarray, bounds: list[int], fold_out: bool) -> None:
        r, x = self.rank, self.p2p
        if self.newrank < 0:  # even rank of a folded pair
            x.reduce(buf, r + 1, None, 0)
            if fold_out:
                x.copy(None, 0, buf[bounds[r] : bounds[r + 1]], r + 1)
            return
        if r < 2 * self.rem:
            x.reduce(None, 0, buf, r - 1)
        sb, nr = self._super_bounds(bounds), self.newrank
        mask = self.pof2 >> 1
        while mask:
            peer = self._old(nr ^ mask)
            base = nr & ~(2 * mask - 1)
            keep, give = (base + mask, base) if nr & mask else (base, base + mask)
            x.reduce(buf[sb[give] : sb[give + mask]], peer, buf[sb[keep] : sb[keep + mask]], peer)
            mask >>= 1
        if fold_out and r < 2 * self.rem:
            x.copy(buf[bounds[r - 1] : bounds[r]], r - 1, None, 0)

    def _allgather(self, buf: np.ndarray, bounds: list[int], fold_in: bool) -> None:
        r, x = self.rank, self.p2p
        if self.newrank < 0:
            lo, hi = bounds[r], bounds[r + 1]
            if fold_in:
                x.copy(buf[lo:hi], r + 1, None, 0)
                x.copy(None, 0, buf[:lo], r + 1)
                x.copy(None, 0, buf[hi:], r + 1)
            else:
                x.copy(None, 0, buf, r + 1)
            return
        if fold_in and r < 2 * self.rem:
            x.copy(None, 0, buf[bounds[r - 1] : bounds[r]], r - 1)
        sb, nr = self._super_bounds(bounds), self.newrank
        mask = 1
        while mask < self.pof2:
            peer = self._old(nr ^ mask)
            mine = nr & ~(mask - 1)
            theirs = mine ^ mask
            x.copy(buf[sb[mine] : sb[mine + mask]], peer, buf[sb[theirs] : sb[theirs + mask]], peer)
            mask <<= 1
        if r < 2 * self.rem:
            if fold_in:  # rank r - 1 already holds its own block
                x.copy(buf[: bounds[r - 1]], r - 1, None, 0)
                x.copy(buf[bounds[r] :], r - 1, None, 0)
            else:
                x.copy(buf, r - 1, None, 0)

    def reduce_scatter(self, buf: np.ndarray, bounds: list[int]) -> None:
        self._reduce_scatter(buf, bounds, fold_out=True)

    def allgather(self, buf: np.ndarray, bounds: list[int]) -> None:
        self._allgather(buf, bounds, fold_in=True)

    def allreduce(self, buf: np.ndarray, bounds: list[int], average: bool) -> None:
        self._reduce_scatter(buf, bounds, fold_out=False)
        if average and self.newrank >= 0:
            sb = self._super_bounds(bounds)
            average_block(buf[sb[self.newrank] : sb[self.newrank + 1]], self.world, self.p2p.half)
        self._allgather(buf, bounds, fold_in=False)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        r, p, x = self.rank, self.world, self.p2p
        vr = (r - root) % p  # rank relative to the root
        mask = 1
        while mask < p:  # receive once, from the parent that differs in vr's lowest set bit
            if vr & mask:
                x.copy(None, 0, buf, (r - mask) % p)
                break
            mask <<= 1
        mask >>= 1
        while mask:  # then forward to the children below that bit
            if vr + mask < p:
                x.copy(buf, (r + mask) % p, None, 0)
            mask >>= 1
