"""Multi-head attention, one copy for every model: GPT-2 (causal, fused qkv), BERT (key
padding), the AIAYN Transformer and T5 (cross-attention, relative-position bias).

The math lives in two per-(sample, head) kernels, ``_head_forward`` / ``_head_backward``;
the public entry points only loop over samples and heads and cut the head's views:

- ``attention_forward`` / ``attention_backward`` (GPT-2): q, k, v are column blocks of the
  fused qkv (B, T, 3C) (Hugging Face's c_attn layout), causal, no mask, no dropout.
- ``mha_attend_forward`` / ``mha_attend_backward``: separate q (B, Tq, C) and k, v (B, Tk, C)
  (nn.Linear projections), bidirectional or causal, a per-sample key-padding mask, an
  optional shared score bias (T5), attention-probability dropout with the counter-based
  masks of ``dropout.py``; ``mha_forward`` / ``mha_backward`` are its self-attention form
  with scale 1/sqrt(hs) (BERT, AIAYN).

Per head the products go through BLAS (``blas.gemm``), which reads the head's q, k, v
columns in place (row stride C, or 3C inside GPT-2's qkv) and writes the output and dq, dk,
dv straight into the head's columns: no gather or scatter pass, no copy. The score scale
is BLAS's alpha (exact for hs = 64, a power of 4). Scores are masked and normalised with a
max-subtracted softmax (``rowops.exp_f32``, which vectorises); the probabilities are saved
for backward. A causal head's products skip the blocks above the diagonal
(``CAUSAL_BLOCK``); the others are dense Tq x Tk.
Backward needs one caller-provided ``dscores`` of shape (Tq, Tk) (and, with dropout, the
forward one ``dprobs``).
"""

import numpy as np

from ._jit import kernel
from .blas import gemm, half_format
from .dropout import site_key, uniform_f32
from .half import BF16, round_bf16, round_f16_value
from .rowops import exp_f32, row_dot, row_max, row_sum

F32 = np.float32
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
def _round_rows(dst, src, fmt):
    """dst = src rounded to the half format ``fmt`` (mixed precision: what enters a product
    is a half value); dst may be src."""
    for t in range(src.shape[0]):
        s = src[t]
        d = dst[t]
        if fmt == BF16:
            for j in range(src.shape[1]):
                d[j] = round_bf16(s[j])
        else:
            for j in range(src.shape[1]):
                d[j] = round_f16_value(s[j])


# A causal head's products run in blocks of query (or key) rows: query block i sees only
# key blocks 0..i, so the blocks above the diagonal (zeros) are not multiplied. At 64 rows
# the six products of a head of 64 ran 1.20x, 1.40x, 1.68x and 2.01x faster than dense at
# 128, 256, 512 and 1024 positions on oneMKL (Xeon 6/207/2; 1.43-1.55x on OpenBLAS),
# 32- and 128-row blocks no faster (``scripts/bench_kernels.py --attention-blocks``). The
# skipped terms are exact zeros, so results agree to rounding (a shorter inner dimension may
# sum in another order). ``simdist.models.attention_costs`` prices the same blocks.
CAUSAL_BLOCK = 64


@kernel
def _causal_block(causal, T):
    """The row block of a causal (T, T) head's products; 0 (dense products) when it is not
    causal or too short to split."""
    return CAUSAL_BLOCK if causal and T >= 2 * CAUSAL_BLOCK else 0


@kernel
def _product_bt(a, b, c, h, alpha):
    """c = alpha a b^T for the (T, T) c of a causal head (blocks above the diagonal left
    unwritten when h > 0: the caller zeroes or ignores them)."""
    if h:
        T = c.shape[0]
        for i in range(0, T, h):
            e = min(i + h, T)
            gemm(a[i:e], b[:e].T, c[i:e, :e], alpha, F32(0.0))
    else:
        gemm(a, b.T, c, alpha, F32(0.0))


@kernel
def _product(p, b, c, h, alpha):
    """c = alpha p b, p (T, T) zero above the diagonal when h > 0: query block i of c takes
    keys of blocks 0..i."""
    if h:
        T = p.shape[0]
        for i in range(0, T, h):
            e = min(i + h, T)
            gemm(p[i:e, :e], b[:e], c[i:e], alpha, F32(0.0))
    else:
        gemm(p, b, c, alpha, F32(0.0))


