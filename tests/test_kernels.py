"""Kernel tests: float64 references, finite differences, torch parity, float64/alloc contracts.

Tolerances are stated in units of EPS = float32 machine epsilon (2**-23 = 1.19e-7) times a
scale that the error can actually grow with (sums of |terms| for matrix products, the step
count for optimizers). Each is set a few times above the worst value measured on this
machine over several seeds (noted as "measured"), so a real arithmetic change fails them.
"""

import simdist  # noqa: F401  (pins one thread per rank before numpy/numba load)

# isort: split
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kernel_checks import (
    central_fd,
    directional_fd,
    float64_ops,
    fresh_python,
    max_ulp,
    mkl_installed,
    nrt_allocations,
    onednn_sgemm_installed,
)
from numba import njit
from simdist.kernels import blas, registry
from simdist.kernels import optim as optim_kernels
from simdist.kernels.activation import relu_backward, relu_forward
from simdist.kernels.blas import gemm
from simdist.kernels.half import BF16, F16, round_half
from simdist.kernels.linear import (
    linear_backward,
    linear_backward_params,
    linear_forward,
    linear_relu_backward,
    linear_relu_forward,
)
from simdist.kernels.loss import (
    mean_loss,
    softmax_cross_entropy_backward,
    softmax_cross_entropy_forward,
)
from simdist.kernels.optim import (
    LANES,
    adamw_update,
    adamw_update_segments,
    scale_inplace,
    sgd_update,
    sgd_update_segments,
    sum_of_squares,
)
from simdist.kernels.reduce import add_divide, add_divide_store

F32 = np.float32
EPS = float(np.finfo(F32).eps)

# (B, C, OC): degenerate, odd, and FC-MNIST's three layers at batch 128.
LINEAR_SHAPES = [(1, 1, 1), (3, 5, 7), (128, 784, 512), (128, 512, 512), (128, 512, 10)]


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(F32)


