"""GPT-2's numba kernels against float64 NumPy references and central finite differences.

Forward: the float32 kernel on float32 inputs vs the float64 reference on the same values.
Backward: the float32 analytic gradient vs central differences of the float64 reference
of L = sum(forward(x) * G) for a random G, over EVERY coordinate (shapes are small), so a
single wrong element fails. Error measure everywhere: max|a - b| / max|b| per tensor.

Tolerances (float32 against float64 truth): forward outputs and saved statistics 1e-6,
gradients 2e-6. Measured worst: 1.4e-7 everywhere except GELU's gradient, 5.3e-7 (its
rational tanh is within 3.4e-7 of tanh).
Shapes are odd on purpose: T = 7, C = 13 or 12 (tails of the 8-wide unrolled sums),
n_head = 3, tokens repeating (embedding scatter-add collisions).
"""

import math

import numpy as np
import pytest
from kernel_checks import central_fd, float64_ops, nrt_allocations
from numba.core.dispatcher import Dispatcher
from simdist.kernels import attention, embedding, gelu, layernorm, matmul, residual, rowops
from simdist.kernels.linear import (
    linear_backward,
    linear_forward,
    linear_gelu_backward,
    linear_gelu_forward,
)

from simdist.arena import Layout
from simdist.models.base import GradientViews
from simdist.models.gpt2 import GPT2, PRESETS, num_parameters, resolve_config

F32 = np.float32
FWD_TOL = 1e-6
GRAD_TOL = 2e-6


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b| over the whole tensor."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def fd_grad(f, args: list[np.ndarray], which: int, G: np.ndarray) -> np.ndarray:
    """Central differences of sum(f(*args) * G) w.r.t. every element of args[which]."""
    args = [np.array(a, dtype=np.float64) for a in args]

    def loss(x: np.ndarray) -> float:
        return float(np.sum(f(*args[:which], x, *args[which + 1 :]) * G))

    return central_fd(loss, args[which])


# ----------------------------------------------------------------------- references
def ref_layernorm(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5) * w + b


