"""Row reductions and a vectorisable float32 exp, shared by the GPT-2 kernels.

The kernels compile without fastmath, so LLVM may not reorder a float32 reduction: one
running sum is a single dependency chain, one add per ~4 cycles. The reductions here run
in 32 interleaved lanes held in one vector (below), and add the lanes pairwise at the end.

``exp_f32`` exists because ``np.exp`` on float32 calls libm's ``expf`` one element at a
time (no SVML here), which keeps the softmax loops scalar; the version below is plain
arithmetic plus an exponent-field bitcast, so LLVM vectorises the loops that call it.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._jit import kernel

F32 = np.float32


@intrinsic
def _pow2(typingctx, k):
    """2.0**k as float32 for an integer k in [-126, 127]: k + 127 placed in the exponent."""
    if not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        k32 = builder.trunc(args[0], i32) if k.bitwidth > 32 else args[0]
        biased = builder.add(k32, ir.Constant(i32, 127))
        bits = builder.shl(biased, ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(k), codegen


@kernel
def exp_f32(x):
    """float32 e**x within 2 ulp; 0 below -87.33 (no denormals), saturates above 88.

    NaN propagates. Vectorisable: every branch below becomes a select.
    """
    # e**x = 2**k * e**r with k = round(x / ln 2) and |r| <= ln(2) / 2; r is computed with
    # ln 2 split in two (hi has few bits, so k * hi is exact for |k| < 2**15) and e**r by
    # its Taylor series to r**7, whose truncation error (|r|**8 / 8! < 6e-9) is below ulp/2.
    lo_lim = F32(-87.33)  # e**-87.33 ~ FLT_MIN: below, return 0 rather than a denormal
    hi_lim = F32(88.0)  # keeps k <= 127, the largest finite exponent
    xc = min(max(x, lo_lim), hi_lim)
    kf = np.floor(xc * F32(1.4426950408889634) + F32(0.5))
    r = xc - kf * F32(0.693359375)
    r = r - kf * F32(-2.12194440e-4)
    p = F32(1.0 / 5040.0)
    p = p * r + F32(1.0 / 720.0)
    p = p * r + F32(1.0 / 120.0)
    p = p * r + F32(1.0 / 24.0)
    p = p * r + F32(1.0 / 6.0)
    p = p * r + F32(0.5)
    p = p * r + F32(1.0)
    p = p * r + F32(1.0)
    y = p * _pow2(np.int32(kf))
    if x != x:
        return x
    return F32(0.0) if x < lo_lim else y


# The row reductions run in LANES interleaved float32 lanes held in one vector (two 512-bit
# registers, four 256-bit ones on AVX2), written out as vector IR because LLVM keeps
# scalar chains scalar without fastmath: the eight partial sums these replaced compiled to
# eight scalar chains (`python scripts/bench_kernels.py --rows`: row_sum over 1024 rows of
# 256, 47.8 us as eight partials, 11.5 us in lanes; Xeon 6/167/1). The order is a fixed
# contract, the same on every call and every rank:
#   n >= LANES: element LANES * i + j into lane j for every full block (the first block
#     starts the lanes; a max starts every lane at element 0); the last n % LANES elements
#     into the top lanes, in order, from one in-bounds load of the row's last LANES
#     elements (the lanes it repeats left as they are); then lane j + w into lane j for
#     w = LANES / 2, ..., 1.
#   n < LANES: one chain, element 0 first.
LANES = 32


def _is_row(t) -> bool:
    return (
        isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32 and t.layout == "C"
    )


def _reduce_codegen(builder, ptrs, m, n, term, combine, empty):
    """Emit the lanes' reduction (the order above) of ``term(loaded values, m)`` over
    ``n`` elements of the float32 arrays at ``ptrs``; ``combine(builder, acc, t)`` is the
    lane operation (add, or max) and ``empty`` the result for n <= 0 (None: read element 0
    regardless, as a max of nothing has no value). Returns the float32 result."""
    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    vf = ir.VectorType(f32, LANES)
    result = cgutils.alloca_once(builder, f32)

    def load_vec(at):
        return [
            builder.load(builder.bitcast(builder.gep(p, [at]), vf.as_pointer()), align=4)
            for p in ptrs
        ]

    def splat(value, ty):
        vec = builder.insert_element(
            ir.Constant(ir.VectorType(ty, LANES), None), value, ir.Constant(i32, 0)
        )
        return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, LANES), [0] * LANES))

    m_vec = splat(m, f32) if m is not None else None
    wide = builder.icmp_signed(">=", n, ir.Constant(i64, LANES))
    with builder.if_else(wide) as (vector_path, short_path):
        with vector_path:
            acc = cgutils.alloca_once(builder, vf)
            blocks = builder.sdiv(n, ir.Constant(i64, LANES))
            if empty is None:  # a max: every lane starts at element 0, so a NaN can enter
                # a lane only as element 0 (then every lane: the result is NaN, as in Python)
                first = builder.load(ptrs[0])
                builder.store(splat(first, f32), acc)
                skip = ir.Constant(i64, 0)
            else:  # a sum: the first block starts the lanes
                builder.store(term(builder, load_vec(ir.Constant(i64, 0)), m_vec), acc)
                skip = ir.Constant(i64, 1)
            with cgutils.for_range(builder, builder.sub(blocks, skip)) as loop:
                at = builder.mul(builder.add(loop.index, skip), ir.Constant(i64, LANES))
                t = term(builder, load_vec(at), m_vec)
                builder.store(combine(builder, builder.load(acc), t), acc)
            rem = builder.sub(n, builder.mul(blocks, ir.Constant(i64, LANES)))
            has_tail = builder.icmp_signed(">", rem, ir.Constant(i64, 0))
            with builder.if_then(has_tail):
                t = term(builder, load_vec(builder.sub(n, ir.Constant(i64, LANES))), m_vec)
                first = builder.trunc(builder.sub(ir.Constant(i64, LANES), rem), i32)
                lane_ids = ir.Constant(ir.VectorType(i32, LANES), list(range(LANES)))
                keep = builder.icmp_unsigned(">=", lane_ids, splat(first, i32))
                cur = builder.load(acc)
                builder.store(builder.select(keep, combine(builder, cur, t), cur), acc)
            total = builder.load(acc)
            w = LANES // 2
            while w:  # lane j + w into lane j
                half = [ir.Constant(ir.VectorType(i32, w), list(range(k, k + w))) for k in (0, w)]
                lo, hi = (builder.shuffle_vector(total, total, h) for h in half)
                total = combine(builder, lo, hi)
                w //= 2
            builder.store(builder.extract_element(total, ir.Constant(i32, 0)), result)
        with short_path:

            def load_one(at):
                return [builder.load(builder.gep(p, [at])) for p in ptrs]

            if empty is None:
                builder.store(term(builder, load_one(ir.Constant(i64, 0)), m), result)
                start = ir.Constant(i64, 1)
            else:
                builder.store(ir.Constant(f32, empty), result)
                start = ir.Constant(i64, 0)
            with cgutils.for_range(builder, builder.sub(n, start)) as loop:
                t = term(builder, load_one(builder.add(loop.index, start)), m)
                builder.store(combine(builder, builder.load(result), t), result)
    return builder.load(result)


def _add(builder, acc, t):
    return builder.fadd(acc, t)


def _max(builder, acc, t):
    # Python's max(acc, t) as numba lowers it: t where t > acc (ordered), else acc; so a NaN
    # after the first element is passed over and a NaN first element stays
    return builder.select(builder.fcmp_ordered(">", t, acc), t, acc)


def _reduction(n_rows: int, with_m: bool, term, combine, doc: str, empty: float | None = 0.0):
    """An intrinsic ``f(row_1, ..., row_k[, m], n) -> float32`` reducing ``term`` over the
    first n elements of k contiguous float32 rows."""

    def typer(typingctx, args):
        rows, rest = args[:n_rows], args[n_rows:]
        if not all(_is_row(r) for r in rows) or not isinstance(rest[-1], types.Integer):
            return None
        if with_m and not isinstance(rest[0], types.Float):
            return None

        def codegen(context, builder, signature, llargs):
            ptrs = [
                context.make_array(ty)(context, builder, v).data
                for ty, v in zip(signature.args[:n_rows], llargs[:n_rows], strict=True)
            ]
            m = None
            if with_m:
                m = context.cast(builder, llargs[n_rows], signature.args[n_rows], types.float32)
            n = context.cast(builder, llargs[-1], signature.args[-1], types.int64)
            return _reduce_codegen(builder, ptrs, m, n, term, combine, empty)

        return types.float32(*args), codegen

    # numba's intrinsics take no *args: one explicit signature per arity
    arity = n_rows + with_m + 1
    if arity == 2:

        def fn(typingctx, a0, a1):
            return typer(typingctx, (a0, a1))
    elif arity == 3:

        def fn(typingctx, a0, a1, a2):
            return typer(typingctx, (a0, a1, a2))
    elif arity == 5:

        def fn(typingctx, a0, a1, a2, a3, a4):
            return typer(typingctx, (a0, a1, a2, a3, a4))
    else:
        raise ValueError(f"no reduction of arity {arity}")
    fn.__doc__ = doc
    return intrinsic(fn)


def _t_first(b, v, m):
    return v[0]


def _t_prod(b, v, m):
    return b.fmul(v[0], v[1])


def _t_prod_dev(b, v, m):  # a * b * (x - m), multiplied left to right
    return b.fmul(b.fmul(v[0], v[1]), b.fsub(v[2], m))


def _t_sq_dev(b, v, m):
    d = b.fsub(v[0], m)
    return b.fmul(d, d)


_row_sum = _reduction(1, False, _t_first, _add, "sum(x[:n])")
_row_max = _reduction(1, False, _t_first, _max, "max(x[:n])", empty=None)
_row_dot = _reduction(2, False, _t_prod, _add, "sum(a[:n] * b[:n])")
_row_dot_dev = _reduction(3, True, _t_prod_dev, _add, "sum(a[:n] * b[:n] * (x[:n] - m))")
_row_sq_dev = _reduction(1, True, _t_sq_dev, _add, "sum((x[:n] - m)**2)")


@kernel
def row_sum(x, n):
    """sum(x[:n]) in the lanes' order (0 for n <= 0)."""
    return _row_sum(x, n)


@kernel
def row_max(x, n):
    """max(x[:n]) for n >= 1, in the lanes' order (exact: any order gives the same max)."""
    return _row_max(x, n)


@kernel
def row_dot(a, b, n):
    """sum(a[:n] * b[:n]) in the lanes' order (0 for n <= 0)."""
    return _row_dot(a, b, n)


@kernel
def row_dot_dev(a, b, x, m, n):
    """sum(a[:n] * b[:n] * (x[:n] - m)) in the lanes' order (0 for n <= 0)."""
    return _row_dot_dev(a, b, x, F32(m), n)


@kernel
def row_sq_dev(x, m, n):
    """sum((x[:n] - m)**2) in the lanes' order (0 for n <= 0)."""
    return _row_sq_dev(x, F32(m), n)


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the kernels use."""
    x = np.arange(9, dtype=np.float32)
    row_sum(x, 9)
    row_max(x, 9)
    row_dot(x, x, 9)
    row_dot_dev(x, x, x, F32(1.0), 9)
    row_sq_dev(x, F32(1.0), 9)
    exp_f32(F32(-1.0))