def scaled_err(got: np.ndarray, ref: np.ndarray, scale: np.ndarray) -> float:
    """max |got - ref| / scale, elementwise: for sums, scale = sum of |terms| (error bound)."""
    return float((np.abs(got.astype(np.float64) - ref) / scale).max())


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| (norm-wise)."""
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


# ---------------------------------------------------------------- float64 references


def linear_ref(inp, weight, bias):
    return inp @ weight + bias


def softmax_ce_ref(logits, targets):
    """float64 (losses[B], probs[B,V]) via log-sum-exp."""
    z = logits - logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    rows = np.arange(len(targets))
    return lse - z[rows, targets], np.exp(z - lse[:, None])


# ------------------------------------------------------------------------------ linear


def linear_case(rng, B, C, OC):
    inp = randn(rng, B, C)
    weight = randn(rng, C, OC, scale=C**-0.5)
    bias = randn(rng, OC)
    dout = randn(rng, B, OC)
    return inp, weight, bias, dout


@pytest.mark.parametrize("B,C,OC", LINEAR_SHAPES)
def test_linear_forward_matches_float64(B, C, OC):
    rng = np.random.default_rng(B * 1000 + C)
    inp, weight, bias, _ = linear_case(rng, B, C, OC)
    out = np.full((B, OC), np.nan, F32)  # NaN: any element not overwritten shows up
    linear_forward(out, inp, weight, bias)
    i64, w64, b64 = inp.astype(np.float64), weight.astype(np.float64), bias.astype(np.float64)
    scale = np.abs(i64) @ np.abs(w64) + np.abs(b64)
    # error / sum|terms| <= 8 EPS (measured <= 1.6 EPS at C = 784).
    assert scaled_err(out, linear_ref(i64, w64, b64), scale) <= 8 * EPS


@pytest.mark.parametrize("B,C,OC", LINEAR_SHAPES)
def test_linear_backward_matches_float64(B, C, OC):
    rng = np.random.default_rng(B * 1000 + C + 1)
    inp, weight, _, dout = linear_case(rng, B, C, OC)
    dinp = np.full_like(inp, np.nan)
    dweight = np.full_like(weight, np.nan)
    dbias = np.full(OC, np.nan, F32)
    linear_backward(dinp, dweight, dbias, dout, inp, weight)
    i64, w64, d64 = inp.astype(np.float64), weight.astype(np.float64), dout.astype(np.float64)
    # Same bound as forward: 8 EPS of the sum of |terms| (measured <= 2.3 EPS).
    assert scaled_err(dinp, d64 @ w64.T, np.abs(d64) @ np.abs(w64.T)) <= 8 * EPS
    assert scaled_err(dweight, i64.T @ d64, np.abs(i64.T) @ np.abs(d64)) <= 8 * EPS
    assert scaled_err(dbias, d64.sum(axis=0), np.abs(d64).sum(axis=0)) <= 8 * EPS
    # The first layer's variant must produce the very same parameter gradients.
    dw2, db2 = np.full_like(weight, np.nan), np.full(OC, np.nan, F32)
    linear_backward_params(dw2, db2, dout, inp)
    np.testing.assert_array_equal(dw2, dweight)
    np.testing.assert_array_equal(db2, dbias)


def test_linear_backward_central_differences():
    """Every gradient element at (B, C, OC) = (3, 5, 7) against FD of the float64 forward."""
    rng = np.random.default_rng(7)
    inp, weight, bias, dout = linear_case(rng, 3, 5, 7)
    dinp, dweight, dbias = np.empty_like(inp), np.empty_like(weight), np.empty_like(bias)
    linear_backward(dinp, dweight, dbias, dout, inp, weight)

    i64, w64, b64, d64 = (a.astype(np.float64) for a in (inp, weight, bias, dout))

    def loss(i, w, b):  # L = sum(out * dout), so dL/dout = dout
        return float((linear_ref(i, w, b) * d64).sum())

    # L is linear in each argument, so FD is exact up to ~1e-10 rounding; the float32
    # kernel is off by ~EPS * |terms|: 1e-5 norm-wise (measured <= 2e-7).
    assert rel_err(dinp, central_fd(lambda x: loss(x, w64, b64), i64.copy())) <= 1e-5
    assert rel_err(dweight, central_fd(lambda x: loss(i64, x, b64), w64.copy())) <= 1e-5
    assert rel_err(dbias, central_fd(lambda x: loss(i64, w64, x), b64.copy())) <= 1e-5


def test_linear_directional_derivative_production_shape():
    """One directional FD through (inp, weight, bias) at 128x784 @ 784x512 checks all grads."""
    B, C, OC = 128, 784, 512
    rng = np.random.default_rng(11)
    inp, weight, bias, dout = linear_case(rng, B, C, OC)
    dinp, dweight, dbias = np.empty_like(inp), np.empty_like(weight), np.empty_like(bias)
    linear_backward(dinp, dweight, dbias, dout, inp, weight)

    d64 = dout.astype(np.float64)
    sizes = [inp.size, weight.size, bias.size]
    x = np.concatenate([inp.ravel(), weight.ravel(), bias.ravel()]).astype(np.float64)
    direction = rng.standard_normal(x.size)

    def loss(flat):
        i, w, b = np.split(flat, np.cumsum(sizes)[:-1])
        return float((linear_ref(i.reshape(B, C), w.reshape(C, OC), b) * d64).sum())

    # L(x + t d) is quadratic in t, so central FD has no truncation error: h = 1e-3 keeps
    # rounding (~1e-16 |L| / h) far below the float32 gradient's own error.
    fd = directional_fd(loss, x, direction, h=1e-3)
    analytic = np.concatenate([dinp.ravel(), dweight.ravel(), dbias.ravel()]).astype(np.float64)
    dot = float(analytic @ direction)
    # Relative to sum |grad_i d_i| (what rounding errors scale with); measured ~1e-8.
    assert abs(dot - fd) <= 1e-6 * float(np.abs(analytic * direction).sum())


# -------------------------------------------------------------------------------- relu


def test_relu_forward_backward_exact():
    rng = np.random.default_rng(3)
    x = randn(rng, 37, 29)
    x[0, :4] = [0.0, -0.0, np.nan, np.inf]
    out = np.full_like(x, 7.0)
    relu_forward(out, x)
    expected = np.where(x <= 0, F32(0), x)  # keeps NaN, like torch.relu
    np.testing.assert_array_equal(out, expected)  # equal_nan: NaN must propagate

    dout = randn(rng, 37, 29)
    dinp = np.full_like(x, 7.0)
    relu_backward(dinp, dout, out)
    np.testing.assert_array_equal(dinp, np.where(out > 0, dout, F32(0)))

    # In place: out is inp, dinp is dout.
    x2, d2 = x.copy(), dout.copy()
    relu_forward(x2, x2)
    relu_backward(d2, d2, x2)
    np.testing.assert_array_equal(x2, out)
    np.testing.assert_array_equal(d2, dinp)


def test_relu_backward_central_differences():
    rng = np.random.default_rng(4)
    x = randn(rng, 6, 9)
    x[np.abs(x) < 1e-2] = F32(0.5)  # FD needs to stay away from the kink (h = 1e-6)
    dout = randn(rng, 6, 9)
    out, dinp = np.empty_like(x), np.empty_like(x)
    relu_forward(out, x)
    relu_backward(dinp, dout, out)
    fd = central_fd(lambda z: float((np.maximum(z, 0) * dout).sum()), x.astype(np.float64))
    # Piecewise linear: FD is exact up to ~1e-10 and the kernel copies dout exactly.
    np.testing.assert_allclose(dinp, fd, rtol=0, atol=1e-8)


def test_fused_linear_relu_is_bitwise_the_unfused_pair():
    """linear_relu_forward == linear_forward + relu_forward and linear_relu_backward ==
    linear_backward + relu_backward(dinp, dinp, inp), bit for bit (NaN, +-0 included)."""
    rng = np.random.default_rng(21)
    B, C, OC = 33, 40, 24
    inp, weight, bias, dout = linear_case(rng, B, C, OC)
    bias[:3] = [np.nan, -0.0, 0.0]
    out_ref, out = np.empty((B, OC), F32), np.full((B, OC), 7.0, F32)
    linear_forward(out_ref, inp, weight, bias)
    relu_forward(out_ref, out_ref)
    linear_relu_forward(out, inp, weight, bias)
    np.testing.assert_array_equal(out, out_ref)
    assert np.isnan(out[:, 0]).all()
    x = np.maximum(inp, 0)  # the backward's inp is a ReLU output: zeros where masked
    refs = [np.empty_like(x), np.empty_like(weight), np.empty_like(bias)]
    got = [np.full_like(a, 7.0) for a in refs]
    linear_backward(*refs, dout, x, weight)
    relu_backward(refs[0], refs[0], x)
    linear_relu_backward(*got, dout, x, weight)
    for a, b in zip(got, refs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (got[0][x <= 0] == 0).all() and (got[0][x > 0] != 0).any()


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_on_strided_and_transposed_views(ta, tb):
    """blas.gemm: column slices (row stride > columns) and .T views, alpha and beta,
    against float64; the rest of a strided destination is left alone."""
    rng = np.random.default_rng(22)
    m, k, n = 13, 9, 7
    big_a = randn(rng, k, 3 * m) if ta else randn(rng, m, 3 * k)
    a = big_a[:, m : 2 * m].T if ta else big_a[:, k : 2 * k]
    big_b = randn(rng, n, 2 * k) if tb else randn(rng, k, 2 * n)
    b = big_b[:, :k].T if tb else big_b[:, n:]
    big_c = randn(rng, m, 3 * n)
    before = big_c.copy()
    c = big_c[:, n : 2 * n]
    ref = 0.5 * (a.astype(np.float64) @ b.astype(np.float64)) + 2.0 * c.astype(np.float64)
    gemm(a, b, c, F32(0.5), F32(2.0))
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(big_c[:, :n], before[:, :n])
    np.testing.assert_array_equal(big_c[:, 2 * n :], before[:, 2 * n :])
    c.fill(np.nan)  # beta = 0 overwrites without reading (NaN * 0 would stay NaN)
    gemm(a, b, c, F32(1.0), F32(0.0))
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        gemm(a, b[:-1], c, F32(1.0), F32(0.0))


@pytest.mark.skipif(
    not blas._BASE_MODE.value & blas.SGEMM_ILP64, reason="numpy ships no OpenBLAS of its own"
)
def test_openblas_is_numpys_own_with_64_bit_integers():
    """SIMDIST_BLAS=openblas (the tests' choice) binds the OpenBLAS numpy's wheel ships
    (ILP64) where there is one: gemm then gives np.matmul's bits (the same library) on
    every layout, at sizes whose products overflow nothing; SciPy's, the bit off, is
    correct as well (against float64)."""
    rng = np.random.default_rng(5)
    assert blas.library().startswith("openblas") and "numpy's" in blas.library()
    for m, k, n in [(128, 784, 512), (37, 300, 129), (7, 5, 3)]:
        for ta in (0, 1):
            for tb in (0, 1):
                a0 = randn(rng, k, m) if ta else randn(rng, m, k)
                b0 = randn(rng, n, k) if tb else randn(rng, k, n)
                a, b = (a0.T if ta else a0), (b0.T if tb else b0)
                c = np.empty((m, n), F32)
                gemm(a, b, c, F32(1.0), F32(0.0))
                assert np.array_equal(c, a @ b), (m, k, n, ta, tb)
                mode = blas._MODE.value
                blas._MODE.value = mode & ~blas.SGEMM_ILP64
                try:
                    gemm(a, b, c, F32(1.0), F32(0.0))
                finally:
                    blas._MODE.value = mode
                ref = a.astype(np.float64) @ b.astype(np.float64)
                np.testing.assert_allclose(c, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_sgemm_pointer_is_the_one_numbas_route_finds():
    """kernels/blas.py loads scipy.linalg.cython_blas by itself (not importing scipy.linalg)
    for its sgemm pointer: in a fresh process, the very function the usual import of the
    module (scipy.linalg first, then numba's route) returns."""
    code = (
        "import sys\n"
        "from simdist.kernels import blas\n"
        "assert 'scipy.linalg' not in sys.modules\n"
        "mine = blas._scipy_sgemm()\n"
        "del sys.modules['scipy.linalg.cython_blas']\n"
        "import scipy.linalg.cython_blas\n"
        "from numba.extending import get_cython_function_address as address\n"
        "assert 'scipy.linalg' in sys.modules\n"
        "print(mine == address('scipy.linalg.cython_blas', 'sgemm'))\n"
    )
    assert fresh_python(code) == "True"


ONEDNN_SGEMM_CHECK = r"""
import numpy as np
from simdist.kernels import blas
from simdist.kernels.blas import gemm

F32 = np.float32
assert blas.BACKEND == "onednn" and blas.half_operands(None) == "fp32 onednn sgemm"
rng = np.random.default_rng(31)


def placed(x, off):  # x's values in a fresh buffer, off elements past its start
    buf = np.empty(x.size + 32, F32)
    y = buf[off : off + x.size].reshape(x.shape)
    y[...] = x
    return y


# both libraries: blas.on_onednn's rule from k, n and the op flags
for m, k, n in [(130, 200, 140), (7, 300, 129), (64, 63, 256), (96, 128, 64), (40, 64, 64)]:
    for ta in (0, 1):
        for tb in (0, 1):
            a0 = rng.standard_normal((k, m) if ta else (m, k), dtype=F32)
            b0 = rng.standard_normal((n, k) if tb else (k, n), dtype=F32)
            a, b = (a0.T if ta else a0), (b0.T if tb else b0)
            c0 = rng.standard_normal((m, n), dtype=F32)
            ref = 0.5 * (a.astype(np.float64) @ b) + 2.0 * c0
            c = c0.copy()
            gemm(a, b, c, F32(0.5), F32(2.0))
            bound = 4e-7 * k * (np.abs(a) @ np.abs(b)) + 1e-6 * np.abs(ref)
            assert (np.abs(c - ref) <= bound).all(), (m, k, n, ta, tb)
            for off in (1, 3, 8):  # the same values elsewhere in memory: the same bits
                a1, b1 = placed(a0, off), placed(b0, off + 5)
                c1 = placed(c0, off + 2)
                gemm(a1.T if ta else a1, b1.T if tb else b1, c1, F32(0.5), F32(2.0))
                assert np.array_equal(c1, c), ("address", m, k, n, ta, tb, off)
# another library ran where the rule says so (OpenBLAS sums FC-MNIST's first products in
# another order), and OpenBLAS where it does not: the bits of gemm with oneDNN's bit off
onednn_mode = blas._MODE.value
for ta in (0, 1):
    for tb in (0, 1):
        a0 = rng.standard_normal((784, 128) if ta else (128, 784), dtype=F32)
        b0 = rng.standard_normal((512, 784) if tb else (784, 512), dtype=F32)
        a, b = (a0.T if ta else a0), (b0.T if tb else b0)
        c, c_openblas = np.empty((128, 512), F32), np.empty((128, 512), F32)
        gemm(a, b, c, F32(1.0), F32(0.0))
        blas._MODE.value = onednn_mode & ~blas.SGEMM_DNNL
        gemm(a, b, c_openblas, F32(1.0), F32(0.0))
        blas._MODE.value = onednn_mode
        same = np.array_equal(c, c_openblas)
        assert same != blas.on_onednn(784, 512, bool(ta), bool(tb)), ("library", ta, tb)
# half operands (fp16 on float32 BLAS) keep the library; plain float32 after
assert "onednn sgemm on fp16" in blas.half_operands(blas.F16, native=False)
assert blas.half_operands(None) == "fp32 onednn sgemm" and blas._MODE.value == onednn_mode
print("ok")
"""


MKL_SGEMM_CHECK = r"""
import numpy as np
from simdist.kernels import blas
from simdist.kernels.blas import gemm

F32 = np.float32
assert blas.BACKEND == "mkl" and blas.half_operands(None) == "fp32 mkl sgemm"
assert blas.library() == "mkl + " + blas._openblas_library() + " below 16 columns"
assert [blas.on_openblas_narrow(n) for n in (1, 10, 15, 16, 64)] == [1, 1, 1, 0, 0]
mkl_mode = blas._MODE.value
rng = np.random.default_rng(37)


def placed(x, off):  # x's values in a fresh buffer, off elements past its start
    buf = np.empty(x.size + 32, F32)
    y = buf[off : off + x.size].reshape(x.shape)
    y[...] = x
    return y


def product(m, k, n, ta, tb):
    a0 = rng.standard_normal((k, m) if ta else (m, k), dtype=F32)
    b0 = rng.standard_normal((n, k) if tb else (k, n), dtype=F32)
    return a0, b0, (a0.T if ta else a0), (b0.T if tb else b0)


mkl_differs = {True: 0, False: 0}  # narrow?: products whose oneMKL bits are not numpy's
for m, k, n in [(128, 512, 10), (512, 128, 10), (128, 10, 512), (64, 300, 15), (7, 5, 3),
                (128, 512, 16), (37, 300, 129), (96, 1024, 129)]:
    narrow = n < 16
    for ta in (0, 1):
        for tb in (0, 1):
            a0, b0, a, b = product(m, k, n, ta, tb)
            c = np.empty((m, n), F32)
            gemm(a, b, c, F32(1.0), F32(0.0))
            # numpy's OpenBLAS below 16 columns: np.matmul's bits (the same library)
            if narrow:
                assert np.array_equal(c, a @ b), ("narrow", m, k, n, ta, tb)
            blas._MODE.value = mkl_mode & ~blas.SGEMM_NARROW  # oneMKL for every shape
            c_mkl = np.empty((m, n), F32)
            gemm(a, b, c_mkl, F32(1.0), F32(0.0))
            blas._MODE.value = mkl_mode
            mkl_differs[narrow] += not np.array_equal(c_mkl, a @ b)
            if not narrow:
                assert np.array_equal(c, c_mkl), ("wide", m, k, n, ta, tb)
            # alpha and beta, against float64; the same values elsewhere: the same bits
            c0 = rng.standard_normal((m, n), dtype=F32)
            ref = 0.5 * (a.astype(np.float64) @ b) + 2.0 * c0
            c = c0.copy()
            gemm(a, b, c, F32(0.5), F32(2.0))
            bound = 4e-7 * k * (np.abs(a) @ np.abs(b)) + 1e-6 * np.abs(ref)
            assert (np.abs(c - ref) <= bound).all(), (m, k, n, ta, tb)
            for off in (1, 3, 8):
                a1, b1, c1 = placed(a0, off), placed(b0, off + 5), placed(c0, off + 2)
                gemm(a1.T if ta else a1, b1.T if tb else b1, c1, F32(0.5), F32(2.0))
                assert np.array_equal(c1, c), ("address", m, k, n, ta, tb, off)
# the comparisons can fail: oneMKL sums these products in another order than OpenBLAS
# (at k = 1024 among the wide ones; up to k = 512 the two agree here, bit for bit)
assert mkl_differs[True] > 0 and mkl_differs[False] > 0, mkl_differs
print("ok")
"""


@pytest.mark.skipif(not mkl_installed(), reason="oneMKL (pip install mkl) not installed")
def test_mkl_sgemm_leaves_narrow_products_to_openblas():
    """SIMDIST_BLAS=mkl: oneMKL's strict-CNR sgemm, except products with fewer than 16
    columns (``blas.on_openblas_narrow``), which run on numpy's OpenBLAS (np.matmul's bits);
    against float64 on every layout with alpha and beta; the same values at other addresses
    give the same bits. A fresh process: the library is bound once, at import."""
    assert fresh_python(MKL_SGEMM_CHECK, SIMDIST_BLAS="mkl") == "ok"


@pytest.mark.skipif(
    not onednn_sgemm_installed(), reason="oneDNN (pip install onednn-cpu-gomp) not installed"
)
def test_onednn_sgemm_is_exact_to_the_address():
    """SIMDIST_BLAS=onednn: oneDNN's sgemm for the products ``blas.on_onednn`` gives it,
    OpenBLAS's for the rest; against float64 on every layout with alpha and beta; the same
    values at other addresses give the same bits (what DP = ZeRO and resume rely on); the
    rule's products give other bits than OpenBLAS's, the others OpenBLAS's own.
    A fresh process: the library is bound once, at import."""
    assert fresh_python(ONEDNN_SGEMM_CHECK, SIMDIST_BLAS="onednn") == "ok"


HALF_GEMM_MODES = [("bf16", BF16, False), ("fp16", F16, False)] + (
    [("bf16-native", BF16, True)] if blas.NATIVE_BF16_AVAILABLE else []
)


@pytest.mark.parametrize("name,fmt,native", HALF_GEMM_MODES, ids=[m[0] for m in HALF_GEMM_MODES])
def test_gemm_on_half_operands_accumulates_in_float32(name, fmt, native, monkeypatch):
    """blas.half_operands: gemm multiplies operands holding half values (any layout; alpha
    and beta in float32) with float32 accumulation: against float64 products; the native
    bf16 path (oneMKL or oneDNN, where available) agrees with the float32-BLAS path to
    accumulation order. With SIMDIST_HALF_GEMM_CHECK=1 an operand that is not a half value
    is refused, whichever operand it is; plain float32 again after half_operands(None)."""
    rng = np.random.default_rng(23)
    m, k, n = 137, 300, 129  # at least blas._NATIVE_MIN rows and columns: native where it can

    def rounded(x):
        y = np.ascontiguousarray(x, F32).reshape(-1).copy()
        round_half(y, fmt)
        return y.reshape(x.shape)

    big_a = rounded(randn(rng, k, 3 * m))
    a = big_a[:, m : 2 * m].T  # a transposed column slice
    b = rounded(randn(rng, k, 2 * n))[:, n:]  # a strided column slice
    c0 = randn(rng, m, n)
    ref = 0.5 * (a.astype(np.float64) @ b.astype(np.float64)) + 2.0 * c0.astype(np.float64)
    c = c0.copy()
    monkeypatch.setenv("SIMDIST_HALF_GEMM_CHECK", "1")
    try:
        how = blas.half_operands(fmt, native=native)
        assert ("bf16 x bf16" in how) == native, how
        gemm(a, b, c, F32(0.5), F32(2.0))
        emulated = c0.copy()
        blas.half_operands(fmt, native=False)
        gemm(a, b, emulated, F32(0.5), F32(2.0))
        bad = np.array(b)
        bad[3, 2] = F32(1.0) + F32(2.0**-20)  # between two half values
        for x, y in ((a, bad), (bad.T, a.T)):
            with pytest.raises(ValueError, match="not a half-precision value"):
                gemm(x, y, np.zeros((x.shape[0], y.shape[1]), F32), F32(1.0), F32(0.0))
    finally:
        assert blas.half_operands(None) == f"fp32 {blas.BACKEND} sgemm"
    # float32 accumulation of k exact products: |error| <= k eps sum |a b| (loose bound)
    bound = k * EPS * (np.abs(a) @ np.abs(b)).astype(np.float64) * 0.5 + 4 * EPS * np.abs(ref)
    assert (np.abs(c - ref) <= bound).all()
    assert (np.abs(emulated - ref) <= bound).all()
    if native:  # another kernel ran: another summation order somewhere in the 17,673 sums
        assert not np.array_equal(c, emulated)
    plain = np.zeros((m, n), F32)
    gemm(a, bad, plain, F32(1.0), F32(0.0))  # no check, no rounding in float32 mode
    np.testing.assert_allclose(plain, a.astype(np.float64) @ bad, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not blas.NATIVE_BF16_AVAILABLE, reason="no native bf16 GEMM on this machine")
def test_native_bf16_packing_buffers_are_reused_grown_and_released():
    """The native bf16 path packs its operands into two buffers kept between calls: a
    product of the same size reuses them, a larger one grows them (a smaller one after it
    reads only its own words), every result the exact float64 product's to float32
    accumulation, and half_operands(None) frees them."""
    rng = np.random.default_rng(5)

    def halves(r, c):
        x = randn(rng, r, c).reshape(-1)
        round_half(x, BF16)
        return x.reshape(r, c)

    def product(m, k, n):
        a, b = halves(m, k), halves(k, n)
        c = np.zeros((m, n), F32)
        gemm(a, b, c, F32(1.0), F32(0.0))
        ref = a.astype(np.float64) @ b.astype(np.float64)
        bound = k * EPS * (np.abs(a) @ np.abs(b)).astype(np.float64)
        assert (np.abs(c - ref) <= bound).all(), (m, k, n)
        return [blas._SCRATCH[i] for i in range(4)]  # (address, words) of each operand

    try:
        assert "bf16 x bf16" in blas.half_operands(BF16)
        m, k, n = 128, 128, 128  # a product the native kernel takes (blas.takes_native)
        assert blas.takes_native(blas._MODE.value, m, k, n)
        first = product(m, k, n)
        assert first[0] and first[2] and first[1] >= m * k and first[3] >= k * n
        assert product(m, k, n) == first  # reused, not allocated again
        grown = product(256, 160, 192)
        assert grown[1] >= 256 * 160 and grown[3] >= 160 * 192
        assert product(m, k, n) == grown  # a smaller product keeps the larger buffers
    finally:
        blas.half_operands(None)
    assert [blas._SCRATCH[i] for i in range(4)] == [0, 0, 0, 0]


# ------------------------------------------------------------------ softmax + CE loss


CE_SHAPES = [(3, 7, 1.0), (128, 10, 3.0), (16, 10, 1e3)]  # (B, V, logit scale)


def _lanes_order_sum(terms: np.ndarray) -> np.float32:
    """rowops' documented order, in numpy float32: full blocks of 32 into lanes 0..31, the
    n % 32 last elements into the top lanes from the row's last 32, lanes halved; below
    32 elements one chain."""
    t, n, lanes = terms.astype(np.float32), terms.size, 32
    if n < lanes:
        total = np.float32(0.0)
        for v in t:
            total = np.float32(total + v)
        return total
    acc = t[:lanes].copy()
    blocks = n // lanes
    for i in range(1, blocks):
        acc = acc + t[i * lanes : (i + 1) * lanes]
    rem = n - blocks * lanes
    if rem:
        acc[lanes - rem :] += t[n - lanes :][lanes - rem :]
    w = lanes // 2
    while w:
        acc = acc[:w] + acc[w : 2 * w]
        w //= 2
    return acc[0]


@pytest.mark.parametrize("n", [0, 1, 7, 31, 32, 33, 63, 64, 100, 128, 255, 256, 257, 768, 1001])
def test_row_reductions_follow_the_lanes_order(n):
    """Every rowops reduction gives exactly the sum in its documented lane order (the
    contract the layernorms, softmaxes and losses rely on for the same bits on every
    call), and row_max the exact maximum; rows are views inside a longer buffer, so the
    tail's load of the last 32 elements must not reach past n."""
    from simdist.kernels import rowops

    rng = np.random.default_rng(n)
    a, b, x = (rng.standard_normal(n + 5).astype(np.float32) for _ in range(3))
    x[n:] = np.nan  # past the row: must never be read into a result
    m = np.float32(0.375)
    dev = (x - m).astype(np.float32)
    assert rowops.row_sum(x, n) == _lanes_order_sum(x[:n])
    assert rowops.row_dot(a, b, n) == _lanes_order_sum((a * b)[:n])
    assert rowops.row_dot_dev(a, b, x, m, n) == _lanes_order_sum(((a * b) * dev)[:n])
    assert rowops.row_sq_dev(x, m, n) == _lanes_order_sum((dev * dev)[:n])
    if n:
        assert rowops.row_max(x, n) == x[:n].max()
        # float64 agreement: the order changes only the rounding
        assert abs(rowops.row_sum(x, n) - x[:n].astype(np.float64).sum()) < 1e-5 * n


def test_row_max_keeps_pythons_nan_rule():
    """max(acc, v) keeps acc unless v > acc: a NaN first element stays, a later one is
    passed over, in the vector lanes as in the scalar form."""
    from simdist.kernels import rowops

    for n in (3, 40, 100):
        first = np.zeros(n, np.float32)
        first[0], first[-1] = np.nan, 2.0
        assert np.isnan(rowops.row_max(first, n))
        later = np.zeros(n, np.float32)
        later[1], later[-1] = np.nan, 2.0
        assert rowops.row_max(later, n) == 2.0


@pytest.mark.parametrize("B,V,scale", CE_SHAPES)
def test_softmax_cross_entropy_forward_matches_float64(B, V, scale):
    rng = np.random.default_rng(B + V)
    logits = randn(rng, B, V, scale=scale)  # scale 1e3: exp would overflow without the max
    targets = rng.integers(0, V, B).astype(np.int32)
    losses, probs = np.full(B, np.nan, F32), np.full((B, V), np.nan, F32)
    softmax_cross_entropy_forward(losses, probs, logits, targets)
    ref_losses, ref_probs = softmax_ce_ref(logits.astype(np.float64), targets)
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    z_t = np.abs(z[np.arange(B), targets])
    assert np.isfinite(losses).all()  # scale 1e3: target probs underflow, the loss must not
    # loss = log(sum) - z_t: error <= 4 EPS (1 + |z_t|) (measured <= 1.4); probs: 4 EPS abs
    # (measured <= 1.8).
    assert (np.abs(losses - ref_losses) <= 4 * EPS * (1 + z_t)).all()
    assert np.abs(probs - ref_probs).max() <= 4 * EPS


@pytest.mark.parametrize("n", [1, 7, 8, 9, 127, 128, 129, 136, 1000, 1024, 8192, 8193, 20000])
def test_mean_loss_is_numpys_mean_bit_for_bit(n):
    """mean_loss replays numpy's float64 mean of float32 (pairwise blocks, 8192-element
    buffers): equal bits, on magnitudes spread over 35 decades, where the order of the
    additions shows (a plain running sum differs from numpy's here)."""
    rng = np.random.default_rng(n)
    differs_from_running_sum = 0
    for _ in range(20):
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n))).astype(np.float32)
        want = x.mean(dtype=np.float64)
        got = mean_loss(x)
        assert isinstance(got, float) and got == want, (n, got, want)
        running = 0.0
        for v in x.tolist():
            running += v
        differs_from_running_sum += running / n != want
    if n >= 128:  # the check has teeth: the order matters on these inputs
        assert differs_from_running_sum > 0