@kernel
def _product_t(p, b, c, h, alpha):
    """c = alpha p^T b, p (T, T) zero above the diagonal when h > 0: key block j of c takes
    query rows from block j on."""
    if h:
        T = p.shape[0]
        for j in range(0, T, h):
            e = min(j + h, T)
            gemm(p[j:, j:e].T, b[j:], c[j:e], alpha, F32(0.0))
    else:
        gemm(p.T, b, c, alpha, F32(0.0))


@kernel
def _head_forward(
    y, pr, q, k, v, causal, keep, masked, bias, has_bias, scale, dprobs, key, base, p
):  # fmt: skip
    """One head of one sample: pr = softmax(mask(scale q k^T + bias)), y = drop(pr) v.

    q (Tq, hs), k, v (Tk, hs), y (Tq, hs): strided views (unit column stride); pr (Tq, Tk)
    saves the softmax. keep (Tk,), read only when ``masked``: keep[j] == 0 masks key j;
    ``causal`` also masks j > t. bias (Tq, Tk) is read only when ``has_bias``. With p > 0
    the probabilities go through dropout (site key ``key``, element offset ``base``) into
    dprobs before the product; pr keeps them undropped. In mixed precision the product
    takes them rounded (in dprobs: it must not be pr then).
    """
    Tq, Tk = pr.shape
    zero = F32(0.0)
    one = F32(1.0)
    h = _causal_block(causal, Tq)
    _product_bt(q, k, pr, h, scale)  # scaled scores (Tq, Tk); the loop below zeroes j > t
    for t in range(Tq):
        row = pr[t]
        n = t + 1 if causal else Tk  # causal: position t sees 0..t
        if has_bias:
            brow = bias[t]
            for j in range(n):
                row[j] += brow[j]
        if masked:
            for j in range(n):
                if keep[j] == zero:
                    row[j] = _NEG
        mx = row_max(row, n)
        for j in range(n):
            row[j] = exp_f32(row[j] - mx)
        inv = one / row_sum(row, n)
        for j in range(n):
            row[j] *= inv
        for j in range(n, Tk):
            row[j] = zero  # future positions: zero probability
    fmt = half_format()
    src = pr
    if p > zero:
        _drop_probs(dprobs, pr, key, base, p, one / (one - p))
        if fmt:
            _round_rows(dprobs, dprobs, fmt)
        src = dprobs
    elif fmt:
        _round_rows(dprobs, pr, fmt)
        src = dprobs
    _product(src, v, y, h, one)  # straight into the head's columns


@kernel
def _head_backward(dq, dk, dv, dy, q, k, v, pr, ds, causal, dbias, has_bias, scale, key, base, p):
    """dq, dk, dv (overwritten) of one head from dy and the saved softmax pr; with
    ``has_bias`` the scores' gradient is ADDED to dbias (Tq, Tk). ds: (Tq, Tk) scratch."""
    Tq, Tk = pr.shape
    zero = F32(0.0)
    one = F32(1.0)
    fmt = half_format()  # mixed precision: P and dS enter the products rounded
    h = _causal_block(causal, Tq)  # as in forward: the masked block is not multiplied
    if p > zero:
        dscale = one / (one - p)
        _drop_probs(ds, pr, key, base, p, dscale)  # the dropped probabilities
        if fmt:
            _round_rows(ds, ds, fmt)
        _product_t(ds, dy, dv, h, one)  # dV = drop(P)^T dY
        _product_bt(dy, v, ds, h, one)
        _drop_probs(ds, ds, key, base, p, dscale)  # back through the mask
    elif fmt:
        _round_rows(ds, pr, fmt)
        _product_t(ds, dy, dv, h, one)  # dV = P^T dY
        _product_bt(dy, v, ds, h, one)  # dP = dY V^T, (Tq, Tk)
    else:
        _product_bt(dy, v, ds, h, one)  # dP = dY V^T, (Tq, Tk)
        _product_t(pr, dy, dv, h, one)  # dV = P^T dY
    # softmax backward per row: dS = P * (dP - sum_j P dP); a causal row's j > t carry none
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
            brow = dbias[t]
            for j in range(n):
                brow[j] += drow[j]
    if fmt:
        _round_rows(ds, ds, fmt)
    # scores = scale * q k^T: dq = scale * dS K, dk = scale * dS^T q
    _product(ds, k, dq, h, scale)
    _product_t(ds, q, dk, h, scale)


