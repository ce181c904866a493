"""Closed-form α–β (Hockney) collective times, per algorithm.

n is the per-rank buffer for
all-reduce and broadcast, and the *total* (gathered / scattered) size for reduce-scatter
and all-gather, as in nccl-tests. p = ranks, α = link latency per step, β = 1/(bw·eff),
γ = reduction cost per byte (0 on accelerators, where the reduction is fused in the copy).

=====================  ======================================================================
all-reduce ring        2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ             (Patarasuk & Yuan 2009)
all-reduce rhd         2·log2(q)α + 2(q−1)/q·nβ + (q−1)/q·nγ, q = 2^⌊log2 p⌋ (Rabenseifner);
                       p ≠ q adds the fold: 2α + 2nβ + nγ           (Thakur et al. 2005)
all-reduce rec. doub.  log2(q)(α + nβ + nγ), plus the same fold when p ≠ q
reduce-scatter ring    (p−1)α + (p−1)/p·n(β+γ)
reduce-scatter rhd     log2(q)α + (q−1)/q·n(β+γ); p ≠ q adds α + n(β+γ) + α + (n/p)β
all-gather ring        (p−1)α + (p−1)/p·nβ
all-gather rhd         ⌈log2 p⌉α + (p−1)/p·nβ    (recursive doubling; Bruck when p ≠ 2^k)
broadcast ring / rhd   (p−1)α + nβ (pipelined chain, large-message limit) / ⌈log2 p⌉(α + nβ)
p2p                    α + nβ
hierarchical (k per node, m nodes): all-reduce = RS_ring(n, k, intra) + AR_ring(n/k, m, rail)
                       + AG_ring(n, k, intra); each GPU drives its share of the node's NICs
=====================  ======================================================================
"""

from __future__ import annotations

import math

from .profile import Link

OP_ALIASES = {
    "allreduce": "allreduce",
    "all_reduce": "allreduce",
    "all-reduce": "allreduce",
    "reduce_scatter": "reduce_scatter",
    "reduce-scatter": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "allgather": "allgather",
    "all_gather": "allgather",
    "all-gather": "allgather",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "p2p": "p2p",
    "sendrecv": "p2p",
}
ALGORITHMS = ("ring", "rhd", "recursive_doubling", "hierarchical", "native", "auto")
LINK_CLASSES = ("intra", "inter", "host", "auto")


def canonical_op(op: str) -> str:
    try:
        return OP_ALIASES[op.lower()]
    except KeyError:
        raise ValueError(
            f"unknown collective '{op}'; use one of {sorted(set(OP_ALIASES))}"
        ) from None


def _pow2_floor(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _native_algorithm(op: str, nbytes: float, p: int) -> str:
    """MPICH's default choice (maint/tuning/coll/mpir/generic.json, MPICH 3.x CVARs)."""
    pow2 = p == _pow2_floor(p)
    if op == "allreduce":
        return "recursive_doubling" if nbytes <= 2048 else "rhd"
    if op == "allgather":
        return "rhd" if (pow2 and nbytes < 512 * 1024) or nbytes < 80 * 1024 else "ring"
    if op == "reduce_scatter":
        return "rhd" if nbytes < 512 * 1024 else "ring"
    if op == "broadcast":
        return "rhd" if nbytes <= 12 * 1024 or p < 8 else "ring"
    return "ring"


def collective_time(
    op: str,
    algorithm: str,
    nbytes: float,
    world: int,
    link: Link,
    *,
    inter: Link | None = None,
    devices_per_node: int | None = None,
) -> float:
    """Seconds for one collective of ``nbytes`` over ``world`` ranks on ``link``.

    ``hierarchical`` also needs ``inter`` (the per-GPU share of the inter-node network) and
    ``devices_per_node``; ``auto`` takes the fastest of ring and rhd (and hierarchical when
    those are given and the group spans nodes).
    """
    op = canonical_op(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm '{algorithm}'; use one of {ALGORITHMS}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if world == 1 or nbytes == 0:
        return 0.0
    if algorithm == "native":
        algorithm = _native_algorithm(op, nbytes, world)
    if algorithm == "auto":
        options = [collective_time(op, a, nbytes, world, link) for a in ("ring", "rhd")]
        if inter is not None and devices_per_node and world > devices_per_node:
            options.append(
                collective_time(
                    op,
                    "hierarchical",
                    nbytes,
                    world,
                    link,
                    inter=inter,
                    devices_per_node=devices_per_node,
                )
            )
        return min(options)
    if algorithm == "hierarchical":
        if inter is None or not devices_per_node:
            raise ValueError("hierarchical collectives need inter= and devices_per_node=")
        return _hierarchical(op, nbytes, world, link, inter, devices_per_node)

    a, b, g = link.latency, link.beta, link.gamma
    n, p = float(nbytes), world
    q = _pow2_floor(p)
    lg_q = math.log2(q)
    lg_p_ceil = math.ceil(math.log2(p))
    if op == "p2p":
        return a + n * b
    if op == "allreduce":
        if algorithm == "ring":
            return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
        if algorithm == "rhd":
            t = 2 * lg_q * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g
        else:  # recursive doubling: every step exchanges and reduces the whole vector
            t = lg_q * (a + n * b + n * g)
        if q != p:  # fold the p - q extra ranks in before and out after (MPICH)
            t += 2 * a + 2 * n * b + n * g
        return t
    if op == "reduce_scatter":
        if algorithm == "ring":
            return (p - 1) * a + (p - 1) / p * n * (b + g)
        t = lg_q * a + (q - 1) / q * n * (b + g)
        if q != p:
            t += a + n * (b + g) + a + n / p * b
        return t
    if op == "allgather":
        if algorithm == "ring":
            return (p - 1) * a + (p - 1) / p * n * b
        return lg_p_ceil * a + (p - 1) / p * n * b
    # broadcast
    if algorithm == "ring":
        return (p - 1) * a + n * b
    return lg_p_ceil * (a + n * b)


def _hierarchical(op: str, n: float, p: int, intra: Link, rail: Link, k: int) -> float:
    k = min(k, p)
    m = math.ceil(p / k)
    if m == 1:
        return collective_time(op, "ring", n, p, intra)
    if op == "allreduce":
        return (
            collective_time("reduce_scatter", "ring", n, k, intra)
            + collective_time("allreduce", "ring", n / k, m, rail)
            + collective_time("allgather", "ring", n, k, intra)
        )
    if op == "reduce_scatter":
        return collective_time("reduce_scatter", "ring", n, k, intra) + collective_time(
            "reduce_scatter", "ring", n / k, m, rail
        )
    if op == "allgather":
        return collective_time("allgather", "ring", n / k, m, rail) + collective_time(
            "allgather", "ring", n, k, intra
        )
    if op == "broadcast":
        return collective_time("broadcast", "ring", n, m, rail) + collective_time(
            "broadcast", "ring", n, k, intra
        )
    return collective_time("p2p", "ring", n, 2, rail)


__all__ = ["ALGORITHMS", "LINK_CLASSES", "OP_ALIASES", "canonical_op", "collective_time"]