def ref_gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def ref_attention(qkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    q, k, v = (qkv[..., i * C : (i + 1) * C].reshape(B, T, n_head, hs) for i in range(3))
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # (B, NH, T, hs)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(B, T, C), p


# ----------------------------------------------------------------------- kernels
def test_tanh_f32_accuracy():
    x = np.concatenate([np.linspace(-12, 12, 200001), np.logspace(-8, 1, 2001)]).astype(F32)
    got = np.array([gelu.tanh_f32(v) for v in x[::97]], dtype=np.float64)
    assert np.max(np.abs(got - np.tanh(x[::97].astype(np.float64)))) < 4e-7
    assert gelu.tanh_f32(F32(-x[5])) == -gelu.tanh_f32(F32(x[5]))  # odd


def test_exp_f32_accuracy():
    x = np.concatenate([np.linspace(-87.3, 88.0, 400001), np.linspace(-1, 1, 10001)])
    x = x.astype(F32)
    got = np.array([rowops.exp_f32(v) for v in x[::7]], dtype=np.float64)
    want = np.exp(x[::7].astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2.5e-7  # 2 ulp: float32 ulp/2 is 6e-8
    assert rowops.exp_f32(F32(-87.4)) == 0 and rowops.exp_f32(F32(-np.inf)) == 0
    assert rowops.exp_f32(F32(0.0)) == 1
    assert np.isnan(rowops.exp_f32(F32(np.nan)))


@pytest.mark.parametrize("n", [1, 7, 8, 13, 64])
def test_row_reductions(n):
    rng = np.random.default_rng(n)
    a, b, x = (rng.standard_normal(n + 3).astype(F32) for _ in range(3))  # tail ignored
    a64, b64, x64 = (v[:n].astype(np.float64) for v in (a, b, x))
    m = F32(0.3)
    assert rowops.row_sum(a, n) == pytest.approx(a64.sum(), abs=1e-5)
    assert rowops.row_max(a, n) == a64.max()
    assert rowops.row_dot(a, b, n) == pytest.approx(a64 @ b64, abs=1e-5)
    assert rowops.row_dot_dev(a, b, x, m, n) == pytest.approx(a64 @ (b64 * (x64 - 0.3)), abs=1e-5)
    assert rowops.row_sq_dev(a, m, n) == pytest.approx(((a64 - 0.3) ** 2).sum(), abs=1e-5)


def test_embedding_forward_backward():
    rng = np.random.default_rng(0)
    B, T, C, V, maxT = 3, 7, 13, 11, 9
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, :3] = 4  # repeated tokens: their gradients must add up, not overwrite
    wte = rng.standard_normal((V, C)).astype(F32)
    wpe = rng.standard_normal((maxT, C)).astype(F32)
    out = np.empty((B, T, C), F32)
    embedding.embedding_forward(out, tokens, wte, wpe)
    ref = wte.astype(np.float64)[tokens] + wpe.astype(np.float64)[:T]
    assert rel_err(out, ref) < FWD_TOL

    G = rng.standard_normal((B, T, C))
    dwte0 = rng.standard_normal((V, C)).astype(F32)  # what the tied LM head left there
    dwpe0 = rng.standard_normal((maxT, C)).astype(F32)
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    embedding.embedding_backward_accumulate(dwte, dwpe, G.astype(F32), tokens)

    def f(wte_, wpe_):
        return wte_[tokens] + wpe_[:T]

    fd_wte = fd_grad(f, [wte, wpe], 0, G)
    fd_wpe = fd_grad(f, [wte, wpe], 1, G)
    assert rel_err(dwte - dwte0, fd_wte) < GRAD_TOL
    assert rel_err(dwpe - dwpe0, fd_wpe) < GRAD_TOL
    assert np.array_equal(dwpe[T:], dwpe0[T:])  # positions past T untouched


@pytest.mark.parametrize("N,C", [(7, 13), (5, 32), (3, 1)])
def test_layernorm_forward_backward(N, C):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((N, C)) * 3 + 2).astype(F32)
    w = rng.standard_normal(C).astype(F32)
    b = rng.standard_normal(C).astype(F32)
    out = np.empty((N, C), F32)
    mean = np.empty(N, F32)
    rstd = np.empty(N, F32)
    layernorm.layernorm_forward(out, mean, rstd, x, w, b)
    x64 = x.astype(np.float64)
    assert rel_err(out, ref_layernorm(x64, w, b)) < FWD_TOL
    assert rel_err(mean, x64.mean(-1)) < FWD_TOL
    assert rel_err(rstd, 1 / np.sqrt(x64.var(-1) + 1e-5)) < FWD_TOL
    if C == 1:
        return  # the output is the bias; gradients w.r.t. x vanish, nothing to compare

    G = rng.standard_normal((N, C))
    dx = np.full((N, C), np.nan, F32)  # overwritten, so NaN must not survive
    dw = np.full(C, np.nan, F32)
    db = np.full(C, np.nan, F32)
    layernorm.layernorm_backward(dx, dw, db, G.astype(F32), x, w, mean, rstd)
    for i, got in enumerate((dx, dw, db)):
        assert rel_err(got, fd_grad(ref_layernorm, [x, w, b], i, G)) < GRAD_TOL, i

    resid = rng.standard_normal((N, C)).astype(F32)
    dx2 = resid.copy()
    dw2 = np.full(C, np.nan, F32)
    db2 = np.full(C, np.nan, F32)
    layernorm.layernorm_backward_accumulate(dx2, dw2, db2, G.astype(F32), x, w, mean, rstd)
    assert np.allclose(dx2 - resid, dx, rtol=0, atol=1e-6 * np.abs(resid).max())
    assert np.array_equal(dw2, dw) and np.array_equal(db2, db)


def test_residual_layernorm_forward():
    rng = np.random.default_rng(11)
    N, C = 6, 13
    a = rng.standard_normal((N, C)).astype(F32)
    b = rng.standard_normal((N, C)).astype(F32)
    w = rng.standard_normal(C).astype(F32)
    bias = rng.standard_normal(C).astype(F32)
    res = b.copy()  # the residual sum overwrites the branch output, as in the model
    out = np.empty((N, C), F32)
    mean = np.empty(N, F32)
    rstd = np.empty(N, F32)
    layernorm.residual_layernorm_forward(res, out, mean, rstd, a, res, w, bias)
    s64 = a.astype(np.float64) + b
    assert np.array_equal(res, a + b)
    assert rel_err(out, ref_layernorm(s64, w, bias)) < FWD_TOL
    assert rel_err(mean, s64.mean(-1)) < FWD_TOL
    assert rel_err(rstd, 1 / np.sqrt(s64.var(-1) + 1e-5)) < FWD_TOL