def test_softmax_cross_entropy_forward_gpt2_vocab():
    """V = 50257: the float32 sum over V costs accuracy, bounded here so it cannot grow."""
    B, V = 4, 50257
    rng = np.random.default_rng(5)
    logits = randn(rng, B, V, scale=2.0)
    targets = rng.integers(0, V, B).astype(np.int32)
    losses, probs = np.empty(B, F32), np.empty((B, V), F32)
    softmax_cross_entropy_forward(losses, probs, logits, targets)
    ref_losses, ref_probs = softmax_ce_ref(logits.astype(np.float64), targets)
    # Relative loss error <= 1e-5 (measured ~1e-6); probs abs <= 4 EPS (measured 1.8).
    assert (np.abs(losses - ref_losses) <= 1e-5 * np.abs(ref_losses)).all()
    assert np.abs(probs - ref_probs).max() <= 4 * EPS


@pytest.mark.parametrize("B,V", [(3, 7), (128, 10)])
def test_softmax_cross_entropy_backward(B, V):
    rng = np.random.default_rng(B * V)
    logits = randn(rng, B, V, scale=2.0)
    targets = rng.integers(0, V, B).astype(np.int32)
    dloss = F32(1.0 / B)
    losses, probs = np.empty(B, F32), np.empty((B, V), F32)
    softmax_cross_entropy_forward(losses, probs, logits, targets)
    dlogits = np.full_like(probs, np.nan)
    softmax_cross_entropy_backward(dlogits, probs, targets, dloss)

    # Exact formula on the kernel's own probs, in float64: only the final rounding differs.
    expected = probs.astype(np.float64)
    expected[np.arange(B), targets] -= 1
    expected *= float(dloss)
    assert np.abs(dlogits - expected).max() <= 2 * EPS * float(dloss)  # two roundings

    # Against FD of the float64 mean loss (measured <= 1.8 EPS/B): the float32 probs' error.
    l64 = logits.astype(np.float64)

    def mean_loss(x):
        return float(softmax_ce_ref(x, targets)[0].sum() / B)

    if B * V <= 64:
        fd = central_fd(mean_loss, l64.copy())
        assert np.abs(dlogits - fd).max() <= 4 * EPS / B + 1e-9  # FD rounding ~1e-10
    direction = rng.standard_normal((B, V))
    fd_dir = directional_fd(mean_loss, l64, direction)
    assert abs(float((dlogits * direction).sum()) - fd_dir) <= 1e-6 * np.abs(direction).sum() / B

    # In place (dlogits is probs) gives the same bits.
    softmax_cross_entropy_backward(probs, probs, targets, dloss)
    np.testing.assert_array_equal(probs, dlogits)


