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
from .dropout import site_key, uniform_f32
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
    dscores = np.zeros((T, T), dtype=np.float32)
    attention_forward(out, att, qkv, NH)
    attention_backward(qkv.copy(), out, qkv, att, dscores, NH)
    # the general kernels (BERT), with and without dropout and the causal mask
    scratch = np.zeros((7, T, hs), dtype=np.float32)
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
