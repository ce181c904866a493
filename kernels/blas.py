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

_SYMBOL = "simdist_sgemm"
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


def _bind() -> str:
    """Register ``simdist_sgemm`` with LLVM's symbol table; returns the backend's name."""
    choice = os.environ.get("SIMDIST_BLAS", "auto").lower()
    if choice not in ("openblas", "mkl", "auto"):
        raise ValueError(f"SIMDIST_BLAS must be openblas, mkl or auto, got {choice!r}")
    if choice == "mkl" or (choice == "auto" and _cpu_vendor() == "GenuineIntel"):
        lib = _find_mkl()
        if lib is not None:
            # strict CNR on the branch MKL would pick for this CPU: bitwise the same
            # result whatever the operands' alignment (AUTO itself refuses STRICT)
            branch = lib.MKL_CBWR_Get_Auto_Branch()
            if lib.MKL_CBWR_Set(branch | _MKL_CBWR_STRICT) != 0:
                raise RuntimeError(f"oneMKL refused strict reproducibility on branch {branch}")
            lib.MKL_Set_Num_Threads(1)
            ll.add_symbol(_SYMBOL, ctypes.cast(lib.sgemm_, ctypes.c_void_p).value)
            return "mkl"
        if choice == "mkl":
            raise RuntimeError("SIMDIST_BLAS=mkl but no libmkl_rt found (pip install mkl)")
    ll.add_symbol(_SYMBOL, get_cython_function_address("scipy.linalg.cython_blas", "sgemm"))
    return "openblas"


BACKEND = _bind()


@intrinsic
def _sgemm(typingctx, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Fortran sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) on the data
    pointers of arrays a, b, c (column-major view of their memory); ints are int32."""
    sig = types.void(
        types.uint8, types.uint8, types.int32, types.int32, types.int32, types.float32,
        a, types.int32, b, types.int32, types.float32, c, types.int32,
    )  # fmt: skip

    def codegen(context, builder, signature, args):
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        # Fortran passes everything by reference: scalars go through stack slots
        scalar = [i8, i8, i32, i32, i32, f32, None, i32, None, i32, f32, None, i32]
        fnty = ir.FunctionType(ir.VoidType(), [(t or f32).as_pointer() for t in scalar])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _SYMBOL)
        out = []
        for val, ty, llty in zip(args, signature.args, scalar, strict=True):
            if llty is None:  # an array: its data pointer (a view's own start)
                data = context.make_array(ty)(context, builder, val).data
                out.append(builder.bitcast(data, f32.as_pointer()))
            else:
                slot = cgutils.alloca_once(builder, llty)
                builder.store(val, slot)
                out.append(slot)
        builder.call(fn, out)
        return context.get_dummy_value()

    return sig, codegen


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
    _sgemm(opb, opa, np.int32(n), np.int32(m), np.int32(k), alpha, b, ldb, a, lda, beta, c, ldc)


def _warm() -> None:
    """Compile (or load from the cache) for the layouts the kernels pass."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.ones((3, 2), np.float32)
    z = np.zeros((2, 2), np.float32)
    gemm(x, y, z, np.float32(1.0), np.float32(0.0))
    gemm(y.T, x.T, z, np.float32(1.0), np.float32(1.0))