def test_residual_layernorm_forward_gives_the_same_bits_in_place_over_either_input():
    """The sum may be written over either input (the kernel then adds the other one in
    place) or into its own array: every placement computes the same bits."""
    rng = np.random.default_rng(12)
    N, C = 5, 67  # not a multiple of the vector width: the loops' tails run too
    a = rng.standard_normal((N, C)).astype(F32)
    b = rng.standard_normal((N, C)).astype(F32)
    w = rng.standard_normal(C).astype(F32)
    bias = rng.standard_normal(C).astype(F32)
    results = []
    for place in ("own", "over a", "over b"):
        x, y = a.copy(), b.copy()
        res = {"own": np.empty_like(a), "over a": x, "over b": y}[place]
        out, mean, rstd = np.empty_like(a), np.empty(N, F32), np.empty(N, F32)
        layernorm.residual_layernorm_forward(res, out, mean, rstd, x, y, w, bias)
        results.append((res, out, mean, rstd))
    assert np.array_equal(results[0][0], a + b)
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            assert np.array_equal(got, want)


def test_gelu_forward_backward():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(37) * 3, [-12.0, -5.0, 0.0, 5.0, 12.0]]).astype(F32)
    out = np.empty_like(x)
    gelu.gelu_forward(out, x)
    assert rel_err(out, ref_gelu(x.astype(np.float64))) < FWD_TOL
    G = rng.standard_normal(x.shape)
    dx = np.empty_like(x)
    gelu.gelu_backward(dx, x, G.astype(F32))
    assert rel_err(dx, fd_grad(ref_gelu, [x], 0, G)) < GRAD_TOL
    inplace = G.astype(F32)
    gelu.gelu_backward(inplace, x, inplace)  # dinp aliasing dout is allowed
    assert np.array_equal(inplace, dx)


@pytest.mark.parametrize("B,C,OC", [(64, 32, 16), (37, 100, 24), (256, 1024, 256)])
def test_linear_gelu_backward_is_linear_then_gelu_backward(B, C, OC):
    """The fused MLP backward gives the bits of linear_backward into a GELU-output gradient
    buffer, then gelu_backward: input gradient, weight and bias gradients."""
    rng = np.random.default_rng(B + C)
    pre = (rng.standard_normal((B, C)) * 2).astype(F32)  # the GELU's input
    act = np.empty_like(pre)
    gelu.gelu_forward(act.reshape(-1), pre.reshape(-1))
    weight = (rng.standard_normal((C, OC)) / math.sqrt(C)).astype(F32)
    dout = rng.standard_normal((B, OC)).astype(F32)
    dact, want = np.empty_like(pre), np.empty_like(pre)
    dw, db = np.empty_like(weight), np.empty(OC, F32)
    linear_backward(dact, dw, db, dout, act, weight)
    gelu.gelu_backward(want.reshape(-1), pre.reshape(-1), dact.reshape(-1))
    got = np.full_like(pre, np.nan)
    dw2, db2 = np.full_like(dw, np.nan), np.full_like(db, np.nan)
    linear_gelu_backward(got, dw2, db2, dout, act, weight, pre)
    assert np.array_equal(got, want) and np.array_equal(dw2, dw) and np.array_equal(db2, db)
    assert not np.array_equal(got, dact)  # the GELU factor was applied
    assert nrt_allocations(linear_gelu_backward, got, dw2, db2, dout, act, weight, pre) == 0


@pytest.mark.parametrize("B,C,OC", [(64, 32, 16), (37, 100, 24), (256, 256, 1024)])
def test_linear_gelu_forward_is_linear_then_gelu_forward(B, C, OC):
    """The fused c_fc + GELU forward gives the bits of linear_forward, then gelu_forward
    on its output: the pre-activation (kept for backward) and the activation."""
    rng = np.random.default_rng(B * C)
    inp = rng.standard_normal((B, C)).astype(F32)
    weight = (rng.standard_normal((C, OC)) * 2 / math.sqrt(C)).astype(F32)
    bias = rng.standard_normal(OC).astype(F32)
    pre, act = np.empty((B, OC), F32), np.empty((B, OC), F32)
    linear_forward(pre, inp, weight, bias)
    gelu.gelu_forward(act.reshape(-1), pre.reshape(-1))
    got_pre, got_act = np.full_like(pre, np.nan), np.full_like(act, np.nan)
    linear_gelu_forward(got_act, got_pre, inp, weight, bias)
    assert np.array_equal(got_pre, pre) and np.array_equal(got_act, act)
    assert not np.array_equal(got_act, got_pre)  # the GELU was applied
    assert nrt_allocations(linear_gelu_forward, got_act, got_pre, inp, weight, bias) == 0


