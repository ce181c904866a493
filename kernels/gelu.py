"""GELU in GPT-2's tanh form: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))).

Elementwise, so the kernels take flat 1-D views (callers pass ``a.reshape(-1)``).

tanh is a rational approximation, not libm: ``math.tanh`` on float32 calls ``tanhf`` one
element at a time (no SVML here) and took 91 ms for 4M elements, while the polynomial
ratio below vectorises and took 1.2 ms (measured). Its coefficients were fitted for this
file (Lawson-weighted least squares of the relative error on [0, 9], tanh(x) ~ x P(x^2) /
Q(x^2) with P of degree 4 and Q of degree 4 in x^2); evaluated in float32 the largest
absolute error against float64 tanh is 3.4e-7, about 3 ulp near 1.
"""

import numpy as np

from ._jit import kernel
from .optim import _fma

F32 = np.float32

_P1 = F32(1.338397478e-01)
_P2 = F32(3.498989198e-03)
_P3 = F32(2.066113724e-05)
_P4 = F32(1.341963291e-08)
_Q1 = F32(4.671729627e-01)
_Q2 = F32(2.589018112e-02)
_Q3 = F32(3.291026560e-04)
_Q4 = F32(7.804654821e-07)


@kernel
def tanh_f32(x):
    """float32 tanh, max abs error 3.4e-7, vectorisable (no libm call)."""
    lim = F32(9.0)  # tanh(9) rounds to 1 in float32
    one = F32(1.0)
    v = min(max(x, -lim), lim)
    z = v * v
    # Horner steps as single-rounding FMAs: half the instructions of mul + add (numba
    # never contracts them itself without fastmath), and each step rounds once
    p = _fma(_fma(_fma(_fma(_P4, z, _P3), z, _P2), z, _P1), z, one)
    q = _fma(_fma(_fma(_fma(_Q4, z, _Q3), z, _Q2), z, _Q1), z, one)
    t = v * p / q
    return min(max(t, -one), one)


@kernel
def gelu_f32(x):
    """gelu(x) in float32, tanh approximation (``gelu_forward``'s value;
    ``linear.linear_gelu_forward`` applies it to a product's rows in place)."""
    half = F32(0.5)
    one = F32(1.0)
    k = F32(0.7978845608028654)  # sqrt(2 / pi)
    a = F32(0.044715)
    return half * x * (one + tanh_f32(k * (x + a * x * x * x)))


@kernel
def gelu_forward(out, inp):
    """out = gelu(inp), tanh approximation."""
    # out, inp: (n,)
    for i in range(inp.shape[0]):
        out[i] = gelu_f32(inp[i])


@kernel
def gelu_backward(dinp, inp, dout):
    """dinp = gelu'(inp) * dout (overwrites).

    dinp may be the same array as dout, but then the loop runs scalar (LLVM's runtime
    overlap check fails), 16x slower than with a separate dinp (measured, 1M elements).
    """
    # dinp, inp, dout: (n,)
    for i in range(inp.shape[0]):
        dinp[i] = gelu_grad(inp[i]) * dout[i]


@kernel
def gelu_grad(x):
    """d gelu(x) / dx, float32 (``gelu_backward``'s factor; ``linear.linear_gelu_backward``
    applies it to a product's rows in place)."""
    half = F32(0.5)
    one = F32(1.0)
    k = F32(0.7978845608028654)  # sqrt(2 / pi)
    a = F32(0.044715)
    a3 = F32(3.0 * 0.044715)
    x2 = x * x
    th = tanh_f32(k * (x + a * x2 * x))
    # d/dx [0.5 x (1 + th)] = 0.5 (1 + th) + 0.5 x (1 - th^2) k (1 + 3 a x^2)
    return half * (one + th) + half * x * (one - th * th) * k * (one + a3 * x2)


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    x = np.linspace(-3, 3, 5, dtype=np.float32)
    y = np.zeros_like(x)
    gelu_forward(y, x)
    gelu_backward(y, x, y)
    tanh_f32(F32(0.5))
    gelu_f32(F32(0.5))
    gelu_grad(F32(0.5))
