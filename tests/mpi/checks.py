"""What the MPI check scripts share: record a check, compare bits, count the failures.

Each rank keeps its own count (``Tally``) and prints a failure as it happens, with the rank,
so a run of several ranks shows which one saw what.
"""

from __future__ import annotations

import numpy as np


class Tally:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.failures = 0
        self.checks = 0

    def expect(self, ok: bool, what: str) -> None:
        """Record one check; print a failure right away, with the rank."""
        self.checks += 1
        if not ok:
            self.failures += 1
            print(f"[rank {self.rank}/{self.size}] FAIL: {what}", flush=True)

    def same(self, got: np.ndarray, want: np.ndarray, what: str) -> None:
        """Bitwise equality (NaN-free float32 inputs), naming the first differing index."""
        ok = got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))
        if not ok and got.shape == want.shape:
            i = int(np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))[0])
            what += f" (first difference at {i}: got {got[i]!r}, want {want[i]!r})"
        elif not ok:
            what += f" (shape {got.shape} != {want.shape})"
        self.expect(ok, what)


# The documented summation orders of the collectives, as references (P = len(xs) ranks).
def _plus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


def ring_order(xs: list[np.ndarray], b: np.ndarray, add=_plus) -> np.ndarray:
    """ring.py: block q (bounds b[q]:b[q+1]) = (((x[q+1] + x[q+2]) + ...) + x[q]).
    ``add``: one addition as the wire performs it (a half wire rounds every sum)."""
    P = len(xs)
    out = np.empty_like(xs[0])
    for q in range(P):
        s = slice(int(b[q]), int(b[q + 1]))
        acc = xs[(q + 1) % P][s].copy()
        for k in range(2, P + 1):
            acc = add(acc, xs[(q + k) % P][s])
        out[s] = acc
    return out


def rhd_order(xs: list[np.ndarray], add=_plus) -> np.ndarray:
    """rhd.py: folded pairs, then participants paired across the highest bit."""
    P = len(xs)
    pof2 = 1 << (P.bit_length() - 1)
    rem = P - pof2
    v = [add(xs[2 * i], xs[2 * i + 1]) if i < rem else xs[i + rem].copy() for i in range(pof2)]
    half = pof2 // 2
    while half:
        v = [add(v[i], v[i + half]) for i in range(half)]
        half //= 2
    return v[0]
