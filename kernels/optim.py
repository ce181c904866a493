"""Element-wise optimizer updates on 1-D float32 slices of the flat parameter/state buffers.

AdamW and SGD reproduce torch.optim's single-tensor CPU arithmetic (``foreach=False``)
operation by operation, so a simdist run can be checked against PyTorch:

- torch computes the per-step scalars (bias corrections, step size, ``1 - lr*wd``, ...) in
  Python float64 and rounds each to float32 where a float32 tensor op consumes it. The
  Python wrappers ``adamw_update``/``sgd_update`` do exactly that, so every jitted kernel
  stays free of float64 arithmetic.
- torch's vectorised CPU kernels fuse some multiply-adds (``lerp_``, ``addcmul_``,
  ``add_(x, alpha=a)`` use FMA; ``addcdiv_`` cannot, a division sits in between). ``_fma``
  below issues the same single-rounding ``llvm.fma.f32`` (numba never contracts a*b + c
  itself with fastmath off), so exp_avg and exp_avg_sq match torch bit for bit.
- torch's float32 ``sqrt`` on CPU goes through MKL and is not always correctly rounded;
  ``np.sqrt`` here is. That is the one remaining source of differences in the parameters
  (a few ulp; tests measure it).
- The updates run with subnormal numbers flushed to zero (x86's FTZ and DAZ, for the call
  only; ``flushing_subnormals``), as TensorFlow runs its CPU kernels and as
  ``torch.set_flush_denormal(True)`` would. A weight whose gradient stays 0 (an MNIST border
  pixel, a dead ReLU unit) has its exp_avg decay by beta1 every step into the subnormal
  range, where every operation on it takes a microcode assist: after 1,500 FC-MNIST steps
  7 % of exp_avg was subnormal and AdamW ran 5x slower (2.8 ms against 0.55). Flushed, such
  a state is exactly 0; the update it would have made is below 1e-30 of the learning rate,
  so the parameters differ from torch's only where a parameter is itself below ~1e-26.

``sum_of_squares`` is the only kernel that returns a value and the only one allowed
float64 arithmetic (see its docstring).
"""

import platform
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._jit import kernel

F32 = np.float32


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (float32), lowered to llvm.fma.f32 (vfmadd on x86)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_FTZ_DAZ = 0x8040  # MXCSR bits: flush-to-zero (15) and denormals-are-zero (6)


@intrinsic
def _swap_mxcsr(typingctx, bits, keep):
    """Return the thread's MXCSR and load ``bits`` into it (or the old value with ``bits``
    or-ed in, when ``keep``): the SSE/AVX control register, rounding and FTZ/DAZ."""
    if not (bits == types.uint32 and keep == types.boolean):
        return None

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p])
        store = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.stmxcsr")
        load = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.ldmxcsr")
        slot = cgutils.alloca_once(builder, i32)
        builder.call(store, [builder.bitcast(slot, i8p)])
        old = builder.load(slot)
        new = builder.select(args[1], builder.or_(old, args[0]), args[0])
        builder.store(new, slot)
        builder.call(load, [builder.bitcast(slot, i8p)])
        return old

    return types.uint32(types.uint32, types.boolean), codegen


if _X86:  # a kernel only where it can compile (the registry warms every kernel)

    @kernel
    def _mxcsr_with(bits, keep):
        return _swap_mxcsr(np.uint32(bits), keep)


@contextmanager
def flushing_subnormals() -> Iterator[None]:
    """Subnormal inputs read as 0 and subnormal results written as 0 inside the block, on
    this thread (x86; elsewhere nothing changes). The register is restored on exit, so no
    other computation (numpy, BLAS, the models) ever runs with it."""
    if not _X86:
        yield
        return
    old = _mxcsr_with(_FTZ_DAZ, True)
    try:
        yield
    finally:
        _mxcsr_with(old, False)


