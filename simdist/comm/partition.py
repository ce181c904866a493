"""How a flat buffer is cut into one contiguous block per rank.

The same offsets serve the all-reduce chunks of data parallelism and the default ZeRO shards,
which is what lets both produce bit-identical results (see ``collectives.py``). Pure NumPy, no
MPI: safe to import in serial code and tests.
"""

from __future__ import annotations

import operator

import numpy as np


def partition(n: int, world: int) -> np.ndarray:
    """``world + 1`` int64 offsets; block ``r`` is ``[off[r], off[r + 1])``.

    Blocks differ in length by at most one element: the first ``n % world`` ranks get the extra
    one, so the split depends only on ``(n, world)``.
    """
    if world < 1:
        raise ValueError(f"partition: world must be >= 1, got {world}")
    if n < 0:
        raise ValueError(f"partition: n must be >= 0, got {n}")
    base, extra = divmod(int(n), int(world))
    sizes = np.full(world, base, dtype=np.int64)
    sizes[:extra] += 1
    offsets = np.zeros(world + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def bounds_list(bounds: object, n: int, world: int) -> list[int]:
    """``bounds`` as a list of Python ints, checked to partition ``n`` elements over ``world``.

    Valid: ``world + 1`` integers, ``bounds[0] == 0``, ``bounds[-1] == n``, non-decreasing
    (empty blocks allowed). Raises ValueError or TypeError saying what is wrong. Plain Python
    on a short list: a few microseconds even per call.
    """
    seq = bounds.tolist() if isinstance(bounds, np.ndarray) else bounds
    try:
        b = [operator.index(v) for v in seq]  # type: ignore[union-attr]
    except TypeError:
        raise TypeError(f"bounds must be a 1-D sequence of integers, got {bounds!r}") from None
    if len(b) != world + 1:
        raise ValueError(f"bounds must have world + 1 = {world + 1} entries, got {len(b)}")
    if b[0] != 0 or b[-1] != n:
        raise ValueError(f"bounds must run from 0 to len(buf) = {n}, got {b[0]} .. {b[-1]}")
    if any(b[i] > b[i + 1] for i in range(world)):
        raise ValueError(f"bounds must be non-decreasing, got {b}")
    return b
