"""MPI check of the half-precision wire (``Collectives.half_wire``). Under mpiexec:

    mpiexec -n 4 python -m mpi4py tests/mpi/check_half_wire.py

For bfloat16 and float16, every algorithm's averaging all-reduce leaves the same bits on
every rank, values of the half format, close to the exact mean; "ring" and "rhd" equal their
documented summation orders with every partial sum rounded to the half format; a ring
all-reduce sends exactly half the bytes of the float32 one; reduce-scatter + all-gather in
the half wire equals the all-reduce; a float32 wire after it is untouched (the context
manager restores it). Exits 1 if any rank saw a failure.
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per rank before numpy loads)

# isort: split
import sys
import zlib

import numpy as np
from checks import Tally, rhd_order, ring_order
from simdist.kernels.half import BF16, F16, round_half

from simdist.comm import Collectives, partition
from simdist.comm.topology import Placement
from simdist.comm.world import world

COMM = world()
RANK, P = COMM.Get_rank(), COMM.Get_size()
TALLY = Tally(RANK, P)
expect, same = TALLY.expect, TALLY.same
LENGTHS = (1000, 2**19 + 7)  # the second is cut into pipelined segments


def r(x: np.ndarray, fmt: int) -> np.ndarray:
    y = np.array(x, np.float32)
    round_half(y.reshape(-1), fmt)
    return y


def inputs(n: int, fmt: int) -> list[np.ndarray]:
    """Every rank's contribution (each rank can compute all of them): half values."""
    return [
        r(np.random.default_rng(100 + q).standard_normal(n, np.float32) * 3, fmt) for q in range(P)
    ]  # noqa: E501


def half_add(fmt: int):
    """One addition of a half wire: the float32 sum stored in the half format."""
    return lambda a, b: r(a + b, fmt)


def mean_half(total: np.ndarray, fmt: int) -> np.ndarray:
    return r(total / np.float32(P), fmt)


def agreed(x: np.ndarray) -> bool:
    digests = COMM.allgather(zlib.crc32(x.view(np.uint8)))
    return len(set(digests)) == 1


def check(coll: Collectives, alg: str, label: str) -> None:
    for fmt, fname in ((BF16, "bf16"), (F16, "fp16")):
        tol = 2.0**-7 if fmt == BF16 else 2.0**-10  # a few units in the last place
        for n in LENGTHS:
            xs = inputs(n, fmt)
            tag = f"{label} {fname} n={n}"
            buf = xs[RANK].copy()
            with coll.half_wire(fmt):
                coll.allreduce(buf, average=True, algorithm=alg)
            expect(agreed(buf), f"{tag}: ranks hold different all-reduce results")
            same(buf, r(buf, fmt), f"{tag}: not values of the half format")
            exact = np.mean(np.stack(xs).astype(np.float64), axis=0)
            scale = np.abs(np.stack(xs)).sum(axis=0).max() / P
            err = float(np.abs(buf - exact).max())
            expect(err <= P * tol * scale, f"{tag}: {err} from the exact mean")
            b = partition(n, P)
            if alg == "ring" and P > 1:
                same(buf, mean_half(ring_order(xs, b, half_add(fmt)), fmt), f"{tag}: ring order")
            if alg == "rhd" and P > 1:
                same(buf, mean_half(rhd_order(xs, half_add(fmt)), fmt), f"{tag}: rhd order")
            # reduce-scatter + all-gather in the half wire: the all-reduce's bits
            two = xs[RANK].copy()
            with coll.half_wire(fmt):
                coll.reduce_scatter(two, bounds=b, average=True, algorithm=alg)
                coll.allgather(two, bounds=b, algorithm=alg)
            same(two, buf, f"{tag}: reduce-scatter + all-gather")
        # the wire is float32 again: an integer-valued all-reduce stays exact
        ints = np.full(1000, float(RANK + 1), np.float32)
        coll.allreduce(ints, algorithm=alg)
        same(ints, np.full(1000, P * (P + 1) / 2, np.float32), f"{label}: fp32 after the wire")


def check_bytes() -> None:
    coll = Collectives(COMM, algorithm="ring")
    n = 2**19 + 7
    buf = inputs(n, BF16)[RANK]
    before = coll.bytes_sent
    coll.allreduce(buf.copy(), average=True)
    fp32 = coll.bytes_sent - before
    before = coll.bytes_sent
    with coll.half_wire(BF16):
        coll.allreduce(buf.copy(), average=True)
    half = coll.bytes_sent - before
    expect(2 * half == fp32, f"ring all-reduce bytes: half wire {half}, float32 {fp32}")
    coll.free()


def main() -> int:
    for alg in ("ring", "rhd", "native", "shm"):
        coll = Collectives(COMM, algorithm=alg)
        check(coll, alg, alg)
        coll.free()
    for k in (2,):
        if P % k == 0 and P // k > 1:
            place = Placement.blocks(RANK, P, k)
            coll = Collectives(COMM, algorithm="hierarchical", placement=place)
            check(coll, "hierarchical", f"hierarchical {P // k}x{k}")
            coll.free()
    if P > 1:
        check_bytes()
    failures = COMM.allreduce(TALLY.failures)
    checks = COMM.allreduce(TALLY.checks)
    if RANK == 0:
        print(f"half wire np={P}: {checks} checks, {failures} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