# --------------------------------------------------------------------------- optimizers


ADAMW_CONFIGS = [  # lr, beta1, beta2, eps, weight_decay
    (1e-3, 0.9, 0.999, 1e-8, 0.01),
    (3e-2, 0.3, 0.95, 1e-6, 0.1),  # beta1 < 0.5: torch's lerp takes its other branch
    (1e-3, 0.9, 0.999, 1e-8, 0.0),
]
STEPS = 20


def adamw_grads(rng, n, steps):
    """Gradients whose scale jumps by up to 1e5 between steps, with some exact zeros."""
    grads = [randn(rng, n, scale=10 ** rng.uniform(-4, 1)) for _ in range(steps)]
    for g in grads:
        g[:5] = 0
    return grads


@pytest.mark.parametrize("lr,beta1,beta2,eps,wd", ADAMW_CONFIGS)
def test_adamw_matches_float64_reference(lr, beta1, beta2, eps, wd):
    rng = np.random.default_rng(0)
    N = 4099
    flat = np.zeros(4 * N + 8, F32)  # slices of one flat buffer, as the caller passes them
    p, g, m, v = (flat[i * N + 2 * i : (i + 1) * N + 2 * i] for i in range(4))
    p[:] = randn(rng, N)
    P, M, V = p.astype(np.float64), np.zeros(N), np.zeros(N)
    scale = np.abs(P).max()
    for step, grad in enumerate(adamw_grads(rng, N, STEPS), start=1):
        g[:] = grad
        adamw_update(p, g, m, v, lr, beta1, beta2, eps, wd, step)
        G = grad.astype(np.float64)
        P *= 1 - lr * wd
        M = beta1 * M + (1 - beta1) * G
        V = beta2 * V + (1 - beta2) * G * G
        P -= (lr / (1 - beta1**step)) * M / (np.sqrt(V) / np.sqrt(1 - beta2**step) + eps)
        # p is re-rounded to float32 each step: <= 4 EPS * max|p| per step so far
        # (measured <= 1.1); m, v: 8 EPS of their max (measured <= 3.4).
        assert np.abs(p - P).max() <= 4 * EPS * scale * step
        assert np.abs(m - M).max() <= 8 * EPS * np.abs(M).max()
        assert np.abs(v - V).max() <= 8 * EPS * np.abs(V).max()
    assert not flat[N : N + 2].any() and not flat[-2:].any()  # gaps untouched


