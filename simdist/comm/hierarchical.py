"""Hierarchical (two-level) collectives: inside each node, then across nodes, then inside.

The ranks form an N x L grid: N nodes (``topology.Placement``) of L ranks each; the rank with
local index j on node m is "(m, j)". Two sub-communicators carry the traffic: ``local``
(the L ranks of a node) and ``cross`` (the N ranks with the same local index, one per node).

Reduce-scatter of blocks ``bounds`` (block of world rank r goes to r):

1. stage the buffer into a reused scratch in *chunk order*: chunk j holds the blocks of
   (0, j), (1, j), .., (N-1, j) side by side;
2. ring reduce-scatter of the chunks over ``local``: (m, j) holds chunk j summed over its
   node;
3. ring reduce-scatter of chunk j's blocks over ``cross``: (m, j) holds its block summed
   over all nodes; copy it back into place.

All-gather is the mirror image (own block into the staging buffer, ring all-gather across
nodes, then inside the node, unstage); all-reduce runs both without the copy in between.
Only 2 (N-1)/N of the buffer crosses each node's link per all-reduce (a flat ring sends
2 (p-1)/p): at 2 nodes, n instead of 1.5 n.

Summation order: an element of block (m, j) is summed inside each node in the ring order of
local owner j on L ranks, then those node sums in the ring order of owner m on N ranks. It
depends only on the block's owner (never on sizes, timing or segmentation), so a
reduce-scatter over any sub-range with the same owners, an all-reduce and a reduce-scatter
+ all-gather give identical bits, as for the flat ring. With one node, or one rank per
node, the staging order is the rank order and the result is the flat ring's, bit for bit.

Needs the same number of ranks on every node. Broadcast: ring broadcast across the nodes
among the ranks with the root's local index, then inside every node.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .algorithm import Algorithm, average_block, register_algorithm
from .p2p import Exchanger
from .ring import Ring
from .topology import Placement
from .topology import placement as find_placement

_EMPTY = np.empty(0, dtype=np.float32)


def check_placement(place: Placement) -> None:
    """Raise ValueError unless every node runs the same number of ranks."""
    if not place.uniform:
        raise ValueError(
            "the hierarchical algorithm needs the same number of ranks on every node; "
            f"this run has {list(place.ranks_per_node)} ranks on its {place.num_nodes} nodes "
            "(use collective_algorithm auto, ring or rhd, or place the ranks evenly)"
        )


@register_algorithm
class Hierarchical(Algorithm):
    name = "hierarchical"

    @classmethod
    def placement_error(cls, placement: Placement) -> str | None:
        try:
            check_placement(placement)
        except ValueError as e:
            return str(e)
        return None

    def __init__(self, comm: MPI.Comm, p2p: Exchanger, placement: Placement | None = None):
        super().__init__(comm, p2p, placement)
        place = placement if placement is not None else find_placement(comm)
        check_placement(place)
        self.nodes, self.per_node = place.num_nodes, place.max_ranks_per_node
        self.node, self.local_rank = place.node, place.local_rank
        # Chunk order: world ranks (0, 0), (1, 0), .., (N-1, 0), (0, 1), ..
        members = [place.members(m) for m in range(self.nodes)]
        self.order = [members[m][j] for j in range(self.per_node) for m in range(self.nodes)]
        self.slot = self.order.index(self.rank)  # this rank's block in chunk order
        self.identity = self.order == list(range(self.world))
        self.local = comm.Split(color=self.node, key=self.local_rank)
        self.cross = comm.Split(color=self.local_rank, key=self.node)
        self.intra = Ring(self.local, Exchanger(self.local))
        self.inter = Ring(self.cross, Exchanger(self.cross))
        self.inter.p2p.place(range(self.nodes))  # cross rank m runs on node m
        self._staging = _EMPTY

    # ------------------------------------------------------------------ staging

    def _layout(self, bounds: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Offsets in chunk order: of every block, of every chunk, of this rank's chunk's blocks."""
        self._wire()
        off = [0]
        for r in self.order:
            off.append(off[-1] + bounds[r + 1] - bounds[r])
        n_nodes = self.nodes
        chunks = [off[j * n_nodes] for j in range(self.per_node)] + [off[-1]]
        lo = chunks[self.local_rank]
        first = self.local_rank * n_nodes
        sub = [off[first + m] - lo for m in range(n_nodes + 1)]
        return off, chunks, sub

    def _stage(self, buf: np.ndarray) -> np.ndarray:
        """Where the chunk-ordered buffer lives: ``buf`` itself when the orders agree."""
        if self.identity:
            return buf
        if self._staging.size < buf.size:  # grows to the largest buffer (memplan counts it)
            self._staging = np.empty(buf.size, dtype=np.float32)
        return self._staging[: buf.size]

    def _copy_blocks(self, dst: np.ndarray, src: np.ndarray, bounds, off, to_staged: bool,
                     only: int | None = None) -> None:  # fmt: skip
        for k, r in enumerate(self.order):
            if only is not None and k != only:
                continue
            a, b = bounds[r], bounds[r + 1]
            if b > a:
                if to_staged:
                    dst[off[k] : off[k + 1]] = src[a:b]
                else:
                    dst[a:b] = src[off[k] : off[k + 1]]

    def _wire(self) -> None:
        """The sub-communicators' messages take the caller's wire format (``p2p.half``)."""
        self.intra.p2p.half = self.inter.p2p.half = self.p2p.half

    def _account(self) -> None:
        """Fold the sub-communicators' sent bytes into the caller's counter."""
        for sub in (self.intra.p2p, self.inter.p2p):
            self.p2p.bytes_sent += sub.bytes_sent
            sub.bytes_sent = 0

    # ------------------------------------------------------------------ the two halves

    def _reduce(self, staged: np.ndarray, chunks: list[int], sub: list[int]) -> np.ndarray:
        """Steps 2 and 3 of the module docstring; returns this rank's chunk."""
        if self.per_node > 1:
            self.intra.reduce_scatter(staged, chunks)
        j = self.local_rank
        chunk = staged[chunks[j] : chunks[j + 1]]
        if self.nodes > 1 and chunk.size:
            self.inter.reduce_scatter(chunk, sub)
        return chunk

    def _gather(self, staged: np.ndarray, chunks: list[int], sub: list[int]) -> None:
        j = self.local_rank
        chunk = staged[chunks[j] : chunks[j + 1]]
        if self.nodes > 1 and chunk.size:
            self.inter.allgather(chunk, sub)
        if self.per_node > 1:
            self.intra.allgather(staged, chunks)

    # ------------------------------------------------------------------ collectives

    def reduce_scatter(self, buf: np.ndarray, bounds: list[int]) -> None:
        off, chunks, sub = self._layout(bounds)
        staged = self._stage(buf)
        if staged is not buf:
            self._copy_blocks(staged, buf, bounds, off, to_staged=True)
        self._reduce(staged, chunks, sub)
        if staged is not buf:
            self._copy_blocks(buf, staged, bounds, off, to_staged=False, only=self.slot)
        self._account()

    def allgather(self, buf: np.ndarray, bounds: list[int]) -> None:
        off, chunks, sub = self._layout(bounds)
        staged = self._stage(buf)
        if staged is not buf:
            self._copy_blocks(staged, buf, bounds, off, to_staged=True, only=self.slot)
        self._gather(staged, chunks, sub)
        if staged is not buf:
            self._copy_blocks(buf, staged, bounds, off, to_staged=False)
        self._account()

    def allreduce(self, buf: np.ndarray, bounds: list[int], average: bool) -> None:
        off, chunks, sub = self._layout(bounds)
        staged = self._stage(buf)
        if staged is not buf:
            self._copy_blocks(staged, buf, bounds, off, to_staged=True)
        self._reduce(staged, chunks, sub)
        if average:
            average_block(staged[off[self.slot] : off[self.slot + 1]], self.world, self.p2p.half)
        self._gather(staged, chunks, sub)
        if staged is not buf:
            self._copy_blocks(buf, staged, bounds, off, to_staged=False)
        self._account()

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self._wire()
        order = self.order
        k = order.index(root)
        root_node, root_local = k % self.nodes, k // self.nodes
        if self.local_rank == root_local and self.nodes > 1:
            self.inter.broadcast(buf, root_node)  # cross ranks are numbered by node
        if self.per_node > 1:
            self.intra.broadcast(buf, root_local)
        self._account()

    def free(self) -> None:
        for sub in (self.local, self.cross):
            if sub != MPI.COMM_NULL:
                sub.Free()