def test_residual_forward():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(29).astype(F32)
    b = rng.standard_normal(29).astype(F32)
    out = np.empty_like(a)
    residual.residual_forward(out, a, b)
    assert np.array_equal(out, a + b)
    residual.residual_forward(b, a, b)  # in place
    assert np.array_equal(b, out)


def test_lm_head_forward_backward():
    rng = np.random.default_rng(4)
    N, C, V = 7, 13, 11
    x = rng.standard_normal((N, C)).astype(F32)
    wte = rng.standard_normal((V, C)).astype(F32)
    logits = np.empty((N, V), F32)
    matmul.lm_head_forward(logits, x, wte)
    assert rel_err(logits, x.astype(np.float64) @ wte.astype(np.float64).T) < FWD_TOL
    G = rng.standard_normal((N, V))
    dx = np.full((N, C), np.nan, F32)
    dwte = np.full((V, C), np.nan, F32)
    matmul.lm_head_backward(dx, dwte, G.astype(F32), x, wte)

    def f(x_, w_):
        return x_ @ w_.T

    assert rel_err(dx, fd_grad(f, [x, wte], 0, G)) < GRAD_TOL
    assert rel_err(dwte, fd_grad(f, [x, wte], 1, G)) < GRAD_TOL


def attention_checked(qkv, n_head, G):
    """attention_forward on NaN-filled buffers, checked against the float64 reference, then
    attention_backward of G (NaN scratch: any read of dscores or of a block the products
    leave unwritten before it is written poisons the result); returns (dqkv, probs)."""
    B, T, C3 = qkv.shape
    out = np.full((B, T, C3 // 3), np.nan, F32)
    att = np.full((B, n_head, T, T), np.nan, F32)
    attention.attention_forward(out, att, qkv, n_head)
    ref_out, ref_p = ref_attention(qkv.astype(np.float64), n_head)
    assert rel_err(out, ref_out) < FWD_TOL
    assert rel_err(att, ref_p) < FWD_TOL
    assert np.all(att[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)
    dqkv = np.full_like(qkv, np.nan)
    dscores = np.full((T, T), np.nan, F32)
    attention.attention_backward(dqkv, G.astype(F32), qkv, att, dscores, n_head)
    return dqkv, ref_p


@pytest.mark.parametrize("B,T,n_head,hs", [(2, 7, 3, 4), (1, 5, 1, 8), (2, 1, 2, 3)])
def test_attention_forward_backward(B, T, n_head, hs):
    rng = np.random.default_rng(5)
    C = n_head * hs
    qkv = rng.standard_normal((B, T, 3 * C)).astype(F32)
    G = rng.standard_normal((B, T, C))
    dqkv, _ = attention_checked(qkv, n_head, G)
    fd = fd_grad(lambda a: ref_attention(a, n_head)[0], [qkv], 0, G)
    assert rel_err(dqkv, fd) < GRAD_TOL


def ref_attention_backward(qkv, p, G, n_head):
    """float64 dqkv from the probabilities p: the analytic softmax backward (the small
    cases above check the kernel itself against central differences)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head

    def heads(a):
        return a.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)

    q, k, v = (heads(qkv[..., i * C : (i + 1) * C]) for i in range(3))
    dy = heads(G)
    dp = dy @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) / np.sqrt(hs)
    grads = (ds @ k, ds.transpose(0, 1, 3, 2) @ q, p.transpose(0, 1, 3, 2) @ dy)
    return np.concatenate([g.transpose(0, 2, 1, 3).reshape(B, T, C) for g in grads], -1)


def test_causal_attention_in_blocks_matches_float64():
    """T = 200: three 64-row blocks and a partial one, so every product skips the blocks
    above the diagonal (``CAUSAL_BLOCK``), tails included."""
    B, T, n_head, hs = 2, 200, 2, 16
    blk = attention.CAUSAL_BLOCK
    assert T >= 2 * blk and T % blk  # the blocked path, with a partial last block
    rng = np.random.default_rng(8)
    C = n_head * hs
    qkv = rng.standard_normal((B, T, 3 * C)).astype(F32)
    G = rng.standard_normal((B, T, C))
    dqkv, probs = attention_checked(qkv, n_head, G)
    ref = ref_attention_backward(qkv.astype(np.float64), probs, G, n_head)
    assert rel_err(dqkv, ref) < GRAD_TOL


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_causal_attention_in_blocks_in_mixed_precision(fmt):
    """The blocked products with the probabilities and score gradients rounded to a half
    format where they enter a product (T = 200, the float32 BLAS on half operands, every
    operand checked to hold half values). Against the float32 kernel on the same inputs:
    within the rounding of P and dS (measured 1.6e-3 in bf16, 3.2e-4 in fp16), while a
    wrong block bound gives an O(1) error."""
    from simdist.kernels import blas
    from simdist.kernels.half import BF16, F16, round_half

    half = {"bf16": BF16, "fp16": F16}[fmt]
    B, T, n_head, hs = 1, 200, 2, 16
    rng = np.random.default_rng(9)
    C = n_head * hs
    qkv = rng.standard_normal((B, T, 3 * C)).astype(F32)
    G = rng.standard_normal((B, T, C)).astype(F32)
    round_half(qkv.reshape(-1), half)  # products take half values only
    round_half(G.reshape(-1), half)
    want_dqkv, _ = attention_checked(qkv, n_head, G)
    want_out = ref_attention(qkv.astype(np.float64), n_head)[0]
    out = np.full((B, T, C), np.nan, F32)
    att = np.full((B, n_head, T, T), np.nan, F32)
    dqkv = np.full_like(qkv, np.nan)
    blas.half_operands(half, native=False)
    try:
        attention.attention_forward(out, att, qkv, n_head)
        attention.attention_backward(dqkv, G, qkv, att, np.full((T, T), np.nan, F32), n_head)
    finally:
        blas.half_operands(None)
    tol = 2.0**-6 if fmt == "bf16" else 2.0**-9  # a few roundings of 2**-9 (bf16), 2**-12
    assert rel_err(out, want_out) < tol
    assert rel_err(dqkv, want_dqkv) < tol


def test_attention_rejects_wrong_buffers():
    qkv = np.zeros((1, 4, 12), F32)  # T = 4, C = 4, n_head = 2, hs = 2
    out, att = np.zeros((1, 4, 4), F32), np.zeros((1, 2, 4, 4), F32)
    with pytest.raises(ValueError, match="shapes"):
        attention.attention_forward(out, np.zeros((1, 2, 4, 3), F32), qkv, 2)
    with pytest.raises(ValueError, match="shapes"):
        attention.attention_forward(np.zeros((1, 4, 5), F32), att, qkv, 2)
    with pytest.raises(ValueError, match="dscores"):
        attention.attention_backward(qkv.copy(), out, qkv, att, np.zeros((4, 3), F32), 2)
    with pytest.raises(ValueError, match="shapes"):
        attention.attention_backward(qkv[:, :, :9].copy(), out, qkv, att, np.zeros((4, 4), F32), 2)


# ------------------------------------------------- float32 discipline and allocation
MODULES = (attention, embedding, gelu, layernorm, matmul, residual, rowops)


def _dispatchers():
    for mod in MODULES:
        mod._warm()  # compiles the production signatures, helpers included
        for name, obj in vars(mod).items():
            if isinstance(obj, Dispatcher) and obj.py_func.__module__ == mod.__name__:
                yield f"{mod.__name__}.{name}", obj


def test_no_float64_arithmetic():
    leaks = {}
    for name, disp in _dispatchers():
        for sig, lines in float64_ops(disp).items():
            if lines:
                leaks[f"{name}{sig}"] = lines[:3]
    assert not leaks, leaks


def test_kernels_do_not_allocate():
    rng = np.random.default_rng(6)
    B, T, NH, hs, V = 2, 9, 3, 8, 17
    C = NH * hs
    N = B * T

    def f(*shape):
        return rng.standard_normal(shape).astype(F32)

    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    x, y, w, b = f(B, T, C), f(B, T, C), f(C), f(C)
    mean, rstd = f(N), f(N)
    qkv, dqkv, att = f(B, T, 3 * C), f(B, T, 3 * C), f(B, NH, T, T)
    dscores = f(T, T)
    wte, wpe, logits = f(V, C), f(T, C), f(N, V)
    x2, y2 = x.reshape(N, C), y.reshape(N, C)
    calls = [
        (embedding.embedding_forward, (x, tokens, wte, wpe)),
        (embedding.embedding_backward_accumulate, (wte, wpe, y, tokens)),
        (layernorm.layernorm_forward, (y2, mean, rstd, x2, w, b)),
        (layernorm.residual_layernorm_forward, (y2, x2.copy(), mean, rstd, x2, y2, w, b)),
        (layernorm.layernorm_backward, (y2, w.copy(), b.copy(), x2, x2.copy(), w, mean, rstd)),
        (
            layernorm.layernorm_backward_accumulate,
            (y2, w.copy(), b.copy(), x2, x2.copy(), w, mean, rstd),
        ),
        (gelu.gelu_forward, (y.reshape(-1), x.reshape(-1))),
        (gelu.gelu_backward, (y.reshape(-1), x.reshape(-1), y.reshape(-1))),
        (residual.residual_forward, (y.reshape(-1), x.reshape(-1), y.reshape(-1))),
        (matmul.lm_head_forward, (logits, x2, wte)),
        (matmul.lm_head_backward, (y2, wte.copy(), logits, x2, wte)),
        (attention.attention_forward, (x, att, qkv, NH)),
        (attention.attention_backward, (dqkv, x, qkv, att, dscores, NH)),
    ]
    counts = {fn.__name__: nrt_allocations(fn, *args) for fn, args in calls}
    assert all(n == 0 for n in counts.values()), counts


# ------------------------------------------------- the model, checks that need no PyTorch
# (loss and gradients against PyTorch: tests/test_gpt2_parity.py)
def _mini_model(B: int, seed: int = 0):
    cfg = resolve_config("gpt2-mini", n_layer=2)
    model = GPT2(cfg)
    layout = Layout(model.parameter_specs(), world=1)
    params = layout.views(np.zeros(layout.padded, F32))
    grads = GradientViews(layout.views(np.zeros(layout.padded, F32)))
    model.init_parameters(params, np.random.default_rng(seed))
    model.allocate(B)
    return cfg, model, params, grads


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="n_embd"):
        resolve_config("gpt2-mini", n_embd=250)
    with pytest.raises(ValueError, match="preset"):
        resolve_config("gpt3")
    with pytest.raises(ValueError, match="n_layer"):
        resolve_config(None, n_head=2)
    assert resolve_config("gpt2-mini", n_layer=2).n_layer == 2


def test_sizes_without_allocating():
    assert num_parameters(PRESETS["gpt2"]) == 124_439_808
    for name, cfg in PRESETS.items():
        specs = GPT2(cfg).parameter_specs()
        assert sum(s.numel for s in specs) == num_parameters(cfg), name
    mini = GPT2(PRESETS["gpt2-mini"])
    mini.allocate(3)
    assert mini._arena.nbytes == mini.activation_bytes(3)
    # flops: 6 N T-ish plus attention, e.g. 2.67 GFLOP per gpt2-mini sequence
    assert math.isclose(
        mini.flops_per_sample(), 128 * (72 * 256**2 * 4 + 12 * 128 * 256 * 4 + 6 * 256 * 256)
    )


def test_evaluate_sums_token_losses_in_chunks():
    cfg, model, params, _ = _mini_model(B=2)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, cfg.vocab_size, (5, 33)).astype(np.int32)  # 5 > allocated 2
    targets = tokens.copy()
    targets[:, :-1] = tokens[:, 1:]
    loss_sum, correct = model.evaluate(params, tokens, targets)
    want_loss, want_correct = 0.0, 0
    for b in range(5):  # one sequence at a time through forward
        mean = model.forward(params, tokens[b : b + 1], targets[b : b + 1])
        want_loss += mean * 33
        logits = model._views_for(1, 33).logits
        want_correct += int((logits.argmax(1) == targets[b]).sum())
    assert loss_sum == pytest.approx(want_loss, rel=1e-6)
    assert correct == want_correct


def test_model_rejects_bad_batches():
    cfg, model, params, grads = _mini_model(B=2)
    ok = np.zeros((2, 8), np.int32)
    with pytest.raises(RuntimeError, match="forward"):
        model.backward(params, grads, 0.5)
    with pytest.raises(ValueError, match="tokens"):
        model.forward(params, ok + cfg.vocab_size, ok)
    with pytest.raises(ValueError, match="targets"):
        model.forward(params, ok, ok - 1)
    with pytest.raises(ValueError, match="block_size"):
        model.forward(params, np.zeros((2, 129), np.int32), np.zeros((2, 129), np.int32))
    with pytest.raises(ValueError, match="allocate"):
        model.forward(params, np.zeros((3, 8), np.int32), np.zeros((3, 8), np.int32))