@kernel
def _adamw_kernel(param, grad, m, v, decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps, gscale):
    """AdamW on param/grad/m/v[N] with float32 coefficients precomputed by adamw_update;
    the gradient enters as fl(grad * gscale) (clipping's coefficient, 1 when it clips
    nothing: exact), read and scaled in the update's own pass."""
    one = F32(1.0)
    # torch's lerp: for |w| < 0.5, m + w*(g - m); else g - (g - m)*(1 - w); both as one FMA.
    small = abs(w1) < F32(0.5)
    coeff = w1 if small else w1 - one
    for i in range(param.size):
        g = grad[i] * gscale
        p = param[i] * decay  # param.mul_(1 - lr*wd); decay == 1 when wd == 0 (exact no-op)
        mi = m[i]
        mi = _fma(coeff, g - mi, mi if small else g)  # exp_avg.lerp_(grad, 1 - beta1)
        vi = _fma(w2 * g, g, v[i] * beta2)  # exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
        denom = np.sqrt(vi) / bc2_sqrt + eps
        param[i] = p + (neg_step_size * mi) / denom  # param.addcdiv_(m, denom, -step_size)
        m[i] = mi
        v[i] = vi


@kernel
def _adamw_segments(
    param, grad, m, v, segs, decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps, gscale
):  # fmt: skip
    """_adamw_kernel on each [lo, hi) row of segs (lo, hi, decays): one call per step."""
    one = F32(1.0)
    for s in range(segs.shape[0]):
        lo, hi = segs[s, 0], segs[s, 1]
        d = decay if segs[s, 2] != 0 else one
        _adamw_kernel(
            param[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], d, w1, beta2, w2, neg_step_size,
            bc2_sqrt, eps, gscale,
        )  # fmt: skip


def _adamw_scalars(lr, beta1, beta2, eps, weight_decay, step) -> tuple:
    """The float32 coefficients of one AdamW step, rounded from float64 as torch does."""
    # Scalars exactly as torch.optim.adam._single_tensor_adam computes them: Python
    # float64 (torch keeps its step counter as a float32 tensor; integers < 2**24 are exact
    # either way), then one rounding to float32 where the tensor op consumes them. float()
    # keeps np.float32 arguments from turning this into float32 arithmetic (NEP 50).
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    eps, weight_decay = float(eps), float(weight_decay)
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    decay = 1 - lr * weight_decay if weight_decay != 0 else 1.0
    return (
        F32(decay),
        F32(1 - beta1),
        F32(beta2),
        F32(1 - beta2),
        F32(-(lr / bc1)),
        F32(bc2**0.5),
        F32(eps),
    )


