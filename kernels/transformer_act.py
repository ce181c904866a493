"""Exact (erf) GELU and tanh, forward and backward, for BERT's feed-forward and pooler.

GPT-2 uses the tanh approximation (``gelu.py``); Hugging Face's BERT uses the exact
``0.5 x (1 + erf(x / sqrt 2))`` (``hidden_act: gelu``), so imported BERT weights see the
activation they were trained with. The normal cdf is a vectorisable erfc fit;
tanh reuses ``gelu.tanh_f32``. Elementwise on flat 1-D views.
"""

import numpy as np

from ._jit import kernel
from .gelu import tanh_f32
from .rowops import exp_f32

F32 = np.float32


_C = tuple(F32(c) for c in (
    0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
    0.37409196, 1.00002368, -1.26551223,
))  # fmt: skip
_R = F32(0.7071067811865476)  # 1 / sqrt 2


@kernel
def _erfc_exponent(t):
    """c(t) of erfc(z) = t exp(-z^2 + c(t)), t = 1 / (1 + z / 2), z >= 0: the degree-9
    Chebyshev fit of Press et al., Numerical Recipes (2nd ed., section 6.2), fractional
    error below 1.2e-7 everywhere."""
    c = _C[0]
    c = c * t + _C[1]
    c = c * t + _C[2]
    c = c * t + _C[3]
    c = c * t + _C[4]
    c = c * t + _C[5]
    c = c * t + _C[6]
    c = c * t + _C[7]
    c = c * t + _C[8]
    return c * t + _C[9]


# The normal cdf Phi(x) = erfc(-x / sqrt 2) / 2 is written out in both loops below rather
# than called: as a function LLVM does not inline it, and the loops stop vectorising
# (libm's scalar ``erff``, used before, was a fifth of bert-mini's step). The tail
# Phi(-|x|) is computed directly, without cancellation.
@kernel
def gelu_erf_forward(out, inp):
    """out = 0.5 x (1 + erf(x / sqrt 2)) = x Phi(x)."""
    half = F32(0.5)
    one = F32(1.0)
    zero = F32(0.0)
    for i in range(inp.shape[0]):
        x = inp[i]
        z = abs(x) * _R
        t = one / (one + half * z)
        tail = half * t * exp_f32(_erfc_exponent(t) - z * z)  # Phi(-|x|)
        out[i] = x * (tail if x < zero else one - tail)


@kernel
def gelu_erf_backward(dinp, inp, dout):
    """dinp = (Phi(x) + x phi(x)) * dout, Phi / phi the standard normal cdf / pdf."""
    half = F32(0.5)
    one = F32(1.0)
    zero = F32(0.0)
    c = F32(0.3989422804014327)  # 1 / sqrt(2 pi)
    for i in range(inp.shape[0]):
        x = inp[i]
        z = abs(x) * _R
        t = one / (one + half * z)
        tail = half * t * exp_f32(_erfc_exponent(t) - z * z)
        cdf = tail if x < zero else one - tail
        pdf = c * exp_f32(-half * x * x)
        dinp[i] = (cdf + x * pdf) * dout[i]


@kernel
def tanh_forward(out, inp):
    """out = tanh(inp)."""
    for i in range(inp.shape[0]):
        out[i] = tanh_f32(inp[i])


@kernel
def tanh_backward(dinp, out, dout):
    """dinp = (1 - out^2) * dout, from the forward's output."""
    one = F32(1.0)
    for i in range(out.shape[0]):
        y = out[i]
        dinp[i] = (one - y * y) * dout[i]


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the models use."""
    x = np.linspace(-3, 3, 5, dtype=np.float32)
    y = np.zeros_like(x)
    gelu_erf_forward(y, x)
    gelu_erf_backward(y, x, y.copy())
    tanh_forward(y, x)
    tanh_backward(x.copy(), y, y.copy())
    _erfc_exponent(F32(0.5))  # the helper: its dispatcher carries a signature
