"""Compute and memory sweeps of one thread: GEMM rates by size, shape and layout, the SIMD
and scalar rates, the call overhead and memory rates by array size (see
``simdist.calibrate`` for what each feeds in the profile)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def best_time(fn: Callable[[], Any], repeats: int, min_time: float = 0.02) -> float:
    """Best-of-``repeats`` seconds per call, each sample long enough to time reliably."""
    fn()  # warm up (page faults, BLAS thread start-up, JIT)
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - t0 >= min_time or calls >= 1 << 20:
            break
        calls *= 2
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def measure_gemm(sizes: list[int], repeats: int) -> dict[int, float]:
    """FLOP/s of float32 n x n x n GEMM per size (``kernels.blas.gemm``, the kernels' call)."""
    nn = _gemm_kernels()["nn"]
    rng = np.random.default_rng(0)
    out = {}
    for n in sizes:
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        c = np.empty((n, n), np.float32)
        t = best_time(lambda a=a, b=b, c=c: nn(a, b, c), repeats)
        out[n] = 2.0 * n**3 / t
    return out


SHAPE_BIG = 512  # the other two dimensions of the shape sweep


def _gemm_kernels() -> dict[str, Callable]:
    """The kernels' ``blas.gemm`` per layout: the library the training run's products use
    (oneMKL, oneDNN or OpenBLAS, ``blas.library()``), not numba's ``np.dot``, which always
    calls SciPy's OpenBLAS (on an Intel CPU with the ``mkl`` extra that measured the GEMMs
    slower than the run's, and so predicted its steps too long)."""
    from simdist.kernels.blas import gemm

    one, zero = np.float32(1.0), np.float32(0.0)

    def nn(a, b, c):
        gemm(a, b, c, one, zero)

    def nt(a, b, c):
        gemm(a, b.T, c, one, zero)

    def tn(a, b, c):
        gemm(a.T, b, c, one, zero)

    return {"nn": nn, "nt": nt, "tn": tn}


def measure_gemm_shapes(smalls: list[int], repeats: int) -> dict[str, dict[str, dict]]:
    """FLOP/s of float32 GEMMs with one dimension ``s`` and the other two ``SHAPE_BIG``, per
    layout (nn: a @ b; nt: a @ b.T; tn: a.T @ b, the transposed operand an F-contiguous
    view, as the kernels pass it) and per axis of the small one (m: a micro-batch's rows;
    k: a weight gradient's inner dimension; n: few output columns)."""
    rng = np.random.default_rng(1)
    big = SHAPE_BIG
    out: dict[str, dict[str, dict]] = {}
    for layout, fn in _gemm_kernels().items():
        out[layout] = {"m": {}, "k": {}, "n": {}}
        for s in smalls:
            shapes = ((s, big, big), (big, s, big), (big, big, s))
            for axis, (m, k, n) in zip("mkn", shapes, strict=True):
                a_shape = (k, m) if layout == "tn" else (m, k)
                b_shape = (n, k) if layout == "nt" else (k, n)
                a = rng.standard_normal(a_shape, dtype=np.float32)
                b = rng.standard_normal(b_shape, dtype=np.float32)
                c = np.empty((m, n), np.float32)
                t = best_time(lambda a=a, b=b, c=c, fn=fn: fn(a, b, c), repeats)
                out[layout][axis][s] = 2.0 * m * k * n / t
    return out


def measure_memory(sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Bytes moved per second (read + write) for copy and add, per array size in bytes, and
    for AdamW's update (``kernels.optim.adamw_update``) over four arrays of that size: the
    optimizer pass a step makes, reading parameters, gradients and both moments and writing
    three of them back (28 bytes per element)."""
    from simdist.kernels.optim import adamw_update

    res: dict[str, dict[int, float]] = {"copy": {}, "add": {}, "adamw": {}}
    # views of one large array, as the kernels' operands are views of the flat buffers and
    # the activation arena
    big = max(sizes) // 4 + 1024
    pool = np.ones(3 * big, np.float32)
    for nbytes in sizes:
        n = nbytes // 4
        a, b, c = pool[:n], pool[big : big + n], pool[2 * big : 2 * big + n]
        t = best_time(lambda a=a, c=c: np.copyto(c, a), repeats)
        res["copy"][nbytes] = 2 * nbytes / t
        t = best_time(lambda a=a, b=b, c=c: np.add(a, b, out=c), repeats)
        res["add"][nbytes] = 3 * nbytes / t
    for nbytes in sizes:  # its own arrays: four of them, the moment v kept non-negative
        n = nbytes // 4
        p, g, m = (np.full(n, x, np.float32) for x in (0.5, 1e-3, 1e-4))
        v = np.full(n, 1e-6, np.float32)
        args = (p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
        adamw_update(*args)  # compiled (or loaded) before it is timed
        t = best_time(lambda args=args: adamw_update(*args), repeats)
        res["adamw"][nbytes] = 7 * nbytes / t
        del p, g, m, v, args
    return res


def measure_scalar(repeats: int) -> dict[str, float]:
    """FLOP/s of reductions, which the kernels compile without fastmath, so each lane is a
    chain of dependent adds: fp32, ``kernels.rowops.row_sum`` (32 lanes, 1 flop per
    element) on rows of 256 as layernorm and softmax run it; fp64, the gradient norm's
    ``kernels.optim.sum_of_squares`` (2 flops per element). On cached data, so the rate is
    the core's, not memory's."""
    from numba import njit

    from simdist.kernels.optim import sum_of_squares
    from simdist.kernels.rowops import row_sum

    @njit(cache=False, nogil=True, error_model="numpy", boundscheck=False)
    def rows(x, reps):  # pragma: no cover - compiled
        total = np.float32(0.0)
        for _ in range(reps):
            for r in range(x.shape[0]):
                total += row_sum(x[r], x.shape[1])
        return total

    x32 = np.full((64, 256), 1.0000001, np.float32)  # 64 KiB
    rows(x32, 1)
    t32 = best_time(lambda: rows(x32, 100), repeats)
    x64 = np.full(1 << 16, 1.0000001, np.float32)  # 256 KiB: in L2
    t64 = best_time(lambda: sum_of_squares(x64), repeats)
    return {"fp32": 100.0 * x32.size / t32, "fp64": 2.0 * x64.size / t64}


def measure_vector(repeats: int) -> tuple[float, float]:
    """(FLOP/s of vectorised elementwise arithmetic, per-call overhead in seconds).

    The rate is the core's SIMD arithmetic: a degree-8 polynomial per element (Horner: 16
    flops, multiplies and adds, as numba emits them without fastmath) on a 16 KiB array,
    enough work per element that loads and stores do not bound it, as in the kernels'
    exp and tanh polynomials. Memory-bound kernels are bounded by the memory rate instead.
    """
    from numba import njit

    @njit(cache=False, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)
    def poly_loop(a, c, reps):  # pragma: no cover - compiled
        for _ in range(reps):
            for i in range(a.size):
                x = a[i]
                r = np.float32(0.1)
                for _ in range(8):
                    r = r * x + np.float32(0.5)
                c[i] = r

    @njit(cache=False, nogil=True, error_model="numpy")
    def nothing(a):  # pragma: no cover - compiled
        a[0] = a[0]

    n, reps = 4096, 500  # 16 KiB per array: stays in L1/L2
    a = np.full(n, 0.9999999, np.float32)
    c = np.zeros(n, np.float32)
    poly_loop(a, c, 1)
    nothing(a)
    t = best_time(lambda: poly_loop(a, c, reps), repeats)
    overhead = best_time(lambda: nothing(a), repeats, min_time=0.01)
    return 16.0 * n * reps / t, overhead


__all__ = [
    "SHAPE_BIG",
    "best_time",
    "measure_gemm",
    "measure_gemm_shapes",
    "measure_memory",
    "measure_scalar",
    "measure_vector",
]