def adamw_update_segments(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    segs: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """``adamw_update`` on every segment of ``segs`` (int64 rows: lo, hi, decays) of the
    1-D buffers in one call, weight decay only where decays != 0: bitwise the per-segment
    calls, without their Python overhead (GPT-2 has 4 + 12 per layer tensors)."""
    scalars = _adamw_scalars(lr, beta1, beta2, eps, weight_decay, step)
    with flushing_subnormals():
        _adamw_segments(param, grad, m, v, segs, *scalars, F32(grad_scale))


def adamw_update(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW step in place on param/m/v[N] (1-D float32, contiguous); step counts from 1.

    p *= 1 - lr*wd; m = lerp(m, g, 1 - b1); v = b2*v + (1 - b2)*g*g;
    p -= (lr / (1 - b1**step)) * m / (sqrt(v) / sqrt(1 - b2**step) + eps)

    Pass the hyperparameters as Python floats, as torch receives them: np.float32(0.9) is
    0.89999998, and 1 - that rounds to a different float32 than 1 - 0.9 does.

    ``grad_scale``: the update takes g = fl(grad * float32(grad_scale)), bitwise what
    scaling the gradient in place first gives (global-norm clipping's coefficient), in the
    update's own pass over the gradient; ``grad`` itself is left as it is.
    """
    scalars = _adamw_scalars(lr, beta1, beta2, eps, weight_decay, step)
    with flushing_subnormals():
        _adamw_kernel(param, grad, m, v, *scalars, F32(grad_scale))


@kernel
def _sgd_kernel(param, grad, buf, neg_lr, momentum, weight_decay, first, gscale):
    """SGD (dampening 0, no nesterov) on param/grad/buf[N] with float32 coefficients; the
    gradient enters as fl(grad * gscale), as in _adamw_kernel."""
    zero = F32(0.0)
    for i in range(param.size):
        p = param[i]
        g = grad[i] * gscale
        if weight_decay != zero:
            g = _fma(p, weight_decay, g)  # grad.add(param, alpha=wd)
        if momentum != zero:
            # buf = clone(grad) at the first step, else buf.mul_(momentum).add_(grad):
            # two separate torch ops, so two roundings (no FMA).
            g = g if first else buf[i] * momentum + g
            buf[i] = g
        param[i] = _fma(g, neg_lr, p)  # param.add_(buf, alpha=-lr)


@kernel
def _sgd_segments(param, grad, buf, segs, neg_lr, momentum, weight_decay, first, gscale):
    """_sgd_kernel on each [lo, hi) row of segs (lo, hi, decays)."""
    zero = F32(0.0)
    for s in range(segs.shape[0]):
        lo, hi = segs[s, 0], segs[s, 1]
        wd = weight_decay if segs[s, 2] != 0 else zero
        _sgd_kernel(param[lo:hi], grad[lo:hi], buf[lo:hi], neg_lr, momentum, wd, first, gscale)


def sgd_update_segments(
    param: np.ndarray,
    grad: np.ndarray,
    momentum_buf: np.ndarray,
    segs: np.ndarray,
    lr: float,
    momentum: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """``sgd_update`` on every segment of ``segs`` in one call (see adamw_update_segments)."""
    lr, momentum, weight_decay = float(lr), float(momentum), float(weight_decay)
    with flushing_subnormals():
        _sgd_segments(
            param, grad, momentum_buf, segs, F32(-lr), F32(momentum), F32(weight_decay),
            step == 1, F32(grad_scale),
        )  # fmt: skip


def sgd_update(
    param: np.ndarray,
    grad: np.ndarray,
    momentum_buf: np.ndarray,
    lr: float,
    momentum: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """One torch.optim.SGD step in place on param[N] (and momentum_buf[N] if momentum != 0).

    g' = g + wd*p; buf = g' at step 1, else momentum*buf + g'; p -= lr*buf
    (momentum 0: p -= lr*g', momentum_buf untouched). step counts from 1.
    Hyperparameters as Python floats; each is rounded to float32 once, as torch does.
    ``grad_scale`` as in ``adamw_update``.
    """
    lr, momentum, weight_decay = float(lr), float(momentum), float(weight_decay)
    with flushing_subnormals():
        _sgd_kernel(
            param, grad, momentum_buf, F32(-lr), F32(momentum), F32(weight_decay), step == 1,
            F32(grad_scale),
        )  # fmt: skip


# The gradient norm's float64 sum runs in LANES interleaved lanes: element i of a slice is
# added to lane i % LANES, each lane in order, and ``combine_lanes`` adds the lanes in one
# fixed order. Four float64 lanes (one 256-bit register) were one dependency chain, an add
# every ~3 cycles: 137 us for FC-MNIST's 669,706 gradients against 41 us for numpy's float32
# dot product of the same array (AMD EPYC 25/17/1). Thirty-two are four independent
# 512-bit registers (eight 256-bit ones on AVX2), enough to keep the loads busy.
LANES = 32


def _vector_fma(builder, a, b, c):
    """a * b + c rounded once, lane by lane (llvm.fma on the vector type: vfmadd)."""
    t = a.type  # e.g. <32 x double>: llvm.fma.v32f64
    elem = "f64" if isinstance(t.element, ir.DoubleType) else "f32"
    fnty = ir.FunctionType(t, [t, t, t])
    fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{t.count}{elem}")
    return builder.call(fn, [a, b, c])


@intrinsic
def _add_squares(typingctx, x, acc):
    """acc[j] += float64(x[LANES * i + j])**2 in order of i, for i < x.size // LANES (x: 1-D
    contiguous float32; acc: LANES float64): the lanes held in one LANES-wide vector. LLVM
    does not vectorise the scalar form of these chains (fastmath off, it keeps them as
    scalar adds), so the vector is written out here: the same multiplies and adds per lane,
    so the same bits. The square of a float32 is exact in float64: only the adds round, so
    the multiply and add are one FMA (the same rounding, one instruction fewer per vector:
    79 -> 69 us for FC-MNIST's 669,712 gradients on Xeon 6/167/1)."""
    if not (
        isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1
        and x.layout == "C" and isinstance(acc, types.Array) and acc.ndim == 1
        and acc.dtype == types.float64 and acc.layout == "C"
    ):  # fmt: skip
        return None
    sig = types.void(x, acc)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        lanes = context.make_array(signature.args[1])(context, builder, args[1])
        i64 = ir.IntType(64)
        vf, vd = ir.VectorType(ir.FloatType(), LANES), ir.VectorType(ir.DoubleType(), LANES)
        where = builder.bitcast(lanes.data, vd.as_pointer())
        acc_v = cgutils.alloca_once_value(builder, builder.load(where, align=8))
        blocks = builder.sdiv(builder.extract_value(arr.shape, 0), ir.Constant(i64, LANES))
        with cgutils.for_range(builder, blocks) as loop:
            ptr = builder.gep(arr.data, [builder.mul(loop.index, ir.Constant(i64, LANES))])
            wide = builder.fpext(builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4), vd)
            builder.store(_vector_fma(builder, wide, wide, builder.load(acc_v)), acc_v)
        builder.store(builder.load(acc_v), where, align=8)
        return context.get_dummy_value()

    return sig, codegen


@kernel
def lane_sum_of_squares(x, first_lane, acc):
    """acc[(first_lane + j) % LANES] += float64(x[j])**2 in order (acc: LANES float64):
    continues the lanes of a slice whose element 0 is this piece's element ``-first_lane``,
    so that pieces summed one after another give the lanes of the slice in one piece
    (weight streaming and pipelines rebuild a slice's sum so). The aligned middle runs in
    the vector of ``_add_squares``."""
    if acc.size != LANES:
        raise ValueError("lane_sum_of_squares: acc must hold LANES float64 lanes")
    n = x.size
    head = min((LANES - first_lane % LANES) % LANES, n)  # elements before lane 0's next
    for j in range(head):
        v = np.float64(x[j])
        acc[(first_lane + j) % LANES] += v * v
    end = head + (n - head) // LANES * LANES
    _add_squares(x[head:end], acc)
    for i in range(end, n):  # lanes 0, 1, ... in order
        v = np.float64(x[i])
        acc[i - end] += v * v


@kernel
def combine_lanes(acc):
    """The lanes' total in one fixed order: lane j + w added into lane j for w = LANES / 2,
    LANES / 4, ..., 1 (halving the vector, as a reduction across a register runs). Adds in
    place (acc[0] ends with the total): nothing allocated."""
    w = LANES // 2
    while w:
        for j in range(w):
            acc[j] += acc[j + w]
        w //= 2
    return acc[0]


@intrinsic
def _sum_of_squares(typingctx, x):
    """``lane_sum_of_squares`` from zero lanes and then ``combine_lanes``, the same adds in
    the same order, with the lanes in one vector held in registers (so the gradient norm
    allocates nothing): the aligned blocks, the tail into lanes 0, 1, ..., then the vector
    halved and its halves added until one lane is left."""
    if not (
        isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1
        and x.layout == "C"
    ):  # fmt: skip
        return None
    sig = types.float64(x)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        i32, i64, f64 = ir.IntType(32), ir.IntType(64), ir.DoubleType()
        vf, vd = ir.VectorType(ir.FloatType(), LANES), ir.VectorType(f64, LANES)
        acc = cgutils.alloca_once_value(builder, ir.Constant(vd, None))  # zeros
        n = builder.extract_value(arr.shape, 0)
        blocks = builder.sdiv(n, ir.Constant(i64, LANES))
        with cgutils.for_range(builder, blocks) as loop:
            ptr = builder.gep(arr.data, [builder.mul(loop.index, ir.Constant(i64, LANES))])
            wide = builder.fpext(builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4), vd)
            builder.store(_vector_fma(builder, wide, wide, builder.load(acc)), acc)
        end = builder.mul(blocks, ir.Constant(i64, LANES))
        with cgutils.for_range(builder, builder.sub(n, end)) as loop:  # lanes 0, 1, ...
            at = builder.gep(arr.data, [builder.add(end, loop.index)])
            v = builder.fpext(builder.load(at), f64)
            lane = builder.trunc(loop.index, i32)
            cur = builder.load(acc)
            added = builder.fadd(builder.extract_element(cur, lane), builder.fmul(v, v))
            builder.store(builder.insert_element(cur, added, lane), acc)
        total = builder.load(acc)
        w = LANES // 2
        while w:  # lane j + w into lane j: combine_lanes' order
            half = [ir.Constant(ir.VectorType(i32, w), list(range(k, k + w))) for k in (0, w)]
            lo, hi = (builder.shuffle_vector(total, total, m) for m in half)
            total = builder.fadd(lo, hi)
            w //= 2
        return builder.extract_element(total, ir.Constant(i32, 0))

    return sig, codegen


@kernel
def sum_of_squares(x):
    """sum(x[N]**2) as a float (float64): the one reduction that returns a value.

    float64 on purpose: the square of a float32 is exact in float64 and the sum's relative
    error stays ~1e-16 * N, so the global gradient norm used for clipping does not depend on
    how the flat buffer is sliced (up to that tiny error). LANES interleaved accumulators in
    a fixed order (``_sum_of_squares``: the order of ``lane_sum_of_squares`` and
    ``combine_lanes``; the same result on every call for the same input). That order is a
    contract: weight streaming and pipelines rebuild this exact sum from pieces with those
    two kernels.
    """
    return _sum_of_squares(x)


@kernel
def scale_inplace(x, s):
    """x[N] *= s in float32 (gradient clipping, loss scaling)."""
    s32 = F32(s)  # a float64 caller costs one truncation, not a float64 loop
    for i in range(x.size):
        x[i] *= s32


def _warm() -> None:
    """Compile (or load from cache) for 1-D contiguous float32 slices of a flat buffer."""
    flat = np.ones(8, F32)
    param, grad, m, v = flat[0:2], flat[2:4], flat[4:6], flat[6:8]
    adamw_update(param, grad, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
    sgd_update(param, grad, m, 1e-2, 0.9, 1e-4, 1)
    sum_of_squares(grad)
    # its callees too, so their Python-visible dispatchers carry a signature (pipelines and
    # weight streaming call them; a caller loaded from the cache never compiles them)
    acc = np.zeros(LANES)
    lane_sum_of_squares(grad, 1, acc)
    combine_lanes(acc)
    scale_inplace(grad, F32(0.5))
    segs = np.array([[0, 1, 1], [1, 2, 0]], np.int64)
    adamw_update_segments(param, grad, m, v, segs, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
    sgd_update_segments(param, grad, m, segs, 1e-2, 0.9, 1e-4, 1)
    if _X86:
        _mxcsr_with(_mxcsr_with(0, True), False)
