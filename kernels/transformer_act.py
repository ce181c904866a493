"""Exact (erf) GELU and tanh, forward and backward, for BERT's feed-forward and pooler.

GPT-2 uses the tanh approximation (``gelu.py``); Hugging Face's BERT uses the exact
``0.5 x (1 + erf(x / sqrt 2))`` (``hidden_act: gelu``), so imported BERT weights see the
activation they were trained with. ``erf`` is libm's float32 ``erff`` (scalar); tanh reuses
``gelu.tanh_f32``. Elementwise on flat 1-D views.
"""

import math

import numpy as np

from ._jit import kernel
from .gelu import tanh_f32
from .rowops import exp_f32

F32 = np.float32


@kernel
def gelu_erf_forward(out, inp):
    """out = 0.5 x (1 + erf(x / sqrt 2))."""
    half = F32(0.5)
    one = F32(1.0)
    r = F32(0.7071067811865476)
    for i in range(inp.shape[0]):
        x = inp[i]
        out[i] = half * x * (one + math.erf(x * r))


@kernel
def gelu_erf_backward(dinp, inp, dout):
    """dinp = (Phi(x) + x phi(x)) * dout, Phi / phi the standard normal cdf / pdf."""
    half = F32(0.5)
    one = F32(1.0)
    r = F32(0.7071067811865476)
    c = F32(0.3989422804014327)  # 1 / sqrt(2 pi)
    for i in range(inp.shape[0]):
        x = inp[i]
        cdf = half * (one + math.erf(x * r))
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