SGD_CONFIGS = [(0.9, 1e-4), (0.0, 0.0), (0.9, 0.0), (0.0, 1e-2)]  # momentum, weight_decay


@pytest.mark.parametrize("momentum,wd", SGD_CONFIGS)
def test_sgd_matches_float64_reference(momentum, wd):
    rng = np.random.default_rng(1)
    N, lr = 4099, 0.05
    p = randn(rng, N)
    buf = np.full(N, np.nan, F32)  # NaN: momentum 0 must not read or write it
    P, BUF = p.astype(np.float64), np.zeros(N)
    scale = np.abs(P).max()
    for step in range(1, 11):
        g = randn(rng, N)
        sgd_update(p, g, buf, lr, momentum, wd, step)
        G = g + wd * P
        BUF = G if step == 1 else momentum * BUF + G
        P = P - lr * (BUF if momentum else G)
        assert np.abs(p - P).max() <= 4 * EPS * scale * step  # measured <= 1 EPS * step
    assert np.isnan(buf).all() == (momentum == 0)
    if momentum:
        assert np.abs(buf - BUF).max() <= 8 * EPS * 10 * np.abs(BUF).max()


@pytest.mark.parametrize("lr,beta1,beta2,eps,wd", ADAMW_CONFIGS)
def test_adamw_matches_torch(lr, beta1, beta2, eps, wd):
    """m and v bit-identical to torch; p differs only through torch's MKL sqrt (<= 1 ulp)."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    rng = np.random.default_rng(2)
    N = 4099  # not a multiple of torch's vector width: its scalar tail loop is covered too
    p = randn(rng, N)
    m, v = np.zeros(N, F32), np.zeros(N, F32)
    tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.AdamW(
        [tp], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, foreach=False
    )
    for step, grad in enumerate(adamw_grads(rng, N, STEPS), start=1):
        adamw_update(p, grad, m, v, lr, beta1, beta2, eps, wd, step)
        tp.grad = torch.from_numpy(grad.copy())
        opt.step()
        state = opt.state[tp]
        assert max_ulp(m, state["exp_avg"].numpy()) == 0
        assert max_ulp(v, state["exp_avg_sq"].numpy()) == 0
        tp_np = tp.detach().numpy()
        # Where torch's sqrt is 1 ulp off, p moves by a rounding of p + update: measured
        # <= 5.5 EPS * (|p| + lr) after 20 steps (lr: the update's scale near p = 0).
        assert (np.abs(p - tp_np) <= 16 * EPS * (np.abs(tp_np) + lr)).all()


def test_adamw_takes_float32_hyperparameters_as_their_float64_values():
    """np.float32 arguments must not turn the scalar prologue into float32 arithmetic."""
    rng = np.random.default_rng(6)
    p0, grads = randn(rng, 257), [randn(rng, 257) for _ in range(5)]
    hyper = tuple(F32(h) for h in (3e-3, 0.9, 0.999, 1e-8, 0.1))
    results = []
    for args in (hyper, tuple(float(h) for h in hyper)):  # same values, two types
        p, m, v = p0.copy(), np.zeros(257, F32), np.zeros(257, F32)
        for step, g in enumerate(grads, start=1):
            adamw_update(p, g, m, v, *args, step)
        results.append(p)
    np.testing.assert_array_equal(results[0], results[1])


def test_adamw_scalars_match_torch_bitwise():
    """With sqrt(v_hat) far below ulp(eps), denom == eps exactly in both implementations,
    so torch's inexact sqrt drops out and p must match bit for bit. This pins down the
    scalar handling: step size, 1 - lr*wd and eps computed in float64, then rounded once
    to float32 (computing them in float32 instead changes p here)."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    rng = np.random.default_rng(4)
    N, lr, beta1, beta2, eps, wd = 4099, 1e-3, 0.9, 0.999, 1.0, 0.1
    p = randn(rng, N, scale=1e-12)  # the size of one update, so every bit of it shows in p
    m, v = np.zeros(N, F32), np.zeros(N, F32)
    tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.AdamW(
        [tp], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, foreach=False
    )
    for step in range(1, STEPS + 1):
        grad = randn(rng, N, scale=1e-9)  # sqrt(v_hat) ~ 1e-9 << ulp(1.0) / 2 = 6e-8
        adamw_update(p, grad, m, v, lr, beta1, beta2, eps, wd, step)
        tp.grad = torch.from_numpy(grad.copy())
        opt.step()
        assert max_ulp(p, tp.detach().numpy()) == 0, step


