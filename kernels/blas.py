"""float32 GEMM on strided row-major operands, callable from the kernels: ``gemm``.

``np.dot(a, b, out)`` inside njit only takes contiguous operands (it copies, i.e.
allocates, anything else) and always overwrites ``out``. BLAS itself takes a leading
dimension per operand and ``C = alpha * op(A) op(B) + beta * C``, so calling it directly
lets a kernel multiply one head's columns of GPT-2's fused qkv in place (row stride 3C), or
add a product into an accumulator, with no gather and no extra pass.

Which library: the compiled kernels call the external symbol ``simdist_sgemm`` (Fortran
``sgemm`` ABI), bound at import time, in every process, before any kernel is loaded from
numba's cache. The cached machine code refers to the symbol by name, so it stays valid
whichever library a later process binds. ``SIMDIST_BLAS=auto`` (the default) binds
Intel oneMKL's sequential sgemm on an Intel CPU where the ``mkl`` wheel is installed (15-25 %
faster than OpenBLAS at this project's GEMM shapes on a Sapphire Rapids Xeon, measured with
tests' shapes in ``scripts/bench_kernels.py``), and SciPy's OpenBLAS (the one numba's
``np.dot`` uses) everywhere else: on AMD CPUs oneMKL takes slower generic code paths.
``SIMDIST_BLAS=openblas`` or ``mkl`` forces one. oneMKL runs with strict conditional numerical
reproducibility, so results do not depend on the operands' memory alignment (the DP, ZeRO
and resume bitwise guarantees compare runs whose buffers sit at different addresses).
The choice is fixed for the life of a process (``BACKEND`` says which).

Mixed precision (``half_operands``): while a bf16 or fp16 run is training, every ``gemm``
rounds both operands to the half format (round to nearest even) and accumulates in float32,
as a tensor core does. Operands the models store already hold half values (rounding is then
exact); the others (attention probabilities and score gradients, which the kernels keep in
float32 around the softmax) are rounded where a device would round them, as FlashAttention
does. bf16 products run natively on oneMKL's ``gemm_bf16bf16f32`` (AMX or AVX512_BF16) when
the ``mkl`` wheel is installed on an Intel CPU that has them (``SIMDIST_HALF_GEMM=auto``, or
``mkl`` to insist, ``fp32`` to refuse): the operands are packed into 16-bit words and the
products of halves are exact in float32, so the only difference from the float32-BLAS path
(round into float32 words, then sgemm) is the order of the float32 accumulation.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import llvmlite.binding as ll
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import get_cython_function_address, intrinsic

from ._jit import kernel
from .half import BF16, F16, bf16_from_f32, round_bf16, round_f16_value

_SYMBOL = "simdist_sgemm"
_BF16_SYMBOL = "simdist_gemm_bf16"  # Fortran gemm_bf16bf16f32: uint16 a and b
_MODE_SYMBOL = "simdist_gemm_half"  # int32: what gemm does with its operands (below)
# the modes: float32 operands as they are; rounded to bf16 / fp16 in float32 words (sgemm);
# packed to bf16 words for the native product
PLAIN, ROUND_BF16, ROUND_F16, NATIVE_BF16 = 0, BF16, F16, 3
_MKL_CBWR_STRICT = 0x10000  # mkl_cbwr.h


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _find_mkl() -> ctypes.CDLL | None:
    """libmkl_rt from the ``mkl`` wheel (in sys.prefix/lib), sequential threading."""
    # before the library loads: one thread per rank, no OpenMP runtime needed
    os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    for path in sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _strict(lib: ctypes.CDLL) -> None:
    """Strict CNR on the branch MKL would pick for this CPU: bitwise the same result
    whatever the operands' alignment (AUTO itself refuses STRICT)."""
    branch = lib.MKL_CBWR_Get_Auto_Branch()
    if lib.MKL_CBWR_Set(branch | _MKL_CBWR_STRICT) != 0:
        raise RuntimeError(f"oneMKL refused strict reproducibility on branch {branch}")
    lib.MKL_Set_Num_Threads(1)


