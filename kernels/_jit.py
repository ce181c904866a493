"""The one place that decides how kernels are compiled.

numba's on-disk cache key does not include jit options such as fastmath, so they are fixed
literals here, never read from the environment. ``error_model="numpy"`` keeps divisions and
square roots free of Python's zero-division checks (several times faster).
"""

from numba import njit

kernel = njit(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)

reduction = njit(
    cache=True, nogil=True, fastmath={"reassoc"}, error_model="numpy", boundscheck=False
)
"""For a reduction whose summation order is free (``optim.sum_of_squares``): ``reassoc``
alone lets LLVM vectorise the sum (partial sums across SIMD lanes and unrolled copies, a
fixed order for given code and input), and nothing else. Without it a float64 sum is one
scalar add per element (12x slower, measured on 3.3M elements)."""