@pytest.mark.skipif(not optim_kernels._X86, reason="FTZ/DAZ are bits of x86's MXCSR")
def test_optimizer_updates_flush_subnormal_state_and_restore_the_register():
    """A state that decays into the subnormal range (exp_avg of a weight whose gradient
    stays 0: an MNIST border pixel, a dead ReLU unit) comes out of the update as exactly 0,
    which keeps AdamW and SGD off the microcode-assisted path; the control register is
    restored afterwards, so numpy goes on computing subnormals."""
    n, half_tiny = 1001, np.finfo(F32).tiny / F32(2)  # half the smallest normal: subnormal
    control = lambda: optim_kernels._mxcsr_with(0, True) & ~0x3F  # noqa: E731 (not flags)
    before = control()
    args = (1e-3, 0.9, 0.999, 1e-8, 0.0, 5)
    p, g = np.ones(n, F32), np.zeros(n, F32)
    m, v = np.full(n, half_tiny), np.full(n, 1e-20, F32)
    unflushed = m.copy()  # the same update without the flush keeps a subnormal exp_avg
    optim_kernels._adamw_kernel(
        p.copy(), g, unflushed, v.copy(), *optim_kernels._adamw_scalars(*args), F32(1.0)
    )
    assert (unflushed > 0).all() and (unflushed < np.finfo(F32).tiny).all()
    adamw_update(p, g, m, v, *args)
    assert (m == 0).all() and (v > 0).all() and (p == 1).all()
    buf = np.full(n, half_tiny)
    sgd_update(p, g, buf, 0.1, 0.9, 0.0, 2)  # buf = 0.9 * buf + 0
    assert (buf == 0).all()
    segs = np.array([[0, n, 1]], np.int64)
    m = np.full(n, half_tiny)
    adamw_update_segments(p, g, m, v, segs, *args)
    assert (m == 0).all()
    assert control() == before
    assert F32(half_tiny) * F32(0.5) > 0  # outside the updates subnormals are computed


@pytest.mark.parametrize("momentum,wd", SGD_CONFIGS)
def test_sgd_matches_torch_bitwise(momentum, wd):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    rng = np.random.default_rng(3)
    N, lr = 4099, 0.05
    p = randn(rng, N)
    buf = np.zeros(N, F32)
    tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.SGD([tp], lr=lr, momentum=momentum, weight_decay=wd, foreach=False)
    for step in range(1, 11):
        g = randn(rng, N)
        sgd_update(p, g, buf, lr, momentum, wd, step)
        tp.grad = torch.from_numpy(g.copy())
        opt.step()
        assert max_ulp(p, tp.detach().numpy()) == 0
        if momentum:
            assert max_ulp(buf, opt.state[tp]["momentum_buffer"].numpy()) == 0


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_segment_updates_are_bitwise_the_per_segment_calls(wd):
    """adamw/sgd_update_segments (one call per step) == one adamw/sgd_update per segment
    with that segment's weight decay; gaps between segments (padding) stay untouched."""
    rng = np.random.default_rng(31)
    n = 103
    segs = np.array([[0, 10, 1], [10, 11, 0], [11, 60, 1], [64, 100, 0]], np.int64)
    p0, g = randn(rng, n), randn(rng, n)
    m0, v0 = randn(rng, n), np.abs(randn(rng, n))
    for step in (1, 2, 7):
        p, m, v = p0.copy(), m0.copy(), v0.copy()
        adamw_update_segments(p, g, m, v, segs, 1e-2, 0.9, 0.95, 1e-8, wd, step)
        rp, rm, rv = p0.copy(), m0.copy(), v0.copy()
        for lo, hi, decays in segs:
            sl = slice(lo, hi)
            adamw_update(rp[sl], g[sl], rm[sl], rv[sl], 1e-2, 0.9, 0.95, 1e-8, wd * decays, step)
        for a, b in ((p, rp), (m, rm), (v, rv)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(p[60:64], p0[60:64])
        p, m = p0.copy(), m0.copy()
        sgd_update_segments(p, g, m, segs, 1e-2, 0.9, wd, step)
        rp, rm = p0.copy(), m0.copy()
        for lo, hi, decays in segs:
            sl = slice(lo, hi)
            sgd_update(rp[sl], g[sl], rm[sl], 1e-2, 0.9, wd * decays, step)
        np.testing.assert_array_equal(p, rp)
        np.testing.assert_array_equal(m, rm)


@pytest.mark.parametrize("scale", [0.3137, 1.0])
def test_grad_scale_is_bitwise_scaling_the_gradient_first(scale):
    """grad_scale (clipping's coefficient, applied in the update's pass) == multiplying the
    gradient in place by float32(scale) and updating with that, for AdamW and SGD, whole
    buffer and segments; the gradient itself is left unscaled."""
    rng = np.random.default_rng(32)
    n = 1003
    segs = np.array([[0, 500, 1], [500, 1003, 0]], np.int64)
    g = randn(rng, n) * F32(50)
    g[:3] = (np.finfo(F32).tiny, -np.finfo(F32).tiny * F32(3), 0.0)  # products to flush
    p0, m0, v0 = randn(rng, n), randn(rng, n), np.abs(randn(rng, n))
    scaled = g * F32(scale)
    for step in (1, 4):
        args = (1e-2, 0.9, 0.95, 1e-8, 0.1, step)
        p, m, v, gg = p0.copy(), m0.copy(), v0.copy(), g.copy()
        adamw_update(p, gg, m, v, *args, grad_scale=scale)
        rp, rm, rv = p0.copy(), m0.copy(), v0.copy()
        adamw_update(rp, scaled.copy(), rm, rv, *args)
        for a, b in ((p, rp), (m, rm), (v, rv)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(gg, g)
        p, m, v = p0.copy(), m0.copy(), v0.copy()
        adamw_update_segments(p, g, m, v, segs, *args, grad_scale=scale)
        rp, rm, rv = p0.copy(), m0.copy(), v0.copy()
        adamw_update_segments(rp, scaled, rm, rv, segs, *args)
        for a, b in ((p, rp), (m, rm), (v, rv)):
            np.testing.assert_array_equal(a, b)
        p, b1 = p0.copy(), m0.copy()
        sgd_update_segments(p, g, b1, segs, 1e-2, 0.9, 1e-4, step, grad_scale=scale)
        rp, rb = p0.copy(), m0.copy()
        sgd_update_segments(rp, scaled, rb, segs, 1e-2, 0.9, 1e-4, step)
        np.testing.assert_array_equal(p, rp)
        np.testing.assert_array_equal(b1, rb)
        p, b1 = p0.copy(), m0.copy()
        sgd_update(p, g, b1, 1e-2, 0.0, 0.0, step, grad_scale=scale)
        rp = p0.copy()
        sgd_update(rp, scaled, b1.copy(), 1e-2, 0.0, 0.0, step)
        np.testing.assert_array_equal(p, rp)
    if scale != 1.0:  # the check can fail: an unscaled update differs
        p = p0.copy()
        adamw_update(p, g.copy(), m0.copy(), v0.copy(), 1e-2, 0.9, 0.95, 1e-8, 0.1, 4)
        q = p0.copy()
        adamw_update(q, g.copy(), m0.copy(), v0.copy(), 1e-2, 0.9, 0.95, 1e-8, 0.1, 4,
                     grad_scale=scale)  # fmt: skip
        assert not np.array_equal(p, q)


@njit
def _lane_order_sum_of_squares(x, lanes):
    """sum_of_squares's order written as scalars: lane j sums x[lanes * i + j]**2 in order
    of i (the tail too), then lane j + w is added into lane j for w = lanes / 2, ..., 1."""
    a = np.zeros(lanes)
    for i in range(x.size):
        v = np.float64(x[i])
        a[i % lanes] += v * v
    w = lanes // 2
    while w:
        for j in range(w):
            a[j] += a[j + w]
        w //= 2
    return a[0]


@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 31, 32, 33, 1000, 669_706])
def test_sum_of_squares_is_float64_accurate(n):
    """Accurate to float64 rounding, and in its fixed order of LANES lanes (held in one
    vector) to the bit, at any alignment of the slice (weight streaming rebuilds it)."""
    assert LANES == 32
    rng = np.random.default_rng(n)
    x = randn(rng, n + 3, scale=1e-3) + F32(1)  # large |x|, small spread: float32 sums drift
    for off in (1, 2, 3):
        want = _lane_order_sum_of_squares(x[off : off + n], LANES)
        assert sum_of_squares(x[off : off + n]) == want
    x = x[:n]
    got = sum_of_squares(x)
    assert got == _lane_order_sum_of_squares(x, LANES)
    x64 = x.astype(np.float64)
    exact = math.fsum(x64 * x64)  # squares of float32 are exact in float64; fsum rounds once
    assert isinstance(got, float)
    # float64 accumulation: within the worst-case bound n * 2**-53 relative (7e-11 at
    # n ~ 7e5); a float32 accumulator misses by ~1e-6 or more here.
    assert abs(got - exact) <= n * 2.0**-53 * exact
    assert sum_of_squares(x) == got  # same order every call


