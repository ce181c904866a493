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
from .dropout import site_key, uniform_f32
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


# ---------------------------------------------------------------------------------------
# General multi-head attention (BERT, T5, the AIAYN Transformer): q, k and v come as three
# separate (B, T, C) tensors (nn.Linear projections), attention is bidirectional or causal,
# keys can be masked per sample (padding), and the probabilities can be dropped out with
# the counter-based masks of ``dropout.py``. GPT-2 keeps the fused-qkv kernels above.
_NEG = F32(-3.0e38)  # a masked key's score: exp underflows to exactly 0, as in PyTorch


@kernel
def _drop_probs(dst, src, key, base, p, scale):
    """dst = src * mask / (1 - p): mask of element (t, j) hashes (key, base + t * T + j)."""
    T0, T1 = src.shape
    zero = F32(0.0)
    for t in range(T0):
        off = base + t * T1
        for j in range(T1):
            dst[t, j] = src[t, j] * scale if uniform_f32(key, off + j) >= p else zero


@kernel
def mha_forward(out, att, q, k, v, keep, scratch, dprobs, n_head, causal, keys, site, p):
    """out = dropout(softmax(mask(q k^T / sqrt(hs)))) v per head; att saves the softmax.

    keep[b, j] == 0 masks key j of sample b (padding); ``causal`` also masks j > t.
    keys: per-sample dropout keys (uint64, ``dropout.sample_keys``), site: this layer's
    dropout site, p: the probability (0: no dropout; keys are then unused).
    """
    # out, q, k, v: (B, T, C); att: (B, NH, T, T); keep: (B, T) float32;
    # scratch: (>= 4, T, hs); dprobs: (T, T)
    B, T, C = q.shape
    hs = C // n_head
    if scratch.shape[0] < 4 or scratch.shape[1] != T or scratch.shape[2] != hs:
        raise ValueError("attention scratch must have shape (>= 4, T, head_size)")
    scale = F32(1.0) / np.sqrt(F32(hs))
    dscale = F32(1.0) / (F32(1.0) - p)
    zero = F32(0.0)
    one = F32(1.0)
    qs = scratch[0]
    ks = scratch[1]
    vs = scratch[2]
    y = scratch[3]
    for b in range(B):
        m = keep[b]
        for h in range(n_head):
            o = h * hs
            for t in range(T):
                for i in range(hs):
                    qs[t, i] = q[b, t, o + i] * scale
                    ks[t, i] = k[b, t, o + i]
                    vs[t, i] = v[b, t, o + i]
            pr = att[b, h]
            np.dot(qs, ks.T, pr)
            for t in range(T):
                row = pr[t]
                n = t + 1 if causal else T
                for j in range(n):
                    if m[j] == zero:
                        row[j] = _NEG
                mx = row_max(row, n)
                for j in range(n):
                    row[j] = exp_f32(row[j] - mx)
                inv = one / row_sum(row, n)
                for j in range(n):
                    row[j] *= inv
                for j in range(n, T):
                    row[j] = zero
            if p > zero:
                kk = site_key(keys[b], site)
                _drop_probs(dprobs, pr, kk, h * T * T, p, dscale)
                np.dot(dprobs, vs, y)
            else:
                np.dot(pr, vs, y)
            for t in range(T):
                for i in range(hs):
                    out[b, t, o + i] = y[t, i]


@kernel
def mha_backward(dq, dk, dv, dout, q, k, v, att, scratch, dscores, n_head, causal, keys, site, p):
    """dq, dk, dv (overwritten) from dout, the saved softmax and the forward's inputs."""
    # dq, dk, dv, dout, q, k, v: (B, T, C); att: (B, NH, T, T); scratch: (7, T, hs);
    # dscores: (T, T)
    B, T, C = q.shape
    hs = C // n_head
    if scratch.shape[0] < 7 or scratch.shape[1] != T or scratch.shape[2] != hs:
        raise ValueError("attention scratch must have shape (7, T, head_size)")
    if dscores.shape[0] != T or dscores.shape[1] != T:
        raise ValueError("attention dscores must have shape (T, T)")
    scale = F32(1.0) / np.sqrt(F32(hs))
    dscale = F32(1.0) / (F32(1.0) - p)
    zero = F32(0.0)
    qs = scratch[0]
    ks = scratch[1]
    vs = scratch[2]
    dy = scratch[3]
    dqs = scratch[4]
    dks = scratch[5]
    dvs = scratch[6]
    ds = dscores
    for b in range(B):
        for h in range(n_head):
            o = h * hs
            for t in range(T):
                for i in range(hs):
                    qs[t, i] = q[b, t, o + i] * scale
                    ks[t, i] = k[b, t, o + i]
                    vs[t, i] = v[b, t, o + i]
                    dy[t, i] = dout[b, t, o + i]
            pr = att[b, h]
            if p > zero:
                kk = site_key(keys[b], site)
                _drop_probs(ds, pr, kk, h * T * T, p, dscale)  # the dropped probabilities
                np.dot(ds.T, dy, dvs)
                np.dot(dy, vs.T, ds)
                _drop_probs(ds, ds, kk, h * T * T, p, dscale)  # back through the mask
            else:
                np.dot(pr.T, dy, dvs)
                np.dot(dy, vs.T, ds)
            for t in range(T):
                prow = pr[t]
                drow = ds[t]
                n = t + 1 if causal else T
                s = row_dot(prow, drow, n)
                for j in range(n):
                    drow[j] = prow[j] * (drow[j] - s)
                for j in range(n, T):
                    drow[j] = zero
            np.dot(ds, ks, dqs)
            np.dot(ds.T, qs, dks)
            for t in range(T):
                for i in range(hs):
                    dq[b, t, o + i] = dqs[t, i] * scale
                    dk[b, t, o + i] = dks[t, i]
                    dv[b, t, o + i] = dvs[t, i]


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
    # the general kernels, with and without dropout and the causal mask
    q3 = qkv[:, :, :C].copy()
    keep = np.ones((B, T), dtype=np.float32)
    keys = np.arange(B, dtype=np.uint64)
    for causal, p in ((False, F32(0.1)), (True, F32(0.0))):
        mha_forward(out, att, q3, q3, q3, keep, scratch, dscores, NH, causal, keys, 0, p)
        dq, dk, dv = q3.copy(), q3.copy(), q3.copy()
        args = (out, q3, q3, q3, att, scratch, dscores, NH, causal, keys, 0, p)
        mha_backward(dq, dk, dv, *args)
    # the helper too, so its Python-visible dispatcher carries a signature (a caller loaded
    # from the cache never compiles it)
    _drop_probs(dscores, dscores.copy(), np.uint64(1), 0, F32(0.1), F32(1.0 / 0.9))
