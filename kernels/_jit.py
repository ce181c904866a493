"""The one place that decides how kernels are compiled.

numba's on-disk cache key does not include jit options such as fastmath, so they are fixed
literals here, never read from the environment. ``error_model="numpy"`` keeps divisions and
square roots free of Python's zero-division checks (several times faster).
"""

from numba import njit

kernel = njit(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)
