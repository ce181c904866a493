"""The cost rule behind ``algorithm="auto"``: a latency-bandwidth (alpha-beta-gamma) model.

For a buffer of ``n`` bytes on ``p`` ranks the modelled time of the busiest rank is

    steps * ALPHA + bytes copied * BETA + bytes added * GAMMA

| algorithm, op              | steps              | bytes copied            | bytes added      |
|----------------------------|--------------------|-------------------------|------------------|
| ring all-reduce            | 2 (p-1)            | 2 (p-1)/p n             | (p-1)/p n        |
| rhd all-reduce, p = 2^k    | 2 log2 p           | 2 (p-1)/p n             | (p-1)/p n        |
| rhd all-reduce, otherwise  | 2 log2 p' + 2      | 2 (p'-1)/p' n + 2 n     | (p'-1)/p' n + n  |
| ring broadcast             | 2 (p-1)            | 2 (p-1)/p n             | 0                |
| rhd (binomial) broadcast   | ceil(log2 p)       | ceil(log2 p) n          | 0                |

| shm all-reduce             | 2 fences           | (p-1)/p n               | (p-1)/p n        |
| shm broadcast              | 2 fences           | n                       | 0                |

(p' = largest power of two <= p; reduce-scatter and all-gather are each half of the
all-reduce row; a fence, ``ALPHA_FENCE``, is a barrier.) "shm" (``shm.py``) is only
considered for buffers the caller registered (``Collectives.buffer``, shared memory: no
staging copies) with every rank on one node; there it wins from a few tens of KiB up.
The constants are round figures measured on the development machine kind (2 cores, MPICH
shared memory, Python loop overhead included); only their ratios matter.

Why each term (the device model, ``simdist.device.schedule``, prices the same terms per step
from the calibration probes; the constants here only rank algorithms against each other,
and are round figures on the conservative side of the shipped host profile's calibration,
``simdist/device/profiles/host.yaml``):

- ``steps * ALPHA``: every step is one pairwise exchange (``p2p.Exchanger``), which pays
  MPI's matching and rendezvous handshake and mpi4py's Python call before data moves.
  Steps run one after another (each sends what the previous one produced), so their
  latencies add up: that is what makes rhd (log2 p steps) win on small buffers. 10 us: the
  profile's Sendrecv fit is 3.2 us and its per-call Python 1.4 us, and a step's own Python
  (slicing, buffer specs) comes on top.
- ``bytes copied * BETA``: the bytes one rank sends, counted one way only, because a step
  sends and receives at once (full duplex: calibrate's Sendrecv probe moves both directions
  in the time of one). Across nodes this holds because copies between nodes go in 1 MiB
  pieces (``p2p``): one large Sendrecv each way over TCP was measured running the two
  directions one after the other. 10 GB/s: the profile's Sendrecv runs at 13-30 GB/s from
  1 to 16 MiB, and its pipelined reduce exchange, copy and addition together, at 9-13 GB/s.
- ``bytes added * GAMMA``: the reduce-scatter's additions (two reads and a write per
  element), 8 GB/s of bytes reduced: below ``np.add``'s rate on arrays beyond the caches
  (42 GB/s of bytes read and written at 64 MiB, 14 GB/s reduced). Counted in full, not
  overlapped with the copies: the device model uses the pipelined exchange's measured
  rate instead, which overlaps them in part.
- ``ALPHA_FENCE``: one shm fence (``Win_sync``, barrier, ``Win_sync``; the profile's direct
  link: 4.0 us per fence as shm pays it, 2.5 us bare); shm pays 2 per all-reduce or per
  half.
- ``ALPHA_NET`` / ``BETA_NET``: a message leaving its node and the network's rate; round
  figures (10 Gbit/s Ethernet, MPI over TCP), since the real link is unknown here.

The choice for all-reduce, reduce-scatter and all-gather depends on ``(n, p)`` (and whether
the buffer is registered) only, never on the operation: an all-reduce and a reduce-scatter
+ all-gather of the same buffer then run the same algorithm and give the same bits (DP vs
ZeRO). Every rank evaluates the same pure
function of the same arguments, so all ranks choose alike. Ties go to "rhd" (at p = 2 both
algorithms are the same single exchange). "native" is never chosen: its summation order is
MPI's, not ours.

Across nodes (``placement`` given, >= 2 nodes with the same number >= 2 of ranks each) a
second pair of constants prices a message that leaves its node, and ranks of one node share
its network link. The flat algorithm chosen above is then compared with "hierarchical"
(ring reduce-scatter inside each node, ring all-reduce of the owned chunk across nodes, ring
all-gather inside; see ``hierarchical.py``), costed for N nodes of L ranks, p = N L, placed
node by node:

| algorithm, all-reduce | busiest node link carries | steps that cross nodes  |
|-----------------------|---------------------------|-------------------------|
| flat ring             | 2 (p-1)/p n               | all 2 (p-1)             |
| flat rhd, p = 2^k     | 2 L (p-L)/p n             | 2 log2 N                |
| hierarchical          | 2 (N-1)/N n               | 2 (N-1)                 |

plus the in-node steps and the hierarchical one's staging copies (2 n). Hierarchical wins
for large buffers whenever the network is slower than shared memory, and it is chosen only
where the model says it is strictly faster. With one rank per node or a single node the rule
above is unchanged (hierarchical degenerates to the flat ring there).
"""

from __future__ import annotations

