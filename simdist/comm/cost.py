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

(p' = largest power of two <= p; reduce-scatter and all-gather are each half of the
all-reduce row.) The constants are round figures measured on the development machine kind
(2 cores, MPICH shared memory, Python loop overhead included); only their ratios matter.

The choice for all-reduce, reduce-scatter and all-gather depends on ``(n, p)`` only, never on
the operation: an all-reduce and a reduce-scatter + all-gather of the same buffer then run the
same algorithm and give the same bits (DP vs ZeRO). Every rank evaluates the same pure
function of the same arguments, so all ranks choose alike. Ties go to "rhd" (at p = 2 both
algorithms are the same single exchange). "native" is never chosen: its summation order is
MPI's, not ours.
"""

from __future__ import annotations

ALPHA = 10e-6  # s per step (one pairwise exchange: MPI rendezvous + Python overhead)
BETA = 1 / 10e9  # s per byte copied between ranks
GAMMA = 1 / 8e9  # s per byte added in place (two reads, one write)

REDUCTIONS = ("allreduce", "reduce_scatter", "allgather")


def _log2_ceil(p: int) -> int:
    return (p - 1).bit_length()


def predicted_time(op: str, algorithm: str, nbytes: int, world: int) -> float:
    """Modelled seconds of ``op`` with ``algorithm`` ("ring" or "rhd") on ``world`` ranks."""
    p, n = world, float(nbytes)
    if p <= 1 or n <= 0:
        return 0.0
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


def choose_algorithm(op: str, nbytes: int, world: int) -> str:
    """The algorithm "auto" runs: the cheaper of "rhd" and "ring" under the model above."""
    model_op = "broadcast" if op == "broadcast" else "allreduce"  # one rule for the reductions
    rhd = predicted_time(model_op, "rhd", nbytes, world)
    ring = predicted_time(model_op, "ring", nbytes, world)
    return "rhd" if rhd <= ring else "ring"
