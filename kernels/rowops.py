"""Row reductions and a vectorisable float32 exp, shared by the GPT-2 kernels.

The kernels compile without fastmath, so LLVM may not reorder a float32 reduction: one
running sum is a single dependency chain, one add per ~4 cycles. The reductions here keep
eight independent partial sums (or maxima), which ran about 4x faster on rows of 256
(measured), and sum the partials pairwise at the end.

``exp_f32`` exists because ``np.exp`` on float32 calls libm's ``expf`` one element at a
time (no SVML here), which keeps the softmax loops scalar; the version below is plain
arithmetic plus an exponent-field bitcast, so LLVM vectorises the loops that call it.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._jit import kernel

F32 = np.float32


@intrinsic
def _pow2(typingctx, k):
    """2.0**k as float32 for an integer k in [-126, 127]: k + 127 placed in the exponent."""
    if not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        k32 = builder.trunc(args[0], i32) if k.bitwidth > 32 else args[0]
        biased = builder.add(k32, ir.Constant(i32, 127))
        bits = builder.shl(biased, ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(k), codegen


@kernel
def exp_f32(x):
    """float32 e**x within 2 ulp; 0 below -87.33 (no denormals), saturates above 88.

    NaN propagates. Vectorisable: every branch below becomes a select.
    """
    # e**x = 2**k * e**r with k = round(x / ln 2) and |r| <= ln(2) / 2; r is computed with
    # ln 2 split in two (hi has few bits, so k * hi is exact for |k| < 2**15) and e**r by
    # its Taylor series to r**7, whose truncation error (|r|**8 / 8! < 6e-9) is below ulp/2.
    lo_lim = F32(-87.33)  # e**-87.33 ~ FLT_MIN: below, return 0 rather than a denormal
    hi_lim = F32(88.0)  # keeps k <= 127, the largest finite exponent
    xc = min(max(x, lo_lim), hi_lim)
    kf = np.floor(xc * F32(1.4426950408889634) + F32(0.5))
    r = xc - kf * F32(0.693359375)
    r = r - kf * F32(-2.12194440e-4)
    p = F32(1.0 / 5040.0)
    p = p * r + F32(1.0 / 720.0)
    p = p * r + F32(1.0 / 120.0)
    p = p * r + F32(1.0 / 24.0)
    p = p * r + F32(1.0 / 6.0)
    p = p * r + F32(0.5)
    p = p * r + F32(1.0)
    p = p * r + F32(1.0)
    y = p * _pow2(np.int32(kf))
    if x != x:
        return x
    return F32(0.0) if x < lo_lim else y


@kernel
def row_sum(x, n):
    """sum(x[:n]), eight partial sums."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F32(0.0)
    i = 0
    while i + 8 <= n:
        s0 += x[i]
        s1 += x[i + 1]
        s2 += x[i + 2]
        s3 += x[i + 3]
        s4 += x[i + 4]
        s5 += x[i + 5]
        s6 += x[i + 6]
        s7 += x[i + 7]
        i += 8
    while i < n:
        s0 += x[i]
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@kernel
def row_max(x, n):
    """max(x[:n]) for n >= 1, eight partial maxima."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = x[0]
    i = 0
    while i + 8 <= n:
        m0 = max(m0, x[i])
        m1 = max(m1, x[i + 1])
        m2 = max(m2, x[i + 2])
        m3 = max(m3, x[i + 3])
        m4 = max(m4, x[i + 4])
        m5 = max(m5, x[i + 5])
        m6 = max(m6, x[i + 6])
        m7 = max(m7, x[i + 7])
        i += 8
    while i < n:
        m0 = max(m0, x[i])
        i += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@kernel
def row_dot(a, b, n):
    """sum(a[:n] * b[:n]), eight partial sums."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F32(0.0)
    i = 0
    while i + 8 <= n:
        s0 += a[i] * b[i]
        s1 += a[i + 1] * b[i + 1]
        s2 += a[i + 2] * b[i + 2]
        s3 += a[i + 3] * b[i + 3]
        s4 += a[i + 4] * b[i + 4]
        s5 += a[i + 5] * b[i + 5]
        s6 += a[i + 6] * b[i + 6]
        s7 += a[i + 7] * b[i + 7]
        i += 8
    while i < n:
        s0 += a[i] * b[i]
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@kernel
def row_dot_dev(a, b, x, m, n):
    """sum(a[:n] * b[:n] * (x[:n] - m)), eight partial sums."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F32(0.0)
    i = 0
    while i + 8 <= n:
        s0 += a[i] * b[i] * (x[i] - m)
        s1 += a[i + 1] * b[i + 1] * (x[i + 1] - m)
        s2 += a[i + 2] * b[i + 2] * (x[i + 2] - m)
        s3 += a[i + 3] * b[i + 3] * (x[i + 3] - m)
        s4 += a[i + 4] * b[i + 4] * (x[i + 4] - m)
        s5 += a[i + 5] * b[i + 5] * (x[i + 5] - m)
        s6 += a[i + 6] * b[i + 6] * (x[i + 6] - m)
        s7 += a[i + 7] * b[i + 7] * (x[i + 7] - m)
        i += 8
    while i < n:
        s0 += a[i] * b[i] * (x[i] - m)
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@kernel
def row_sq_dev(x, m, n):
    """sum((x[:n] - m)**2), eight partial sums."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F32(0.0)
    i = 0
    while i + 8 <= n:
        d0 = x[i] - m
        d1 = x[i + 1] - m
        d2 = x[i + 2] - m
        d3 = x[i + 3] - m
        d4 = x[i + 4] - m
        d5 = x[i + 5] - m
        d6 = x[i + 6] - m
        d7 = x[i + 7] - m
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        s3 += d3 * d3
        s4 += d4 * d4
        s5 += d5 * d5
        s6 += d6 * d6
        s7 += d7 * d7
        i += 8
    while i < n:
        d0 = x[i] - m
        s0 += d0 * d0
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the kernels use."""
    x = np.arange(9, dtype=np.float32)
    row_sum(x, 9)
    row_max(x, 9)
    row_dot(x, x, 9)
    row_dot_dev(x, x, x, F32(1.0), 9)
    row_sq_dev(x, F32(1.0), 9)
    exp_f32(F32(-1.0))