@kernel
def attention_forward(out, att, qkv, n_head):
    """GPT-2: out = softmax(causal(q k^T / sqrt(hs))) v per head, q, k, v the column blocks
    of qkv; saves the probabilities in att."""
    # out: (B, T, C); att: (B, NH, T, T); qkv: (B, T, 3C)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    if out.shape != (B, T, C) or att.shape != (B, n_head, T, T) or hs * n_head != C:
        raise ValueError("attention shapes: out (B, T, C), att (B, n_head, T, T), qkv (B, T, 3C)")
    scale = F32(1.0) / np.sqrt(F32(hs))
    # mixed precision: the probabilities enter the product rounded, in a scratch
    rounded = np.empty((T, T), np.float32) if half_format() else att[0, 0]
    for b in range(B):
        x = qkv[b]  # (T, 3C)
        y = out[b]  # (T, C)
        for h in range(n_head):
            oq = h * hs
            pr = att[b, h]
            _head_forward(
                y[:, oq : oq + hs], pr, x[:, oq : oq + hs], x[:, C + oq : C + oq + hs],
                x[:, 2 * C + oq : 2 * C + oq + hs], True, pr[0], False, pr, False, scale,
                rounded, np.uint64(0), 0, F32(0.0),
            )  # fmt: skip


@kernel
def attention_backward(dqkv, dout, qkv, att, dscores, n_head):
    """GPT-2: dqkv (overwritten) from dout, the saved probabilities and qkv."""
    # dqkv, qkv: (B, T, 3C); dout: (B, T, C); att: (B, NH, T, T); dscores: (T, T)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    if dqkv.shape != qkv.shape or dout.shape != (B, T, C) or att.shape != (B, n_head, T, T):
        raise ValueError("attention shapes: dqkv (B, T, 3C), dout (B, T, C), att (B, n_head, T, T)")
    if dscores.shape[0] != T or dscores.shape[1] != T:
        raise ValueError("attention dscores must have shape (T, T)")
    scale = F32(1.0) / np.sqrt(F32(hs))
    for b in range(B):
        x = qkv[b]
        dx = dqkv[b]
        g = dout[b]
        for h in range(n_head):
            o = h * hs
            q, dq = x[:, o : o + hs], dx[:, o : o + hs]
            k, dk = x[:, C + o : C + o + hs], dx[:, C + o : C + o + hs]
            v, dv = x[:, 2 * C + o : 2 * C + o + hs], dx[:, 2 * C + o : 2 * C + o + hs]
            _head_backward(
                dq, dk, dv, g[:, o : o + hs], q, k, v, att[b, h], dscores, True, dscores,
                False, scale, np.uint64(0), 0, F32(0.0),
            )  # fmt: skip


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
    ``scratch`` is not read (the heads are multiplied in place); it stays in the signature
    for the callers that still pass one.
    """
    # out, q: (B, Tq, C); k, v: (B, Tk, C); att: (B, NH, Tq, Tk); keep: (B, Tk) float32;
    # dprobs: (Tq, Tk)
    B, Tq, C = q.shape
    Tk = k.shape[1]
    hs = C // n_head
    if causal and Tq != Tk:
        raise ValueError("causal attention needs as many queries as keys")
    if dprobs.shape[0] != Tq or dprobs.shape[1] != Tk:
        raise ValueError("attention dprobs must have shape (Tq, Tk)")
    for b in range(B):
        kk = site_key(keys[b], site) if p > F32(0.0) else np.uint64(0)
        for h in range(n_head):
            o = h * hs
            _head_forward(
                out[b, :, o : o + hs], att[b, h], q[b, :, o : o + hs], k[b, :, o : o + hs],
                v[b, :, o : o + hs], causal, keep[b], True, bias[h], has_bias, scale, dprobs,
                kk, h * Tq * Tk, p,
            )  # fmt: skip


@kernel
def mha_attend_backward(
    dq, dk, dv, dbias, dout, q, k, v, att, scratch, dscores, n_head, causal, keys, site, p,
    scale, has_bias,
):  # fmt: skip
    """dq, dk, dv (overwritten) from dout, the saved softmax and the forward's inputs; with
    ``has_bias`` the scores' gradient of every sample is ADDED to dbias (NH, Tq, Tk): the
    bias is shared by the batch (and, in T5, by the layers of a stack). ``scratch`` is not
    read."""
    # dq, dout, q: (B, Tq, C); dk, dv, k, v: (B, Tk, C); att: (B, NH, Tq, Tk);
    # dscores: (Tq, Tk)
    B, Tq, C = q.shape
    Tk = k.shape[1]
    hs = C // n_head
    if dscores.shape[0] != Tq or dscores.shape[1] != Tk:
        raise ValueError("attention dscores must have shape (Tq, Tk)")
    for b in range(B):
        kk = site_key(keys[b], site) if p > F32(0.0) else np.uint64(0)
        for h in range(n_head):
            o = h * hs
            _head_backward(
                dq[b, :, o : o + hs], dk[b, :, o : o + hs], dv[b, :, o : o + hs],
                dout[b, :, o : o + hs], q[b, :, o : o + hs], k[b, :, o : o + hs],
                v[b, :, o : o + hs], att[b, h], dscores, causal, dbias[h], has_bias, scale,
                kk, h * Tq * Tk, p,
            )  # fmt: skip


@kernel
def mha_forward(out, att, q, k, v, keep, scratch, dprobs, n_head, causal, keys, site, p):
    """Self-attention with scale 1/sqrt(hs) and no bias (BERT, AIAYN): ``mha_attend_forward``
    with q, k, v of one sequence. att[0] stands in for the unused bias (a view, no copy)."""
    # out, q, k, v: (B, T, C); att: (B, NH, T, T); keep: (B, T) float32; dprobs: (T, T)
    scale = F32(1.0) / np.sqrt(F32(q.shape[2] // n_head))
    mha_attend_forward(
        out, att, q, k, v, keep, scratch, dprobs, n_head, causal, keys, site, p, scale,
        att[0], False,
    )  # fmt: skip


@kernel
def mha_backward(dq, dk, dv, dout, q, k, v, att, scratch, dscores, n_head, causal, keys, site, p):
    """dq, dk, dv (overwritten) of ``mha_forward``."""
    # dq, dk, dv, dout, q, k, v: (B, T, C); att: (B, NH, T, T); dscores: (T, T)
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
    # the helpers too, so their Python-visible dispatchers carry a signature (a caller
    # loaded from the cache never compiles them)
    _drop_probs(dscores, dscores.copy(), np.uint64(1), 0, F32(0.1), F32(1.0 / 0.9))
    _round_rows(dscores, dscores.copy(), BF16)
    x, d, pr = qkv[0], qkv[0].copy(), att[0, 0]
    y, dy = out[0, :, :hs], out[0, :, :hs].copy()
    q, k, v = x[:, :hs], x[:, C : C + hs], x[:, 2 * C : 2 * C + hs]
    _head_forward(
        y, pr, q, k, v, True, keep[0], True, pr, False, F32(1.0), dscores, np.uint64(1), 0,
        F32(0.1),
    )  # fmt: skip
    _head_backward(
        d[:, :hs], d[:, C : C + hs], d[:, 2 * C : 2 * C + hs], dy, q, k, v, pr, dscores, True,
        dscores.copy(), False, F32(1.0), np.uint64(1), 0, F32(0.1),
    )  # fmt: skip
    _causal_block(True, T)
    _product_bt(q, k, pr, 0, F32(1.0))
    _product(pr, v, y, 0, F32(1.0))
    _product_t(pr, dy, d[:, :hs], 0, F32(1.0))
