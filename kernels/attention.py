"""Causal multi-head self-attention of GPT-2, from the fused qkv projection.

qkv is (B, T, 3C) laid out as [q | k | v] along the last axis, each split into n_head heads
of hs = C / n_head columns (Hugging Face's c_attn layout). Scores are scaled by
1/sqrt(hs), masked causally and normalised with a
max-subtracted softmax (``rowops.exp_f32``, which vectorises); the probabilities are saved
for backward. The output is the heads' results side by side, (B, T, C), before c_proj.

Per (batch, head) the products go through BLAS (``blas.gemm``), which reads the head's q, k,
v columns in place inside qkv (row stride 3C) and writes y, dq, dk, dv straight into the
head's columns of out and dqkv: no gather or scatter pass, no copy. The 1/sqrt(hs) scale
is BLAS's alpha (exact for hs = 64, a power of 4). Backward needs one caller-provided
``dscores`` of shape (T, T). The products are dense T x T; the masked half is zeroed, not
skipped, which BLAS still does faster than a triangular loop at GPT-2's head sizes (64).
"""

import numpy as np

from ._jit import kernel
from .blas import gemm
from .rowops import exp_f32, row_dot, row_max, row_sum

F32 = np.float32


@kernel
def attention_forward(out, att, qkv, n_head):
    """out = softmax(mask(q k^T / sqrt(hs))) v per head; saves the probabilities in att."""
    # out: (B, T, C); att: (B, NH, T, T); qkv: (B, T, 3C)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    if out.shape != (B, T, C) or att.shape != (B, n_head, T, T) or hs * n_head != C:
        raise ValueError("attention shapes: out (B, T, C), att (B, n_head, T, T), qkv (B, T, 3C)")
    scale = F32(1.0) / np.sqrt(F32(hs))
    zero = F32(0.0)
    one = F32(1.0)
    for b in range(B):
        x = qkv[b]  # (T, 3C)
        y = out[b]  # (T, C)
        for h in range(n_head):
            oq = h * hs
            q = x[:, oq : oq + hs]  # (T, hs) views, row stride 3C: BLAS reads them in place
            k = x[:, C + oq : C + oq + hs]
            v = x[:, 2 * C + oq : 2 * C + oq + hs]
            p = att[b, h]  # (T, T), C-contiguous
            gemm(q, k.T, p, scale, zero)  # scaled scores (T, T)
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
            gemm(p, v, y[:, oq : oq + hs], one, zero)  # straight into the head's columns


@kernel
def attention_backward(dqkv, dout, qkv, att, dscores, n_head):
    """dqkv from dout, the saved probabilities and qkv; overwrites dqkv."""
    # dqkv, qkv: (B, T, 3C); dout: (B, T, C); att: (B, NH, T, T); dscores: (T, T)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    if dqkv.shape != qkv.shape or dout.shape != (B, T, C) or att.shape != (B, n_head, T, T):
        raise ValueError("attention shapes: dqkv (B, T, 3C), dout (B, T, C), att (B, n_head, T, T)")
    if dscores.shape[0] != T or dscores.shape[1] != T:
        raise ValueError("attention dscores must have shape (T, T)")
    scale = F32(1.0) / np.sqrt(F32(hs))
    zero = F32(0.0)
    one = F32(1.0)
    ds = dscores
    for b in range(B):
        x = qkv[b]
        dx = dqkv[b]
        g = dout[b]
        for h in range(n_head):
            oq = h * hs
            q = x[:, oq : oq + hs]
            k = x[:, C + oq : C + oq + hs]
            v = x[:, 2 * C + oq : 2 * C + oq + hs]
            dy = g[:, oq : oq + hs]
            p = att[b, h]  # (T, T)
            gemm(dy, v.T, ds, one, zero)  # dP = dY V^T, (T, T)
            gemm(p.T, dy, dx[:, 2 * C + oq : 2 * C + oq + hs], one, zero)  # dV = P^T dY
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
            # scores = scale * q k^T: dq = scale * dS K, dk = scale * dS^T q
            gemm(ds, k, dx[:, oq : oq + hs], scale, zero)
            gemm(ds.T, q, dx[:, C + oq : C + oq + hs], scale, zero)


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    B, T, NH, hs = 1, 2, 2, 2
    C = NH * hs
    qkv = np.ones((B, T, 3 * C), dtype=np.float32)
    out = np.zeros((B, T, C), dtype=np.float32)
    att = np.zeros((B, NH, T, T), dtype=np.float32)
    dscores = np.zeros((T, T), dtype=np.float32)
    attention_forward(out, att, qkv, NH)
    attention_backward(qkv.copy(), out, qkv, att, dscores, NH)
