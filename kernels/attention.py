"""Causal multi-head self-attention of GPT-2, from the fused qkv projection.

qkv is (B, T, 3C) laid out as [q | k | v] along the last axis, each split into n_head heads
of hs = C / n_head columns (Hugging Face's c_attn layout). Scores are scaled by
1/sqrt(hs) (folded into q while it is gathered), masked causally and normalised with a
max-subtracted softmax (``rowops.exp_f32``, which vectorises); the probabilities are saved
for backward. The output is the heads' results side by side, (B, T, C), before c_proj.

Per (batch, head) the products go through BLAS ``np.dot(a, b, out)``: the head's q, k, v
columns are strided inside qkv, and BLAS in numba would copy (allocate) a non-contiguous
operand, so they are first gathered into a caller-provided contiguous ``scratch`` of shape
(7, T, hs) (forward uses 4 of its slots) and, for backward, ``dscores`` of shape (T, T).
The scratch comes in those shapes rather than flat because carving a flat buffer inside
the kernel needs numba's ``reshape``, whose size check computes in float64. The products
are dense T x T; the masked half is zeroed, not skipped, which BLAS still does faster than
a triangular loop at GPT-2's head sizes (64).
"""

import numpy as np

from ._jit import kernel
from .rowops import exp_f32, row_dot, row_max, row_sum

F32 = np.float32


SCRATCH_SLOTS = 7  # q, k, v, dy (y in forward), dq, dk, dv


def attention_scratch_shapes(T: int, head_size: int) -> tuple[tuple[int, ...], tuple[int, int]]:
    """Shapes of ``scratch`` and ``dscores`` for sequences of length T."""
    return (SCRATCH_SLOTS, T, head_size), (T, T)


@kernel
def attention_forward(out, att, qkv, scratch, n_head):
    """out = softmax(mask(q k^T / sqrt(hs))) v per head; saves the probabilities in att."""
    # out: (B, T, C); att: (B, NH, T, T); qkv: (B, T, 3C); scratch: (>= 4, T, hs)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    if scratch.shape[0] < 4 or scratch.shape[1] != T or scratch.shape[2] != hs:
        raise ValueError("attention scratch must have shape (>= 4, T, head_size)")
    scale = F32(1.0) / np.sqrt(F32(hs))
    zero = F32(0.0)
    one = F32(1.0)
    q = scratch[0]  # (T, hs) each, C-contiguous
    k = scratch[1]
    v = scratch[2]
    y = scratch[3]
    for b in range(B):
        for h in range(n_head):
            oq = h * hs
            ok = C + h * hs
            ov = 2 * C + h * hs
            for t in range(T):
                src = qkv[b, t]
                for i in range(hs):
                    q[t, i] = src[oq + i] * scale  # (q / sqrt(hs)) k^T: scale T*hs, not T*T
                    k[t, i] = src[ok + i]
                    v[t, i] = src[ov + i]
            p = att[b, h]  # (T, T), C-contiguous
            np.dot(q, k.T, p)  # scaled scores, (T, T)
            for t in range(T):
                row = p[t]
                n = t + 1  # causal: position t sees 0..t
                mx = row_max(row, n)
                for j in range(n):
                    row[j] = exp_f32(row[j] - mx)
                inv = one / row_sum(row, n)
                for j in range(n):
                    row[j] *= inv
                for j in range(n, T):
                    row[j] = zero  # future positions: zero probability
            np.dot(p, v, y)  # (T, hs)
            for t in range(T):
                dst = out[b, t]
                for i in range(hs):
                    dst[oq + i] = y[t, i]


@kernel
def attention_backward(dqkv, dout, qkv, att, scratch, dscores, n_head):
    """dqkv from dout, the saved probabilities and qkv; overwrites dqkv."""
    # dqkv, qkv: (B, T, 3C); dout: (B, T, C); att: (B, NH, T, T);
    # scratch: (7, T, hs); dscores: (T, T)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    if scratch.shape[0] < 7 or scratch.shape[1] != T or scratch.shape[2] != hs:
        raise ValueError("attention scratch must have shape (7, T, head_size)")
    if dscores.shape[0] != T or dscores.shape[1] != T:
        raise ValueError("attention dscores must have shape (T, T)")
    scale = F32(1.0) / np.sqrt(F32(hs))
    zero = F32(0.0)
    q = scratch[0]  # (T, hs) each, C-contiguous
    k = scratch[1]
    v = scratch[2]
    dy = scratch[3]
    dq = scratch[4]
    dk = scratch[5]
    dv = scratch[6]
    ds = dscores
    for b in range(B):
        for h in range(n_head):
            oq = h * hs
            ok = C + h * hs
            ov = 2 * C + h * hs
            for t in range(T):
                src = qkv[b, t]
                g = dout[b, t]
                for i in range(hs):
                    q[t, i] = src[oq + i] * scale  # the scaled q of the forward
                    k[t, i] = src[ok + i]
                    v[t, i] = src[ov + i]
                    dy[t, i] = g[oq + i]
            p = att[b, h]  # (T, T)
            np.dot(dy, v.T, ds)  # dP = dY V^T, (T, T)
            np.dot(p.T, dy, dv)  # dV = P^T dY, (T, hs)
            # softmax backward per row: dS = P * (dP - sum_j P dP); rows are causal, so
            # only j <= t carries gradient
            for t in range(T):
                prow = p[t]
                drow = ds[t]
                n = t + 1
                s = row_dot(prow, drow, n)
                for j in range(n):
                    drow[j] = prow[j] * (drow[j] - s)
                for j in range(n, T):
                    drow[j] = zero
            np.dot(ds, k, dq)  # d(scaled q) = dS K, (T, hs)
            np.dot(ds.T, q, dk)  # dK = dS^T (scaled q), (T, hs)
            for t in range(T):
                dst = dqkv[b, t]
                for i in range(hs):
                    dst[oq + i] = dq[t, i] * scale  # chain rule through q * scale
                    dst[ok + i] = dk[t, i]
                    dst[ov + i] = dv[t, i]


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    B, T, NH, hs = 1, 2, 2, 2
    C = NH * hs
    qkv = np.ones((B, T, 3 * C), dtype=np.float32)
    out = np.zeros((B, T, C), dtype=np.float32)
    att = np.zeros((B, NH, T, T), dtype=np.float32)
    shape, dshape = attention_scratch_shapes(T, hs)
    scratch = np.zeros(shape, dtype=np.float32)
    dscores = np.zeros(dshape, dtype=np.float32)
    attention_forward(out, att, qkv, scratch, NH)
    attention_backward(qkv.copy(), out, qkv, att, scratch, dscores, NH)