@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 6])
def test_add_divide_is_numpy_add_then_divide(divisor):
    """The shm all-reduce's fused last step must give average_block's bits exactly."""
    rng = np.random.default_rng(divisor)
    acc, x = randn(rng, 1003), randn(rng, 1003)
    want = np.add(acc, x)
    np.divide(want, F32(divisor), out=want)
    add_divide(acc, x, F32(divisor))
    assert acc.dtype == np.float32 and max_ulp(acc, want) == 0


@pytest.mark.parametrize("n", [0, 1, 31, 4095, 4096, 4097, 2 * 4096 + 33, 100_003])
def test_add_divide_store_is_add_divide_copy_and_sum_of_squares(n):
    """The shm all-reduce's fused pass (DP gradients): the same bits as add_divide, a copy
    into the peer's buffer and sum_of_squares of the result, across piece boundaries (4096
    elements) and the lanes' tail; also with the peer's values read and overwritten in place,
    as the all-reduce runs it."""
    rng = np.random.default_rng(n)
    acc, x = randn(rng, n), randn(rng, n)
    want = acc.copy()
    add_divide(want, x, F32(2))
    for inplace in (False, True):
        got, peer = acc.copy(), x.copy()
        dst = peer if inplace else np.full(n, np.nan, F32)
        total = add_divide_store(got, peer, F32(2), dst, np.full(LANES, 7.0))
        assert max_ulp(got, want) == 0 and max_ulp(dst, want) == 0
        assert total == sum_of_squares(want)  # bitwise: the norm's order is a contract


def test_scale_inplace_is_float32_multiply():
    rng = np.random.default_rng(9)
    x = randn(rng, 1001)
    expected = x * F32(0.37)  # NumPy float32 * float32 scalar: one float32 rounding
    scale_inplace(x, F32(0.37))
    np.testing.assert_array_equal(x, expected)


# ------------------------------------------------------------------ contract checks


@njit
def _bad_python_float(x):
    for i in range(x.size):
        # A Python float literal is float64 in numba: x[i] widens, multiplies, truncates.
        # (With 0.5 LLVM proves float32 gives the same bits and drops the widening; 0.1 is
        # not exact in float32, so the float64 multiply must stay.)
        x[i] = x[i] * 0.1


@njit
def _bad_float64_accumulator(out, x):
    acc = 0.0  # float64 accumulator
    for i in range(x.size):
        acc += x[i]
    out[0] = acc


@njit
def _bad_int_division(out, x):
    n = x.size
    for i in range(n):
        out[i] = x[i] / n  # float32 / int64 is float64 in numba


@njit
def _good_float32(out, x, s):
    half = np.float32(0.5)
    for i in range(x.size):
        out[i] = x[i] * half + s / np.float32(x.size)


def test_float64_scan_catches_bad_kernels():
    x, out = np.ones(8, F32), np.empty(8, F32)
    _bad_python_float(x)
    _bad_float64_accumulator(out, x)
    _bad_int_division(out, x)
    _good_float32(out, x, F32(2))
    for bad in (_bad_python_float, _bad_float64_accumulator, _bad_int_division):
        assert all(float64_ops(bad).values()), bad.__name__
    # float32 scalar argument: the wrapper's unboxing fptrunc must not count.
    assert not any(float64_ops(_good_float32).values())


# The modules this file covers (the GPT-2 kernels have their own test file).
MODULES = ["linear", "activation", "loss", "optim"]
# sum_of_squares and mean_loss accumulate in float64 by design; nothing else may.
# the gradient norm's float64 sum, and the two kernels it is made of (they take its float64
# lane accumulator: pipelines and weight streaming pass it on between ranks); the float64
# mean of a batch's losses (numpy's losses.mean(dtype=np.float64), replayed)
FLOAT64_ALLOWED = {
    "optim.sum_of_squares", "optim.lane_sum_of_squares", "optim.combine_lanes",
    "loss.mean_loss", "loss._pairwise_sum",
}  # fmt: skip


def test_no_kernel_does_float64_arithmetic(monkeypatch):
    monkeypatch.setattr(registry, "MODULES", MODULES)
    registry.warm_all()
    kernels = registry.dispatchers()
    assert set(FLOAT64_ALLOWED) <= set(kernels)
    for name, disp in kernels.items():
        for sig, lines in float64_ops(disp).items():
            if name not in FLOAT64_ALLOWED:
                assert "float64" not in sig, f"{name} was called with float64 arguments: {sig}"
            if name in FLOAT64_ALLOWED:
                assert lines, f"scanner sees no float64 in {name}: is it scanning anything?"
            else:
                assert not lines, f"{name}{sig} does float64 work:\n" + "\n".join(lines[:10])


@njit
def _allocating(out, inp):
    tmp = np.empty_like(inp)  # a heap array per call, as array expressions and 2-arg a @ b make
    tmp[0, 0] = inp[0, 0]
    out[0, 0] = tmp[0, 0]


def test_kernels_do_not_allocate():
    rng = np.random.default_rng(12)
    B, C, OC = 4, 6, 5
    inp, weight, bias, dout = linear_case(rng, B, C, OC)
    out, dinp = np.empty((B, OC), F32), np.empty_like(inp)
    dweight, dbias = np.empty_like(weight), np.empty_like(bias)
    targets = np.array([0, 4, 2, 1], np.int32)
    losses, probs = np.empty(B, F32), np.empty((B, OC), F32)
    flat = np.ones(40, F32)
    p, g, m, v = flat[0:10], flat[10:20], flat[20:30], flat[30:40]
    calls = {
        "linear_forward": (linear_forward, out, inp, weight, bias),
        "linear_backward": (linear_backward, dinp, dweight, dbias, dout, inp, weight),
        "linear_backward_params": (linear_backward_params, dweight, dbias, dout, inp),
        "linear_relu_forward": (linear_relu_forward, out, inp, weight, bias),
        "linear_relu_backward": (linear_relu_backward, dinp, dweight, dbias, dout, inp, weight),
        "gemm": (gemm, inp.T, dout, dweight, F32(1.0), F32(0.0)),
        "relu_forward": (relu_forward, out, out),
        "relu_backward": (relu_backward, dout, dout, out),
        "ce_forward": (softmax_cross_entropy_forward, losses, probs, out, targets),
        "ce_backward": (softmax_cross_entropy_backward, dout, probs, targets, F32(0.25)),
        "sum_of_squares": (sum_of_squares, g),
        "mean_loss": (mean_loss, losses),
        "scale_inplace": (scale_inplace, g, F32(0.5)),
        "add_divide": (add_divide, g, m, F32(2)),
    }
    for name, (fn, *args) in calls.items():
        assert nrt_allocations(fn, *args) == 0, name
    # The optimizers' jitted kernels, through their Python wrappers' argument conversion.
    from simdist.kernels import optim

    adamw_args = (p, g, m, v) + tuple(
        F32(x) for x in (0.9, 0.1, 0.999, 1e-3, -1e-3, 0.5, 1e-8, 0.75)
    )
    assert nrt_allocations(optim._adamw_kernel, *adamw_args) == 0
    sgd_args = (p, g, m, F32(-0.1), F32(0.9), F32(1e-4), False, F32(0.75))
    assert nrt_allocations(optim._sgd_kernel, *sgd_args) == 0
    segs = np.array([[0, 4, 1], [4, 10, 0]], np.int64)
    assert nrt_allocations(optim._adamw_segments, *adamw_args[:4], segs, *adamw_args[4:]) == 0
    assert nrt_allocations(optim._sgd_segments, *sgd_args[:3], segs, *sgd_args[3:]) == 0
    # Positive control: the counter does see an allocation.
    assert nrt_allocations(_allocating, dinp, inp) >= 1


