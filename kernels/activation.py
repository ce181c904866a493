"""ReLU forward and backward on 2-D C-contiguous float32 activations (B, C).

Deliberately 2-D loops rather than ``reshape(size)`` views: numba's reshape checks the new
size with a float64 comparison (uitofp/fcmp double in the IR), which the float64 scan in
the tests would flag; callers with (B, T, C) pass a (B*T, C) view instead.
"""

import numpy as np

from ._jit import kernel

F32 = np.float32


@kernel
def relu_forward(out, inp):
    """out[B,C] = max(inp[B,C], 0); out may alias inp. NaN propagates (divergence stays visible)."""
    B, C = inp.shape
    zero = F32(0.0)
    for b in range(B):
        for c in range(C):
            x = inp[b, c]
            # `x <= 0` is False for NaN, so NaN passes through instead of becoming 0.
            out[b, c] = zero if x <= zero else x


@kernel
def relu_backward(dinp, dout, out):
    """dinp[B,C] = dout[B,C] where the forward output out[B,C] > 0, else 0 (dinp may be dout)."""
    B, C = out.shape
    zero = F32(0.0)
    for b in range(B):
        for c in range(C):
            # Each element is read before it is written, so dinp aliasing dout is safe.
            dinp[b, c] = dout[b, c] if out[b, c] > zero else zero


def _warm() -> None:
    """Compile (or load from cache) for the production layout: 2-D C-contiguous float32."""
    x = np.array([[-1.0, 2.0], [3.0, -4.0]], F32)
    y = np.empty_like(x)
    relu_forward(y, x)
    relu_backward(x, y, y)
