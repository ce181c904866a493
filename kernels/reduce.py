"""Reduction kernels of the collectives: the last addition fused with the averaging."""

import numpy as np

from ._jit import kernel
from .optim import LANES, combine_lanes, lane_sum_of_squares

F32 = np.float32
# Elements per piece of ``add_divide_store``: its three arrays' pieces (48 KiB) stay in L1/L2
# between the pass that writes them and the one that squares them. A multiple of LANES, so
# every piece starts at lane 0.
PIECE = 4096


@kernel
def add_divide(acc, x, divisor):
    """acc[N] = (acc + x) / divisor in float32: bitwise ``np.add`` then ``np.divide`` (true
    division, as ``comm.algorithm.average_block``), in one vectorised pass instead of two."""
    d = F32(divisor)
    for i in range(acc.size):
        acc[i] = (acc[i] + x[i]) / d


@kernel
def _copy(dst, src):
    """dst[N] = src (a loop LLVM vectorises; numba's slice assignment checks for overlap and
    copies through a temporary)."""
    for i in range(src.size):
        dst[i] = src[i]


@kernel
def add_divide_store(acc, x, divisor, dst, lanes):
    """``add_divide(acc, x, divisor)``, its result also stored into ``dst`` (a peer's buffer),
    and ``sum_of_squares(acc)`` of the result returned: the shared-memory all-reduce's last
    addition, its store to the peer and the gradient norm's share in one pass over memory
    instead of three. Piece by piece, so a piece is still in cache when it is stored and
    squared; the squares go into the lanes of ``lane_sum_of_squares`` and the total is
    ``combine_lanes``': the same adds in the same order as ``sum_of_squares``, so the same
    bits. ``lanes``: LANES float64 of scratch (overwritten)."""
    d = F32(divisor)
    lanes[:] = 0.0
    n = acc.size
    for a in range(0, n, PIECE):
        b = min(a + PIECE, n)
        piece = acc[a:b]
        # three short passes while the piece is in cache (one loop storing to both acc and
        # dst did not vectorise: 4x slower)
        add_divide(piece, x[a:b], d)
        _copy(dst[a:b], piece)
        lane_sum_of_squares(piece, 0, lanes)
    return combine_lanes(lanes)


def _warm() -> None:
    flat = np.ones(8, F32)
    add_divide(flat[0:2], flat[2:4], F32(2))
    add_divide_store(flat[0:2], flat[2:4], F32(2), flat[4:6], np.zeros(LANES))
