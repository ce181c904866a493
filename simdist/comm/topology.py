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