def _bind() -> tuple[str, bool]:
    """Register the kernels' external symbols with LLVM's symbol table; returns the sgemm
    backend's name and whether bf16 products can run natively."""
    choice = os.environ.get("SIMDIST_BLAS", "auto").lower()
    if choice not in ("openblas", "mkl", "auto"):
        raise ValueError(f"SIMDIST_BLAS must be openblas, mkl or auto, got {choice!r}")
    half = os.environ.get("SIMDIST_HALF_GEMM", "auto").lower()
    if half not in ("fp32", "mkl", "auto"):
        raise ValueError(f"SIMDIST_HALF_GEMM must be fp32, mkl or auto, got {half!r}")
    intel = _cpu_vendor() == "GenuineIntel"
    want_mkl = choice == "mkl" or (choice == "auto" and intel)
    # oneMKL's bf16 product on the CPUs it is written for: Intel with AMX or AVX512_BF16
    want_bf16 = half == "mkl" or (
        half == "auto" and intel and bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())
    )
    lib = _find_mkl() if want_mkl or want_bf16 else None
    if lib is None and "mkl" in (choice, half):
        raise RuntimeError(
            "SIMDIST_BLAS/SIMDIST_HALF_GEMM=mkl but no libmkl_rt found (pip install mkl)"
        )
    if lib is not None:
        _strict(lib)
    sgemm_ = lib.sgemm_ if lib is not None and want_mkl else None
    if sgemm_ is not None:
        ll.add_symbol(_SYMBOL, ctypes.cast(sgemm_, ctypes.c_void_p).value)
    else:
        ll.add_symbol(_SYMBOL, get_cython_function_address("scipy.linalg.cython_blas", "sgemm"))
    native = lib is not None and want_bf16
    # without it the symbol still needs an address for the cached code to link; gemm never
    # calls it then (NATIVE_BF16 is refused by half_operands)
    bf16 = lib.gemm_bf16bf16f32 if native else lib.sgemm_ if lib is not None else None
    address = ctypes.cast(bf16, ctypes.c_void_p).value if bf16 is not None else None
    ll.add_symbol(_BF16_SYMBOL, address or ll.address_of_symbol(_SYMBOL))
    ll.add_symbol(_MODE_SYMBOL, ctypes.addressof(_MODE))
    return ("mkl" if sgemm_ is not None else "openblas"), native


_MODE = ctypes.c_int32(PLAIN)  # read by every gemm call (an external global of the kernels)
BACKEND, NATIVE_BF16_AVAILABLE = _bind()


def half_operands(fmt: int | None, native: bool = True) -> str:
    """From now on (this process), round every gemm's operands to the half format ``fmt``
    (``kernels.half.BF16`` / ``F16``), or stop (None); ``native=False`` keeps bf16 products
    on the float32 BLAS. Returns how the products run, for the run's log."""
    if fmt is None or fmt == 0:
        _MODE.value = PLAIN
        return "fp32"
    if fmt == BF16 and native and NATIVE_BF16_AVAILABLE:
        _MODE.value = NATIVE_BF16
        return "bf16 x bf16 -> fp32 (oneMKL gemm_bf16bf16f32)"
    if fmt not in (BF16, F16):
        raise ValueError(f"unknown half format {fmt}")
    _MODE.value = ROUND_BF16 if fmt == BF16 else ROUND_F16
    name = "bf16" if fmt == BF16 else "fp16"
    return f"fp32 {BACKEND} sgemm on {name}-rounded operands"


