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
def mha_attend_forward(
    out, att, q, k, v, keep, scratch, dprobs, n_head, causal, keys, site, p, scale, bias, has_bias
):
    """out = dropout(softmax(mask(scale q k^T + bias))) v per head; att saves the softmax.

    Queries and keys may come from different sequences (cross-attention: Tq decoder
    positions over Tk encoder positions). keep[b, j] == 0 masks key j of sample b
    (padding); ``causal`` (Tq == Tk) also masks j > t. ``bias`` (NH, Tq, Tk), read only
    when ``has_bias``, is added to every sample's scores (T5's relative-position bias; T5
    also uses scale 1). keys: per-sample dropout keys (uint64, ``dropout.sample_keys``),
    site: this layer's dropout site, p: the probability (0: no dropout; keys then unused).
    """
    # out, q: (B, Tq, C); k, v: (B, Tk, C); att: (B, NH, Tq, Tk); keep: (B, Tk) float32;
    # scratch: (>= 4, max(Tq, Tk), hs); dprobs: (Tq, Tk)
    B, Tq, C = q.shape
    Tk = k.shape[1]
    hs = C // n_head
    if scratch.shape[0] < 4 or scratch.shape[1] < max(Tq, Tk) or scratch.shape[2] != hs:
        raise ValueError("attention scratch must have shape (>= 4, max(Tq, Tk), head_size)")
    if causal and Tq != Tk:
        raise ValueError("causal attention needs as many queries as keys")
    dscale = F32(1.0) / (F32(1.0) - p)
    zero = F32(0.0)
    one = F32(1.0)
    qs = scratch[0, :Tq]
    ks = scratch[1, :Tk]
    vs = scratch[2, :Tk]
    y = scratch[3, :Tq]
    for b in range(B):
        m = keep[b]
        for h in range(n_head):
            o = h * hs
            for t in range(Tq):
                for i in range(hs):
                    qs[t, i] = q[b, t, o + i] * scale
            for t in range(Tk):
                for i in range(hs):
                    ks[t, i] = k[b, t, o + i]
                    vs[t, i] = v[b, t, o + i]
            pr = att[b, h]
            np.dot(qs, ks.T, pr)
            for t in range(Tq):
                row = pr[t]
                n = t + 1 if causal else Tk
                if has_bias:
                    brow = bias[h, t]
                    for j in range(n):
                        row[j] += brow[j]
                for j in range(n):
                    if m[j] == zero:
                        row[j] = _NEG
                mx = row_max(row, n)
                for j in range(n):
                    row[j] = exp_f32(row[j] - mx)
                inv = one / row_sum(row, n)
                for j in range(n):
                    row[j] *= inv
                for j in range(n, Tk):
                    row[j] = zero
            if p > zero:
                kk = site_key(keys[b], site)
                _drop_probs(dprobs, pr, kk, h * Tq * Tk, p, dscale)
                np.dot(dprobs, vs, y)
            else:
                np.dot(pr, vs, y)
            for t in range(Tq):
                for i in range(hs):
                    out[b, t, o + i] = y[t, i]


