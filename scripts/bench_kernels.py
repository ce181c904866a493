"""Throughput of the linear kernels against NumPy's own matmul (printed, never asserted).

    python scripts/bench_kernels.py [--reps 50]

One thread (simdist pins it). Forward is 2*B*C*OC FLOP; backward twice that (dinp and
dweight). NumPy's reference runs the same three products with ``out=`` so neither side
allocates; numba's np.dot uses SciPy's OpenBLAS, NumPy its own, so differences are BLAS
builds as much as numba overhead.
"""

import simdist  # noqa: F401  (one thread per process, before numpy loads)

# isort: split
import argparse
import os
import platform
import time
from collections.abc import Callable

import numba
import numpy as np
import scipy
from simdist.kernels.linear import linear_backward, linear_forward

F32 = np.float32


def best_seconds(fn: Callable[..., object], args: tuple, reps: int) -> float:
    fn(*args)  # compile / warm caches
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best


def numpy_forward(out, inp, weight, bias):
    np.matmul(inp, weight, out=out)
    out += bias


def numpy_backward(dinp, dweight, dbias, dout, inp, weight):
    np.matmul(dout, weight.T, out=dinp)
    np.matmul(inp.T, dout, out=dweight)
    dout.sum(axis=0, out=dbias)


def bench_shape(B: int, C: int, OC: int, reps: int) -> None:
    rng = np.random.default_rng(0)
    inp = rng.standard_normal((B, C)).astype(F32)
    weight = rng.standard_normal((C, OC)).astype(F32)
    bias = rng.standard_normal(OC).astype(F32)
    dout = rng.standard_normal((B, OC)).astype(F32)
    out, dinp = np.empty((B, OC), F32), np.empty_like(inp)
    dweight, dbias = np.empty_like(weight), np.empty_like(bias)
    flop = 2.0 * B * C * OC
    fwd_args = (out, inp, weight, bias)
    bwd_args = (dinp, dweight, dbias, dout, inp, weight)
    for name, f, kern, ref, args in [
        ("forward", flop, linear_forward, numpy_forward, fwd_args),
        ("backward", 2 * flop, linear_backward, numpy_backward, bwd_args),
    ]:
        k, n = best_seconds(kern, args, reps), best_seconds(ref, args, reps)
        print(f"{f'{B}x{C}x{OC}':>16} {name:>9} {f / k / 1e9:12.1f} {f / n / 1e9:11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    reps = parser.parse_args().reps
    print(
        f"{platform.processor() or platform.machine()}, affinity {len(os.sched_getaffinity(0))}"
        f" cores; numba {numba.__version__}, numpy {np.__version__}, scipy {scipy.__version__};"
        f" best of {reps}"
    )
    print(f"{'B x C x OC':>16} {'op':>9} {'kernel GF/s':>12} {'numpy GF/s':>11}")
    for B, C, OC in [(128, 784, 512), (128, 512, 512)]:
        bench_shape(B, C, OC, reps)


if __name__ == "__main__":
    main()