def _fortran_gemm(symbol: str):
    """An intrinsic calling Fortran ``?gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
    ldc)`` at ``symbol`` on the data pointers of arrays a, b, c (column-major view of their
    memory; a and b of one element type, float32 or uint16 words); ints are int32."""

    @intrinsic
    def call(typingctx, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        sig = types.void(
            types.uint8, types.uint8, types.int32, types.int32, types.int32, types.float32,
            a, types.int32, b, types.int32, types.float32, c, types.int32,
        )  # fmt: skip

        def codegen(context, builder, signature, args):
            i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
            ab = context.get_data_type(signature.args[6].dtype)
            # Fortran passes everything by reference: scalars go through stack slots
            scalar = [i8, i8, i32, i32, i32, f32, ab, i32, ab, i32, f32, f32, i32]
            arrays = (6, 8, 11)
            fnty = ir.FunctionType(ir.VoidType(), [t.as_pointer() for t in scalar])
            fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            out = []
            for i, (val, ty, llty) in enumerate(zip(args, signature.args, scalar, strict=True)):
                if i in arrays:  # an array: its data pointer (a view's own start)
                    data = context.make_array(ty)(context, builder, val).data
                    out.append(builder.bitcast(data, llty.as_pointer()))
                else:
                    slot = cgutils.alloca_once(builder, llty)
                    builder.store(val, slot)
                    out.append(slot)
            builder.call(fn, out)
            return context.get_dummy_value()

        return sig, codegen

    return call


_sgemm = _fortran_gemm(_SYMBOL)
_gemm_bf16 = _fortran_gemm(_BF16_SYMBOL)


@intrinsic
def _half_mode(typingctx):
    """The process's operand mode (``half_operands``), read from its external global."""

    def codegen(context, builder, signature, args):
        try:
            gv = builder.module.get_global(_MODE_SYMBOL)
        except KeyError:
            gv = ir.GlobalVariable(builder.module, ir.IntType(32), _MODE_SYMBOL)
            gv.linkage = "external"
        return builder.load(gv)

    return types.int32(), codegen


@kernel
def _memory_rows(x):
    """x's 2-D memory as rows (at their stride): x itself ('N'), or x.T for a transposed
    view ('T'), with the BLAS op char that reads them back as x."""
    if x.shape[1] == 1 or x.strides[1] == 4:
        return x, np.uint8(78)
    return x.T, np.uint8(84)


@kernel
def _pack_bf16(x):
    """x's memory rows as contiguous bf16 words, rounded to nearest even:
    (words, op char, leading dim)."""
    rows, op = _memory_rows(x)
    R, C = rows.shape
    out = np.empty((R, C), np.uint16)
    for i in range(R):
        src = rows[i]
        dst = out[i]
        for j in range(C):
            dst[j] = bf16_from_f32(src[j])
    return out, op, np.int32(max(C, 1))


@kernel
def _pack_rounded(x, fmt):
    """As ``_pack_bf16``, in float32 words holding the values rounded to ``fmt``."""
    rows, op = _memory_rows(x)
    R, C = rows.shape
    out = np.empty((R, C), np.float32)
    for i in range(R):
        src = rows[i]
        dst = out[i]
        if fmt == BF16:
            for j in range(C):
                dst[j] = round_bf16(src[j])
        else:
            for j in range(C):
                dst[j] = round_f16_value(src[j])
    return out, op, np.int32(max(C, 1))


@kernel
def _op(x):
    """(BLAS op char, leading dimension) of a 2-D float32 view with one unit stride."""
    if x.shape[1] == 1 or x.strides[1] == 4:  # row-major rows, possibly strided
        return np.uint8(78), np.int32(max(x.strides[0] // 4, x.shape[1], 1))  # 'N'
    if x.shape[0] == 1 or x.strides[0] == 4:  # a transposed view of a row-major matrix
        return np.uint8(84), np.int32(max(x.strides[1] // 4, x.shape[0], 1))  # 'T'
    raise ValueError("gemm operands need a unit stride along one axis")


@kernel
def gemm(a, b, c, alpha, beta):
    """c[m,n] = alpha * a[m,k] @ b[k,n] + beta * c (beta = 0: c is overwritten, not read).

    Operands are 2-D float32 views with a unit stride along one axis: row-major rows at
    any row stride (a slice of columns), or ``.T`` of such a view. ``c`` needs unit column
    stride. alpha and beta are float32.
    """
    m, k = a.shape
    n = c.shape[1]
    if b.shape[0] != k or c.shape[0] != m or b.shape[1] != n:
        raise ValueError("gemm: shapes do not match")
    if c.shape[1] > 1 and c.strides[1] != 4:
        raise ValueError("gemm: c needs unit column stride")
    if m == 0 or n == 0:
        return
    ldc = np.int32(max(c.strides[0] // 4, n, 1))
    opa, lda = _op(a)
    opb, ldb = _op(b)
    # row-major C = A B is column-major C^T = B^T A^T: the column-major view of a row-major
    # operand's memory is its transpose, so B goes first with its own op flag
    mode = _half_mode()
    m32, n32, k32 = np.int32(m), np.int32(n), np.int32(k)
    if mode == PLAIN or k == 0:
        _sgemm(opb, opa, n32, m32, k32, alpha, b, ldb, a, lda, beta, c, ldc)
    elif mode == NATIVE_BF16:
        ha, opa, lda = _pack_bf16(a)
        hb, opb, ldb = _pack_bf16(b)
        _gemm_bf16(opb, opa, n32, m32, k32, alpha, hb, ldb, ha, lda, beta, c, ldc)
    else:
        ra, opa, lda = _pack_rounded(a, mode)
        rb, opb, ldb = _pack_rounded(b, mode)
        _sgemm(opb, opa, n32, m32, k32, alpha, rb, ldb, ra, lda, beta, c, ldc)


def _warm() -> None:
    """Compile (or load from the cache) for the layouts the kernels pass."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.ones((3, 2), np.float32)
    z = np.zeros((2, 2), np.float32)
    gemm(x, y, z, np.float32(1.0), np.float32(0.0))
    gemm(y.T, x.T, z, np.float32(1.0), np.float32(1.0))
