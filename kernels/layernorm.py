"""Layer normalisation over the last axis (GPT-2's ln_1, ln_2, ln_f), eps = 1e-5.

Rows are flattened tokens: callers pass (N, C) views with N = B*T. The row reductions use
eight independent partial sums because the kernels compile without fastmath: a single
running float32 sum is one long dependency chain that LLVM may not reorder, and eight
chains run about 4x faster (measured, C = 256).
"""

import numpy as np

from ._jit import kernel

F32 = np.float32


@kernel
def _sum_prod(a, b):
    """sum(a * b) over two 1-D arrays of equal length, eight partial sums."""
    n = a.shape[0]
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
def _sum_prod_dev(a, b, x, m):
    """sum(a * b * (x - m)) over 1-D arrays of equal length, eight partial sums."""
    n = a.shape[0]
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
def _sum(x):
    """sum(x) over a 1-D array, eight partial sums."""
    n = x.shape[0]
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
def _sum_sq_dev(x, m):
    """sum((x - m)**2) over a 1-D array, eight partial sums."""
    n = x.shape[0]
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


@kernel
def layernorm_forward(out, mean, rstd, inp, weight, bias):
    """out = (inp - mean) * rstd * weight + bias per row; saves mean and rstd for backward."""
    # out, inp: (N, C); mean, rstd: (N,); weight, bias: (C,)
    N, C = inp.shape
    inv_c = F32(1.0) / F32(C)
    eps = F32(1e-5)
    one = F32(1.0)
    for n in range(N):
        x = inp[n]
        m = _sum(x) * inv_c
        # two-pass variance: sum((x - m)^2) does not cancel the way E[x^2] - m^2 does
        s = one / np.sqrt(_sum_sq_dev(x, m) * inv_c + eps)
        o = out[n]
        for c in range(C):
            o[c] = (x[c] - m) * s * weight[c] + bias[c]
        mean[n] = m
        rstd[n] = s


@kernel
def _layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate):
    # dinp, dout, inp: (N, C); dweight, dbias, weight: (C,); mean, rstd: (N,)
    N, C = inp.shape
    inv_c = F32(1.0) / F32(C)
    dweight[:] = F32(0.0)
    dbias[:] = F32(0.0)
    for n in range(N):
        x = inp[n]
        g = dout[n]
        d = dinp[n]
        m = mean[n]
        s = rstd[n]
        # with xhat = (x - m) * s and dnorm = g * weight:
        # dx = s * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat))
        mean_dnorm = _sum_prod(g, weight) * inv_c
        mean_dnorm_xhat = _sum_prod_dev(g, weight, x, m) * s * inv_c
        for c in range(C):
            xhat = (x[c] - m) * s
            dx = s * (g[c] * weight[c] - mean_dnorm - xhat * mean_dnorm_xhat)
            if accumulate:
                d[c] += dx
            else:
                d[c] = dx
            dweight[c] += g[c] * xhat
            dbias[c] += g[c]


@kernel
def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    """Overwrites dinp, dweight and dbias."""
    # dinp, dout, inp: (N, C); dweight, dbias, weight: (C,); mean, rstd: (N,)
    _layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, False)


@kernel
def layernorm_backward_accumulate(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    """ADDS the input gradient into dinp (the residual stream); overwrites dweight, dbias."""
    # dinp, dout, inp: (N, C); dweight, dbias, weight: (C,); mean, rstd: (N,)
    _layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, True)


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    x = np.ones((2, 3), dtype=np.float32)
    y = np.zeros((2, 3), dtype=np.float32)
    w = np.ones(3, dtype=np.float32)
    b = np.zeros(3, dtype=np.float32)
    m = np.zeros(2, dtype=np.float32)
    s = np.zeros(2, dtype=np.float32)
    layernorm_forward(y, m, s, x, w, b)
    layernorm_backward(x, w.copy(), b.copy(), y, x.copy(), w, m, s)
    layernorm_backward_accumulate(x, w.copy(), b.copy(), y, x.copy(), w, m, s)
    # the helpers too, so their Python-visible dispatchers carry a signature (a caller
    # loaded from the cache never compiles them)
    _layernorm_backward(x, w.copy(), b.copy(), y, x.copy(), w, m, s, False)
    _sum(w)
    _sum_sq_dev(w, F32(0.0))
    _sum_prod(w, b)
    _sum_prod_dev(w, b, w, F32(0.0))
