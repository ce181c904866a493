"""Fully connected layer: out = inp @ weight + bias, weight stored (in, out) like GPT-2's Conv1D.

The three matrix products go through BLAS (``np.dot(a, b, out)`` inside njit calls SciPy's
sgemm with alpha=1, beta=0, so the destination is overwritten). Transposed operands are
``.T`` views: the transpose of a C-contiguous array is F-contiguous, which numba hands to
gemm as a transpose flag, so nothing is copied or allocated. Biases are added and reduced
by plain float32 loops.
"""

import numpy as np

from ._jit import kernel

F32 = np.float32


@kernel
def linear_forward(out, inp, weight, bias):
    """out[B,OC] = inp[B,C] @ weight[C,OC] + bias[OC] (out is overwritten)."""
    np.dot(inp, weight, out)  # sgemm, beta = 0
    B, OC = out.shape
    for b in range(B):
        for o in range(OC):
            out[b, o] += bias[o]


@kernel
def linear_backward_params(dweight, dbias, dout, inp):
    """dweight[C,OC] = inp[B,C].T @ dout[B,OC]; dbias[OC] = sum over B of dout (overwritten)."""
    np.dot(inp.T, dout, dweight)  # inp.T is an F-layout view: gemm with transa, no copy
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
    np.dot(dout, weight.T, dinp)  # weight.T is an F-layout view: gemm with transb, no copy
    linear_backward_params(dweight, dbias, dout, inp)


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
