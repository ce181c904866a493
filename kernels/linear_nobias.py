"""Bias-free pieces of T5: ``nn.Linear(bias=False)``, the token embedding, scale, gating.

T5 has no biases anywhere: its projections are (out, in) matrices as in PyTorch (BLAS reads
the transposed operand as a ``.T`` view, no copy), its embedding is a token lookup with no
positions (the attention's relative bias carries them), the tied LM head scales the
decoder output by d_model^-0.5 first, and T5 v1.1's gated-GELU feed-forward multiplies two
projections elementwise. The ``_accumulate`` variants ADD the input gradient into the
residual stream (``gemm`` with beta = 1: no temporary, no extra pass).
"""

import numpy as np

from ._jit import kernel
from .blas import gemm

F32 = np.float32


@kernel
def linear_nobias_forward(out, inp, weight):
    """out[N,O] = inp[N,I] @ weight[O,I].T (overwritten)."""
    gemm(inp, weight.T, out, F32(1.0), F32(0.0))


@kernel
def linear_nobias_backward(dinp, dweight, dout, inp, weight):
    """dinp = dout @ weight; dweight = dout.T @ inp (both overwritten)."""
    gemm(dout, weight, dinp, F32(1.0), F32(0.0))
    gemm(dout.T, inp, dweight, F32(1.0), F32(0.0))


@kernel
def linear_nobias_backward_accumulate(dinp, dweight, dout, inp, weight):
    """dinp += dout @ weight (ADDS); dweight = dout.T @ inp (overwritten)."""
    gemm(dout, weight, dinp, F32(1.0), F32(1.0))
    gemm(dout.T, inp, dweight, F32(1.0), F32(0.0))


@kernel
def token_embedding_forward(out, ids, table):
    """out[n] = table[ids[n]]."""
    # out: (N, C); ids: (N,) int32; table: (V, C)
    N, C = out.shape
    for n in range(N):
        row = table[ids[n]]
        for c in range(C):
            out[n, c] = row[c]


@kernel
def token_embedding_backward_accumulate(dtable, dout, ids):
    """dtable[ids[n]] += dout[n] (ADDS: the tied LM head wrote its share first)."""
    N, C = dout.shape
    for n in range(N):
        row = dtable[ids[n]]
        for c in range(C):
            row[c] += dout[n, c]


@kernel
def scale_forward(out, inp, s):
    """out = inp * s (out may be inp); flat 1-D views. Its backward is itself."""
    for i in range(inp.shape[0]):
        out[i] = inp[i] * s


@kernel
def gate_forward(out, act, lin):
    """out = act * lin (T5 v1.1: gelu(wi_0 x) * wi_1 x); flat 1-D views."""
    for i in range(act.shape[0]):
        out[i] = act[i] * lin[i]


@kernel
def gate_backward(dact, dlin, dout, act, lin):
    """dact = dout * lin, dlin = dout * act (overwritten); flat 1-D views."""
    for i in range(act.shape[0]):
        g = dout[i]
        dact[i] = g * lin[i]
        dlin[i] = g * act[i]


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    x = np.ones((2, 3), F32)
    w = np.ones((4, 3), F32)
    y = np.empty((2, 4), F32)
    linear_nobias_forward(y, x, w)
    linear_nobias_backward(x.copy(), w.copy(), y, x, w)
    linear_nobias_backward_accumulate(x.copy(), w.copy(), y, x, w)
    ids = np.array([1, 0], np.int32)
    token_embedding_forward(x, ids, w)
    token_embedding_backward_accumulate(w, x, ids)
    f = x.reshape(-1)
    scale_forward(f, f, F32(0.5))
    gate_forward(f.copy(), f, f)
    gate_backward(f.copy(), f.copy(), f, f, f)
