"""T5's layer norm: RMS normalisation over the last axis, a weight and no bias, no mean.

y = weight * x / sqrt(mean(x^2) + eps), as Hugging Face's ``T5LayerNorm`` (Zhang and
Sennrich's RMSNorm; T5 uses eps = 1e-6). Rows are flattened tokens: callers pass (N, C)
views. The row reductions come from ``rowops`` (32 vector lanes: the kernels compile
without fastmath).
"""

import numpy as np

from ._jit import kernel
from .rowops import row_dot, row_dot_dev

F32 = np.float32


@kernel
def rmsnorm_forward(out, rstd, inp, weight, eps):
    """out = inp * rstd * weight per row, rstd = 1 / sqrt(mean(inp^2) + eps) (saved)."""
    # out, inp: (N, C); rstd: (N,); weight: (C,); eps: float32
    N, C = inp.shape
    inv_c = F32(1.0) / F32(C)
    one = F32(1.0)
    for n in range(N):
        x = inp[n]
        s = one / np.sqrt(row_dot(x, x, C) * inv_c + eps)
        o = out[n]
        for c in range(C):
            o[c] = weight[c] * (x[c] * s)
        rstd[n] = s


@kernel
def _rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, accumulate):
    # dinp, dout, inp: (N, C); dweight, weight: (C,); rstd: (N,)
    N, C = inp.shape
    inv_c = F32(1.0) / F32(C)
    dweight[:] = F32(0.0)
    for n in range(N):
        x = inp[n]
        g = dout[n]
        d = dinp[n]
        s = rstd[n]
        # y = w x s with s = (mean(x^2) + eps)^(-1/2), so ds/dx_c = -s^3 x_c / C and
        # dx = s * (g w - x * s^2 * mean(g w x))
        k = row_dot_dev(g, weight, x, F32(0.0), C) * inv_c * s * s
        if accumulate:
            for c in range(C):
                d[c] += s * (g[c] * weight[c] - x[c] * k)
        else:
            for c in range(C):
                d[c] = s * (g[c] * weight[c] - x[c] * k)
        for c in range(C):
            dweight[c] += g[c] * (x[c] * s)


@kernel
def rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd):
    """Overwrites dinp and dweight."""
    _rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, False)


@kernel
def rmsnorm_backward_accumulate(dinp, dweight, dout, inp, weight, rstd):
    """ADDS the input gradient into dinp (the residual stream); overwrites dweight."""
    _rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, True)


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    x = np.ones((2, 3), dtype=np.float32)
    y = np.zeros((2, 3), dtype=np.float32)
    w = np.ones(3, dtype=np.float32)
    s = np.zeros(2, dtype=np.float32)
    rmsnorm_forward(y, s, x, w, F32(1e-6))
    rmsnorm_backward(x.copy(), w.copy(), y, x, w, s)
    rmsnorm_backward_accumulate(x.copy(), w.copy(), y, x, w, s)
    _rmsnorm_backward(x.copy(), w.copy(), y, x, w, s, False)