# ------------------------------------------------------------------------------ registry


def test_warm_all_compiles_every_kernel_in_a_fresh_process():
    code = (
        "import simdist\n"
        "from simdist.kernels import registry\n"
        f"registry.MODULES = {MODULES!r}\n"
        "t = registry.warm_all()\n"
        "missing = [n for n, d in registry.dispatchers().items() if not d.signatures]\n"
        "assert t > 0 and not missing, missing\n"
        "print(len(registry.dispatchers()))\n"
    )
    # optim: sum_of_squares with lane_sum_of_squares and combine_lanes (slices of one norm);
    # loss: mean_loss with its _pairwise_sum; linear: linear_gelu_backward and
    # linear_gelu_forward (GPT-2's MLP)
    assert int(fresh_python(code)) == 21 + optim_kernels._X86  # + the MXCSR swap on x86


def test_registry_skips_only_missing_modules(monkeypatch):
    monkeypatch.setattr(registry, "MODULES", ["linear", "no_such_kernel_module"])
    assert [m.__name__ for m in registry.modules()] == ["simdist.kernels.linear"]

    def import_with_missing_dependency(name):
        raise ModuleNotFoundError("No module named 'some_dependency'", name="some_dependency")

    monkeypatch.setattr(registry.importlib, "import_module", import_with_missing_dependency)
    with pytest.raises(ModuleNotFoundError):
        registry.modules()


# ------------------------------------------------------------------ the compiled-code cache


def test_kernel_caches_are_keyed_by_every_kernel_source(tmp_path, monkeypatch):
    """A cached kernel holds the code of the kernels it calls, and numba keys it by its own
    file only: caches live in a directory named by a digest of all kernel sources, so an
    edit to blas.py cannot leave linear.py's cache running the old gemm."""
    from simdist.kernels import _jit
    from simdist.kernels.linear import linear_forward

    for dispatcher in (gemm, linear_forward):
        assert dispatcher._cache._cache_path.startswith(_jit.CACHE_DIR)
    assert Path(_jit.CACHE_DIR).name == f"simdist-{_jit._sources_digest()}"
    (tmp_path / "blas.py").write_text("x = 1\n")
    (tmp_path / "linear.py").write_text("y = 2\n")
    monkeypatch.setattr(_jit, "_HERE", tmp_path)
    before = _jit._sources_digest()
    (tmp_path / "blas.py").write_text("x = 3\n")  # the callee changes, the caller does not
    assert _jit._sources_digest() != before


# ------------------------------------------------------------------ the vector width

_LOOP_KERNEL_OUTPUTS = """
import simdist, numpy as np
from numba import njit
from simdist.kernels.attention import attention_backward, attention_forward
from simdist.kernels.gelu import gelu_backward, gelu_forward
from simdist.kernels.layernorm import layernorm_backward_accumulate, residual_layernorm_forward
from simdist.kernels.optim import adamw_update

def widest_register(n=4096):
    @njit(cache=False, error_model="numpy")  # uncached: its machine code can be read
    def scale(x, y):
        for i in range(x.size):
            y[i] = x[i] * np.float32(3.0) + np.float32(1.0)
    x = np.ones(n, np.float32)
    scale(x, np.empty_like(x))
    asm = next(iter(scale.inspect_asm().values()))
    return "zmm" if "zmm" in asm else "ymm" if "ymm" in asm else "xmm"

r = np.random.default_rng(7)
f = lambda *s: r.standard_normal(s, dtype=np.float32)
N, C, NH, B, T = 96, 64, 2, 3, 32
x, out = f(N * 4 * C), {}
out["gelu"] = np.empty_like(x); gelu_forward(out["gelu"], x)
out["dgelu"] = np.empty_like(x); gelu_backward(out["dgelu"], x, f(N * 4 * C))
a, b, w, bias = f(N, C), f(N, C), f(C), f(C)
res, ln, mean, rstd = np.empty_like(a), np.empty_like(a), f(N), f(N)
residual_layernorm_forward(res, ln, mean, rstd, a, b, w, bias)
out["res"], out["ln"], out["mean"], out["rstd"] = res, ln, mean, rstd
out["dln"], out["dw"], out["db"] = f(N, C), f(C), f(C)
layernorm_backward_accumulate(out["dln"], out["dw"], out["db"], f(N, C), res, w, mean, rstd)
qkv = f(B, T, 3 * C)
out["att_out"], out["att"] = np.empty((B, T, C), np.float32), np.empty((B, NH, T, T), np.float32)
attention_forward(out["att_out"], out["att"], qkv, NH)
out["dqkv"] = np.empty_like(qkv)
attention_backward(out["dqkv"], f(B, T, C), qkv, out["att"], np.empty((T, T), np.float32), NH)
p, g, m, v = f(5003), f(5003), f(5003), np.abs(f(5003))
adamw_update(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
out["p"], out["m"], out["v"] = p, m, v
np.savez(PATH, **out)
print(widest_register())
"""


@pytest.mark.skipif(
    not __import__("llvmlite.binding").binding.get_host_cpu_features().get("avx512f"),
    reason="no AVX-512 on this CPU: the kernels have one vector width",
)
def test_kernels_use_512_bit_vectors_on_avx512_with_the_same_bits(tmp_path):
    """kernels/_jit.py lifts LLVM's 256-bit preference on AVX-512 CPUs; the loops then run
    in zmm registers, and every kernel computes bitwise what LLVM's default build computes
    (no fastmath: a lane's arithmetic does not depend on the width). Both builds run in
    fresh interpreters: the width is fixed when numba creates its target machine."""
    import llvmlite.binding as llvm

    host = llvm.get_host_cpu_features().flatten()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    widths = {}
    for name, extra in (("wide", {}), ("default", {"NUMBA_CPU_FEATURES": host})):
        code = _LOOP_KERNEL_OUTPUTS.replace("PATH", repr(str(tmp_path / f"{name}.npz")))
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, **extra, "NUMBA_CACHE_DIR": str(tmp_path / f"cache_{name}")},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        widths[name] = run.stdout.split()[-1]
    # LLVM's Intel server tuning prefers ymm (the case this guards); its Zen 4/5 tuning
    # already takes zmm, and then the two builds are the same code
    assert widths["wide"] == "zmm" and widths["default"] in ("ymm", "zmm"), widths
    wide, default = np.load(tmp_path / "wide.npz"), np.load(tmp_path / "default.npz")
    assert sorted(wide.files) == sorted(default.files)
    for key in wide.files:
        assert wide[key].tobytes() == default[key].tobytes(), key


def test_a_users_numba_cpu_features_are_left_as_they_are():
    """NUMBA_CPU_FEATURES set by the user (a portable cache, a profiling build) wins."""
    features = "+sse2,+avx,+avx2,+fma"
    got = fresh_python(
        "import simdist.kernels.gelu; from numba import config; print(config.CPU_FEATURES)",
        NUMBA_CPU_FEATURES=features,
    )
    assert got.splitlines()[-1] == features
