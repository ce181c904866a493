"""16-bit floating-point formats as the accelerators store them: bfloat16 and IEEE float16.

A half-precision tensor is held as ``uint16`` words (so its memory really is half), and
every conversion from float32 rounds to nearest, ties to even, as tensor-core hardware and
PyTorch do. Widening is exact. NaN stays NaN (quiet, sign kept); float16 overflows to
infinity from 65520 up (the first value that rounds past 65504) and keeps its subnormals
(no flush to zero).

The scalar conversions are numba functions that other kernels call inline (a bitcast, a
few integer operations: LLVM vectorises the loops around them); the array versions write
into caller buffers, like every kernel here. ``round_bf16`` / ``round_f16`` give the
float32 value a half-precision store and reload would give.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._jit import kernel

F32 = np.float32


@intrinsic
def f32_as_u32(typingctx, x):
    """The bits of a float32, as uint32 (a bitcast, no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@intrinsic
def u32_as_f32(typingctx, u):
    """The float32 whose bits are ``u`` (a uint32)."""
    if u != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(u), codegen


# The bit manipulation below works on int64: numba types mixed unsigned/literal arithmetic
# as float64, while int64 stays integer and LLVM still vectorises it.


@kernel
def bf16_from_f32(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = np.int64(f32_as_u32(x))
    if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN: keep it quiet
        return np.uint16((u >> 16) | 0x0040)
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@kernel
def f32_from_bf16(h):
    """bfloat16 bits -> float32 (exact)."""
    return u32_as_f32(np.uint32(np.int64(h) << 16))


@kernel
def f16_from_f32(x):
    """float32 -> IEEE float16 bits (uint16), round to nearest even, subnormals kept."""
    u = np.int64(f32_as_u32(x))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN: quiet, top payload bits kept
        return np.uint16(sign | 0x7E00 | ((a >> 13) & 0x3FF))
    if a >= 0x477FF000:  # >= 65520 (and inf): rounds past the largest half, 65504
        return np.uint16(sign | 0x7C00)
    if a >= 0x38800000:  # a normal half: round 13 bits away, then rebias the exponent
        return np.uint16(sign | (((a + 0x0FFF + ((a >> 13) & 1)) >> 13) - (112 << 10)))
    if a <= 0x33000000:  # at most 2^-25, half the smallest subnormal: ties to zero
        return np.uint16(sign)
    # subnormal half: the value in units of 2^-24, i.e. the significand shifted right
    shift = 126 - (a >> 23)  # 14 .. 24
    m = (a & 0x7FFFFF) | 0x800000
    q = m >> shift
    rest = m - (q << shift)
    half_ulp = np.int64(1) << (shift - 1)
    if rest > half_ulp or (rest == half_ulp and (q & 1) == 1):
        q += 1
    return np.uint16(sign | q)


@kernel
def f32_from_f16(h):
    """IEEE float16 bits -> float32 (exact)."""
    h64 = np.int64(h)
    sign = (h64 & 0x8000) << 16
    e = (h64 >> 10) & 0x1F
    m = h64 & 0x3FF
    if e == 0x1F:  # inf / NaN
        return u32_as_f32(np.uint32(sign | 0x7F800000 | (m << 13)))
    if e == 0:  # zero or subnormal: m * 2^-24, exact in float32
        v = np.float32(m) * np.float32(5.9604644775390625e-08)
        return -v if sign else v
    return u32_as_f32(np.uint32(sign | ((e + 112) << 23) | (m << 13)))


@kernel
def round_bf16(x):
    """x rounded to the nearest bfloat16, as float32."""
    return f32_from_bf16(bf16_from_f32(x))


@kernel
def round_f16(x):
    """x rounded to the nearest float16, as float32."""
    return f32_from_f16(f16_from_f32(x))


@kernel
def to_bf16(out, x):
    """out (uint16) = bfloat16 of x (float32), elementwise over flat buffers."""
    for i in range(x.size):
        out[i] = bf16_from_f32(x[i])


@kernel
def from_bf16(out, h):
    """out (float32) = h (bfloat16 bits), elementwise."""
    for i in range(h.size):
        out[i] = f32_from_bf16(h[i])


@kernel
def to_f16(out, x):
    """out (uint16) = float16 of x (float32), elementwise over flat buffers."""
    for i in range(x.size):
        out[i] = f16_from_f32(x[i])


@kernel
def from_f16(out, h):
    """out (float32) = h (float16 bits), elementwise."""
    for i in range(h.size):
        out[i] = f32_from_f16(h[i])


# Formats by number, for kernels that serve both (a run picks one when it starts).
BF16, F16 = 1, 2


@kernel
def round_half(x, fmt):
    """x (float32, flat) rounded in place to the half format ``fmt`` (BF16 or F16): the
    value a device that stores x in that format holds."""
    if fmt == BF16:
        for i in range(x.size):
            x[i] = f32_from_bf16(bf16_from_f32(x[i]))
    else:
        for i in range(x.size):
            x[i] = f32_from_f16(f16_from_f32(x[i]))


@kernel
def round_half_into(out, x, fmt):
    """out = x rounded to the half format ``fmt`` (flat float32 buffers of one size)."""
    if fmt == BF16:
        for i in range(x.size):
            out[i] = f32_from_bf16(bf16_from_f32(x[i]))
    else:
        for i in range(x.size):
            out[i] = f32_from_f16(f16_from_f32(x[i]))


@kernel
def pack_half(out, x, fmt):
    """out (uint16) = the half words of x (float32): a message in the half format."""
    if fmt == BF16:
        for i in range(x.size):
            out[i] = bf16_from_f32(x[i])
    else:
        for i in range(x.size):
            out[i] = f16_from_f32(x[i])


@kernel
def unpack_half(out, h, fmt):
    """out (float32) = the values of the half words h (exact)."""
    if fmt == BF16:
        for i in range(h.size):
            out[i] = f32_from_bf16(h[i])
    else:
        for i in range(h.size):
            out[i] = f32_from_f16(h[i])


@kernel
def add_half(acc, h, fmt):
    """acc = half(acc + value of h): a half-precision reduction step (the addition in
    float32, the sum stored in the half format, as a device reducing half buffers does)."""
    if fmt == BF16:
        for i in range(h.size):
            acc[i] = f32_from_bf16(bf16_from_f32(acc[i] + f32_from_bf16(h[i])))
    else:
        for i in range(h.size):
            acc[i] = f32_from_f16(f16_from_f32(acc[i] + f32_from_f16(h[i])))


def _warm() -> None:
    """Compile (or load from cache) every kernel here for flat float32 / uint16 buffers."""
    x = np.ones(4, F32)
    h = np.zeros(4, np.uint16)
    for fmt in (BF16, F16):
        round_half(x, fmt)
        round_half_into(x, x, fmt)
        pack_half(h, x, fmt)
        unpack_half(x, h, fmt)
        add_half(x, h, fmt)
    to_bf16(h, x)
    from_bf16(x, h)
    to_f16(h, x)
    from_f16(x, h)
