"""One collective as simdist runs it: its simulated seconds from op, algorithm and real blocks.

The run records every collective it calls (op, resolved algorithm, bytes of each rank's
block, host staging) and plan mode predicts the same calls from the model's shapes; both
time them here. The rules:

* reduce-scatter, all-gather, all-reduce: the schedule of the algorithm that ran, on the real
  block sizes (``simdist.device.schedule``), over the placement's link (``intra`` when every
  rank shares one node, else ``inter``). Host-staged (``reduce_on_device: false``): the two
  copies over the ``host`` link plus the collective between the hosts: the inter-node
  network, or within a node the slower of the host link and the node fabric (the path
  staged data takes). ``hierarchical``: in-node rings on the intra link, cross-node rings on
  a rank's share of the NICs.
* the loop's scalar agreement (``allreduce_scalars``): MPI's Allgather of the values.
* barrier: ⌈log2 p⌉ latencies; broadcast and others: the closed form
  (``simdist.device.collective_cost``) on the total size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .collective_cost import collective_time
from .cost import CostModel
from .profile import Link, ProfileError
from .schedule import hierarchical_time, schedule_time

STAGED_OPS = ("allreduce", "reduce_scatter", "allgather")  # the ones host staging applies to


@dataclass(frozen=True)
class Network:
    """Where a rank's collectives run: the group, this rank, and how the ranks are placed."""

    world: int
    rank: int
    link_class: str  # "intra": all ranks on one node, else "inter"
    nodes: tuple[tuple[int, ...], ...]  # the ranks of each node


@dataclass(frozen=True)
class CollectiveCall:
    """One collective call: what the run records and what plan mode predicts."""

    op: str
    algorithm: str  # resolved: ring | rhd | shm | hierarchical | native
    blocks: tuple[int, ...]  # bytes of each rank's block
    staged: bool = False

    @property
    def nbytes(self) -> int:
        return sum(self.blocks)


def staged_link(cost: CostModel, net: Network) -> Link:
    """Between the hosts of staged ranks: the network across nodes; within a node the
    slower of the host link and the node fabric (staged data crosses both)."""
    prof = cost.profile
    if net.link_class == "inter":
        return cost.link("inter", net.world)
    known = [lk for lk in (prof.host, prof.intra) if lk.known]
    if not known:
        raise ProfileError(f"{prof.name} publishes neither a host nor an intra-node link")
    slow = min(known, key=lambda lk: lk.effective_bandwidth)
    return Link(
        "staged",
        slow.bandwidth,
        max(lk.latency for lk in known),
        slow.efficiency,
        max(lk.gamma for lk in known),
    )


def _staging_copies(cost: CostModel, net: Network, c: CollectiveCall) -> float:
    """The copy to the host buffer and back (only this rank's block where the op needs it)."""
    host = cost.profile.host
    own, n = c.blocks[net.rank], c.nbytes
    n_in = own if c.op == "allgather" else n
    n_out = own if c.op == "reduce_scatter" else n
    return 2 * host.latency + (n_in + n_out) * host.beta


def collective_seconds(cost: CostModel, net: Network, c: CollectiveCall) -> float:
    """Simulated seconds of one collective call (raises ``ProfileError`` where the profile
    does not publish what it needs)."""
    p = net.world
    if p == 1:
        return 0.0
    link = cost.link(net.link_class, p)
    if c.op in STAGED_OPS:
        if c.algorithm == "hierarchical":
            inter = cost.rail(p) if len(net.nodes) > 1 else None  # shared NICs
            intra = cost.link("intra", p)
            t = hierarchical_time(c.op, c.blocks, net.nodes, intra, inter or intra)
            return t + (_staging_copies(cost, net, c) if c.staged else 0.0)
        if not c.staged:
            return schedule_time(c.op, c.algorithm, c.blocks, link)
        copies = _staging_copies(cost, net, c)
        return copies + schedule_time(c.op, c.algorithm, c.blocks, staged_link(cost, net))
    if c.op == "allreduce_scalars":  # MPI Allgather of the values, summed locally
        return collective_time("allgather", "native", c.nbytes, p, link)
    if c.op == "barrier":
        return math.ceil(math.log2(p)) * link.latency
    alg = c.algorithm if c.algorithm in ("ring", "rhd") else "native"
    return collective_time(c.op, alg, c.nbytes, p, link)


__all__ = ["STAGED_OPS", "CollectiveCall", "Network", "collective_seconds", "staged_link"]