ALPHA_FENCE = 7e-6  # s per shared-memory fence (Win_sync + barrier + Win_sync), p = 2
ALPHA = 10e-6  # s per step (one pairwise exchange: MPI rendezvous + Python overhead)
BETA = 1 / 10e9  # s per byte copied between ranks
GAMMA = 1 / 8e9  # s per byte added in place (two reads, one write)
# A message that leaves its node: a round figure for a cluster network (10 Gbit/s Ethernet
# with MPI over TCP); the real link is unknown when the choice is made, and only matters
# through its ratio to shared memory, which any network keeps well above 1.
ALPHA_NET = 30e-6
BETA_NET = 1 / 1.25e9

REDUCTIONS = ("allreduce", "reduce_scatter", "allgather")


def _log2_ceil(p: int) -> int:
    return (p - 1).bit_length()


def predicted_time(op: str, algorithm: str, nbytes: int, world: int) -> float:
    """Modelled seconds of ``op`` with ``algorithm`` ("ring", "rhd" or "shm") on ``world``
    ranks of one node."""
    p, n = world, float(nbytes)
    if p <= 1 or n <= 0:
        return 0.0
    if op not in REDUCTIONS and op != "broadcast":
        raise ValueError(f"no cost model for op {op!r}")
    if algorithm == "shm":  # fences; sum the owned block from the peers; store it to theirs
        if op == "broadcast":
            return 2 * ALPHA_FENCE + n * BETA
        t = 2 * ALPHA_FENCE + (p - 1) / p * n * (BETA + GAMMA)
        return t if op == "allreduce" else t / 2 + ALPHA_FENCE  # halves: 2 fences each
    if op == "broadcast":
        if algorithm == "ring":
            return 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * n * BETA
        if algorithm == "rhd":
            return _log2_ceil(p) * (ALPHA + n * BETA)
        raise ValueError(f"no cost model for algorithm {algorithm!r}")
    if op not in REDUCTIONS:
        raise ValueError(f"no cost model for op {op!r}")
    if algorithm == "ring":
        t = 2 * (p - 1) * ALPHA + (p - 1) / p * n * (2 * BETA + GAMMA)
    elif algorithm == "rhd":
        pof2 = 1 << (p.bit_length() - 1)
        steps = 2 * (pof2.bit_length() - 1)
        t = steps * ALPHA + (pof2 - 1) / pof2 * n * (2 * BETA + GAMMA)
        if pof2 != p:  # fold in (whole buffer, added) and out (whole buffer)
            t += 2 * ALPHA + n * (2 * BETA + GAMMA)
    else:
        raise ValueError(f"no cost model for algorithm {algorithm!r}")
    return t if op == "allreduce" else t / 2


def two_level_time(algorithm: str, nbytes: int, nodes: int, ranks_per_node: int) -> float:
    """Modelled all-reduce seconds across ``nodes`` x ``ranks_per_node`` ranks placed node by
    node: "ring", "rhd" (flat) or "hierarchical"; see the second table above."""
    n, N, L = float(nbytes), nodes, ranks_per_node
    p = N * L
    if p <= 1 or n <= 0:
        return 0.0
    if algorithm == "hierarchical":
        # staging copies in and out, and two sub-collectives per half: ~2 steps of overhead
        inside = predicted_time("allreduce", "ring", nbytes, L) + 2 * ALPHA + 2 * n * BETA
        across = 2 * (N - 1) * ALPHA_NET + (N - 1) / N * n * (2 * BETA_NET + GAMMA / L)
        return inside + across
    if algorithm == "ring":  # every step has one message per node link
        return 2 * (p - 1) * ALPHA_NET + (p - 1) / p * n * (2 * BETA_NET + GAMMA)
    if algorithm == "rhd":
        pof2 = 1 << (p.bit_length() - 1)
        per_node = max(1, L * pof2 // p)  # participants per node after the fold
        t = 0.0
        mask = pof2 >> 1
        while mask:  # one halving step and its doubling mirror; each rank moves n mask/pof2
            s = n * mask / pof2
            if mask >= per_node:  # partner on another node: the node's ranks share its link
                t += 2 * (ALPHA_NET + per_node * s * BETA_NET) + s * GAMMA
            else:
                t += 2 * (ALPHA + s * BETA) + s * GAMMA
            mask >>= 1
        if pof2 != p:  # folded pairs are neighbours, on one node
            t += 2 * ALPHA + n * (2 * BETA + GAMMA)
        return t
    raise ValueError(f"no two-level cost model for algorithm {algorithm!r}")


def choose_algorithm(
    op: str,
    nbytes: int,
    world: int,
    placement: object | None = None,
    registered: bool = False,
) -> str:
    """The algorithm "auto" runs: the cheaper of "rhd" and "ring" under the model above; on
    one node, for a ``registered`` buffer, "shm" where it is strictly faster still; across
    nodes "hierarchical" where the two-level model says it is strictly faster.

    ``placement``: a ``topology.Placement`` (anything with ``num_nodes``, ``uniform`` and
    ``max_ranks_per_node``) or None for one node.
    """
    model_op = "broadcast" if op == "broadcast" else "allreduce"  # one rule for the reductions
    rhd = predicted_time(model_op, "rhd", nbytes, world)
    ring = predicted_time(model_op, "ring", nbytes, world)
    flat = "rhd" if rhd <= ring else "ring"
    one_node = placement is None or placement.num_nodes == 1  # type: ignore[attr-defined]
    if one_node and registered and predicted_time(model_op, "shm", nbytes, world) < min(rhd, ring):
        return "shm"
    if placement is None or model_op == "broadcast":
        return flat
    nodes, per_node = placement.num_nodes, placement.max_ranks_per_node  # type: ignore[attr-defined]
    if nodes < 2 or per_node < 2 or not placement.uniform:  # type: ignore[attr-defined]
        return flat
    hier = two_level_time("hierarchical", nbytes, nodes, per_node)
    return "hierarchical" if hier < two_level_time(flat, nbytes, nodes, per_node) else flat
