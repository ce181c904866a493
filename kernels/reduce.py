"""Reduction kernels of the collectives: the last addition fused with the averaging."""

import numpy as np

from ._jit import kernel

F32 = np.float32


@kernel
def add_divide(acc, x, divisor):
    """acc[N] = (acc + x) / divisor in float32: bitwise ``np.add`` then ``np.divide`` (true
    division, as ``comm.algorithm.average_block``), in one vectorised pass instead of two."""
    d = F32(divisor)
    for i in range(acc.size):
        acc[i] = (acc[i] + x[i]) / d


def _warm() -> None:
    flat = np.ones(4, F32)
    add_divide(flat[0:2], flat[2:4], F32(2))