@kernel
def mha_attend_backward(
    dq, dk, dv, dbias, dout, q, k, v, att, scratch, dscores, n_head, causal, keys, site, p,
    scale, has_bias,
):  # fmt: skip
    """dq, dk, dv (overwritten) from dout, the saved softmax and the forward's inputs; with
    ``has_bias`` the scores' gradient of every sample is ADDED to dbias (NH, Tq, Tk): the
    bias is shared by the batch (and, in T5, by the layers of a stack)."""
    # dq, dout, q: (B, Tq, C); dk, dv, k, v: (B, Tk, C); att: (B, NH, Tq, Tk);
    # scratch: (>= 7, max(Tq, Tk), hs); dscores: (Tq, Tk)
    B, Tq, C = q.shape
    Tk = k.shape[1]
    hs = C // n_head
    if scratch.shape[0] < 7 or scratch.shape[1] < max(Tq, Tk) or scratch.shape[2] != hs:
        raise ValueError("attention scratch must have shape (>= 7, max(Tq, Tk), head_size)")
    if dscores.shape[0] != Tq or dscores.shape[1] != Tk:
        raise ValueError("attention dscores must have shape (Tq, Tk)")
    dscale = F32(1.0) / (F32(1.0) - p)
    zero = F32(0.0)
    qs = scratch[0, :Tq]
    ks = scratch[1, :Tk]
    vs = scratch[2, :Tk]
    dy = scratch[3, :Tq]
    dqs = scratch[4, :Tq]
    dks = scratch[5, :Tk]
    dvs = scratch[6, :Tk]
    ds = dscores
    for b in range(B):
        for h in range(n_head):
            o = h * hs
            for t in range(Tq):
                for i in range(hs):
                    qs[t, i] = q[b, t, o + i] * scale
                    dy[t, i] = dout[b, t, o + i]
            for t in range(Tk):
                for i in range(hs):
                    ks[t, i] = k[b, t, o + i]
                    vs[t, i] = v[b, t, o + i]
            pr = att[b, h]
            if p > zero:
                kk = site_key(keys[b], site)
                _drop_probs(ds, pr, kk, h * Tq * Tk, p, dscale)  # the dropped probabilities
                np.dot(ds.T, dy, dvs)
                np.dot(dy, vs.T, ds)
                _drop_probs(ds, ds, kk, h * Tq * Tk, p, dscale)  # back through the mask
            else:
                np.dot(pr.T, dy, dvs)
                np.dot(dy, vs.T, ds)
            for t in range(Tq):
                prow = pr[t]
                drow = ds[t]
                n = t + 1 if causal else Tk
                s = row_dot(prow, drow, n)
                for j in range(n):
                    drow[j] = prow[j] * (drow[j] - s)
                for j in range(n, Tk):
                    drow[j] = zero
                if has_bias:
                    brow = dbias[h, t]
                    for j in range(n):
                        brow[j] += drow[j]
            np.dot(ds, ks, dqs)
            np.dot(ds.T, qs, dks)
            for t in range(Tq):
                for i in range(hs):
                    dq[b, t, o + i] = dqs[t, i] * scale
            for t in range(Tk):
                for i in range(hs):
                    dk[b, t, o + i] = dks[t, i]
                    dv[b, t, o + i] = dvs[t, i]


@kernel
def mha_forward(out, att, q, k, v, keep, scratch, dprobs, n_head, causal, keys, site, p):
    """Self-attention with scale 1/sqrt(hs) and no bias (BERT, AIAYN): ``mha_attend_forward``
    with q, k, v of one sequence. att[0] stands in for the unused bias (a view, no copy)."""
    # out, q, k, v: (B, T, C); att: (B, NH, T, T); keep: (B, T) float32;
    # scratch: (>= 4, T, hs); dprobs: (T, T)
    scale = F32(1.0) / np.sqrt(F32(q.shape[2] // n_head))
    mha_attend_forward(
        out, att, q, k, v, keep, scratch, dprobs, n_head, causal, keys, site, p, scale,
        att[0], False,
    )  # fmt: skip


@kernel
def mha_backward(dq, dk, dv, dout, q, k, v, att, scratch, dscores, n_head, causal, keys, site, p):
    """dq, dk, dv (overwritten) of ``mha_forward``."""
    # dq, dk, dv, dout, q, k, v: (B, T, C); att: (B, NH, T, T); scratch: (7, T, hs);
    # dscores: (T, T)
    scale = F32(1.0) / np.sqrt(F32(q.shape[2] // n_head))
    mha_attend_backward(
        dq, dk, dv, att[0], dout, q, k, v, att, scratch, dscores, n_head, causal, keys, site,
        p, scale, False,
    )  # fmt: skip


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
    # with a bias (T5) and cross-attention shapes: 1 query over 2 keys
    bias = np.zeros((NH, 1, T), dtype=np.float32)
    att1 = np.zeros((B, NH, 1, T), dtype=np.float32)
    q1 = q3[:, :1].copy()
    mha_attend_forward(
        q1.copy(), att1, q1, q3, q3, keep, scratch, dscores[:1].copy(), NH, False, keys, 0,
        F32(0.1), F32(1.0), bias, True,
    )  # fmt: skip
    mha_attend_backward(
        q1.copy(), q3.copy(), q3.copy(), bias, q1, q1, q3, q3, att1, scratch,
        dscores[:1].copy(), NH, False, keys, 0, F32(0.1), F32(1.0), True,
    )  # fmt: skip
    # the helper too, so its Python-visible dispatcher carries a signature (a caller loaded
    # from the cache never compiles it)
    _drop_probs(dscores, dscores.copy(), np.uint64(1), 0, F32(0.1), F32(1.0 / 0.9))
