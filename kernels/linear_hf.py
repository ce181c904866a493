"""Fully connected layer with PyTorch's ``nn.Linear`` layout: weight (out, in).

GPT-2's Conv1D stores weights (in, out) (``linear.py``); BERT, T5 and the AIAYN
Transformer in Hugging Face / PyTorch store them (out, in), and simdist keeps each model's
own layout so checkpoints move without transposes. The products go through BLAS with the
transposed operand as a ``.T`` view (a transpose flag, no copy). Also the row gather and
scatter of the masked-LM head, which runs only on the masked positions.
"""

import numpy as np

from ._jit import kernel
from .blas import gemm

F32 = np.float32


@kernel
def linear_hf_forward(out, inp, weight, bias):
    """out[N,O] = inp[N,I] @ weight[O,I].T + bias[O] (overwritten)."""
    gemm(inp, weight.T, out, F32(1.0), F32(0.0))
    N, O = out.shape
    for n in range(N):
        for o in range(O):
            out[n, o] += bias[o]


@kernel
def linear_hf_backward(dinp, dweight, dbias, dout, inp, weight):
    """dinp = dout @ weight; dweight = dout.T @ inp; dbias = sum of dout rows (overwritten)."""
    gemm(dout, weight, dinp, F32(1.0), F32(0.0))
    gemm(dout.T, inp, dweight, F32(1.0), F32(0.0))
    N, O = dout.shape
    for o in range(O):
        dbias[o] = F32(0.0)
    for n in range(N):
        for o in range(O):
            dbias[o] += dout[n, o]


@kernel
def linear_hf_backward_accumulate(dinp, dweight, dbias, dout, inp, weight):
    """dinp += dout @ weight (ADDS: several projections read one input); dweight and dbias
    overwritten as in ``linear_hf_backward``."""
    gemm(dout, weight, dinp, F32(1.0), F32(1.0))
    gemm(dout.T, inp, dweight, F32(1.0), F32(0.0))
    N, O = dout.shape
    for o in range(O):
        dbias[o] = F32(0.0)
    for n in range(N):
        for o in range(O):
            dbias[o] += dout[n, o]


@kernel
def gather_rows_forward(out, inp, rows):
    """out[i] = inp[rows[i]]."""
    # out: (M, C); inp: (N, C); rows: (M,) int32
    M, C = out.shape
    for i in range(M):
        r = rows[i]
        for c in range(C):
            out[i, c] = inp[r, c]


@kernel
def gather_rows_backward(dinp, dout, rows):
    """dinp[rows[i]] += dout[i] (ADDS; zero dinp first when it holds nothing else)."""
    M, C = dout.shape
    for i in range(M):
        r = rows[i]
        for c in range(C):
            dinp[r, c] += dout[i, c]


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the models use."""
    x = np.ones((2, 3), F32)
    w = np.ones((4, 3), F32)
    b = np.ones(4, F32)
    y = np.empty((2, 4), F32)
    linear_hf_forward(y, x, w, b)
    linear_hf_backward(x.copy(), w.copy(), b.copy(), y, x, w)
    linear_hf_backward_accumulate(x.copy(), w.copy(), b.copy(), y, x, w)
    rows = np.array([1, 0], np.int32)
    gather_rows_forward(x.copy(), x, rows)
    gather_rows_backward(x.copy(), x, rows)
