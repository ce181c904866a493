"""Where the ranks really run: which ranks share a node (``MPI_COMM_TYPE_SHARED``).

The simulated accelerators inherit the real placement: ranks that MPI can reach through
shared memory are devices of one node (they talk over the profile's ``intra`` link), ranks
on different nodes talk over ``inter``. ``placement(comm)`` is collective (one
``Split_type`` and one small ``allgather`` of ints) and is called once at set-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI


@dataclass(frozen=True)
class Placement:
    """The node of every rank of a communicator, numbered 0.. in order of first rank."""

    rank: int
    node_of: tuple[int, ...]  # node index per rank

    @property
    def world(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def ranks_per_node(self) -> tuple[int, ...]:
        return tuple(self.node_of.count(n) for n in range(self.num_nodes))

    @property
    def max_ranks_per_node(self) -> int:
        return max(self.ranks_per_node)

    @property
    def uniform(self) -> bool:
        """Every node runs the same number of ranks (what the hierarchical algorithm needs)."""
        return len(set(self.ranks_per_node)) == 1

    def members(self, node: int) -> tuple[int, ...]:
        """The ranks on ``node``, in rank order (their position is their local rank)."""
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    @property
    def local_rank(self) -> int:
        return self.members(self.node).index(self.rank)

    @classmethod
    def blocks(cls, rank: int, world: int, ranks_per_node: int) -> Placement:
        """Ranks 0..k-1 on node 0, k..2k-1 on node 1, ... (virtual nodes: tests, what-ifs)."""
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        return cls(rank, tuple(r // ranks_per_node for r in range(world)))

    def link_class(self) -> str:
        """Link class of a collective over the whole communicator: intra or inter."""
        return "intra" if self.num_nodes == 1 else "inter"


def placement(comm: MPI.Comm) -> Placement:
    """Collective: split ``comm`` by shared-memory domain and number the nodes."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader = local.bcast(comm.Get_rank(), root=0)  # lowest world rank on this node
    finally:
        local.Free()
    leaders = comm.allgather(leader)
    order = {ld: i for i, ld in enumerate(dict.fromkeys(leaders))}
    return Placement(comm.Get_rank(), tuple(order[ld] for ld in leaders))
