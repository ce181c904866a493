"""float32 GEMM on strided row-major operands, callable from the kernels: ``gemm``.

``np.dot(a, b, out)`` inside njit only takes contiguous operands (it copies, i.e.
allocates, anything else) and always overwrites ``out``. BLAS itself takes a leading
dimension per operand and ``C = alpha * op(A) op(B) + beta * C``, so calling it directly
lets a kernel multiply one head's columns of GPT-2's fused qkv in place (row stride 3C), or
add a product into an accumulator, with no gather and no extra pass.

Which library: the compiled kernels call the external symbol ``simdist_sgemm`` (Fortran
``sgemm`` ABI), bound at import time, in every process, before any kernel is loaded from
numba's cache. The cached machine code refers to the symbol by name, so it stays valid
whichever library a later process binds. ``SIMDIST_BLAS=auto`` (the default) binds Intel
oneMKL's sequential sgemm on an Intel CPU where the ``mkl`` wheel is installed (15-25 %
faster than OpenBLAS at this project's GEMM shapes on a Sapphire Rapids Xeon, measured with
tests' shapes in ``scripts/bench_kernels.py``; products with fewer than 16 columns, where
OpenBLAS is the faster, stay on OpenBLAS: ``on_openblas_narrow``); on other CPUs with
AVX-512 (AMD's Zen 4 and 5, where oneMKL takes slower generic code paths) oneDNN's
``dnnl_sgemm`` where the ``onednn`` extra is installed, for the products ``on_onednn``
picks by shape (inner dimension and columns >= 64, k * n >= 8192: 1.1-1.6x OpenBLAS's there
on Zen 4); OpenBLAS
for everything else: the one numpy's wheel bundles (an ILP64 build, 64-bit integers) where
there is one, else SciPy's (the one numba's ``np.dot`` uses). In this project's venvs
numpy's is the newer (0.3.31 against 0.3.30): the same kernels and bits here, 1.04-1.12x
as fast on FC-MNIST's products and 1.00-1.13x on gpt2-mini's on AMD Zen 3
(``bench_kernels.py --openblas-pair``). ``SIMDIST_BLAS=openblas``, ``scipy-openblas``,
``mkl`` or ``onednn`` forces one; ``library()`` names what runs. oneMKL runs with strict
conditional numerical reproducibility and oneDNN's sgemm gives the same bits at any
operand address (tested), so results do not depend on alignment (the DP, ZeRO and resume
bitwise guarantees compare runs whose buffers sit at different addresses). The choice is
fixed for the life of a process (``BACKEND`` says which); every rank of a job must make the
same one for the ranks to compute the same bits.

Mixed precision (``half_operands``): while a bf16 or fp16 run is training, every ``gemm``
multiplies half-precision operands and accumulates in float32, as a tensor core does. The
models store what enters a product already rounded to the half format (weights, activations,
activation gradients; attention rounds its float32 probabilities and score gradients where
they enter a product, as FlashAttention does), so on the float32 BLAS the products of halves
are exact and nothing needs converting: gemm calls sgemm as it is. That contract is checked,
not assumed: ``SIMDIST_HALF_GEMM_CHECK=1`` (the tests set it) makes every gemm verify that
both operands hold half values and raise otherwise. bf16 products run natively where the
CPU has bf16 dot products (AVX512_BF16 or AMX, read from /proc/cpuinfo) and a library for
them is installed (``SIMDIST_HALF_GEMM=auto``): oneMKL's ``gemm_bf16bf16f32`` (the ``mkl``
extra) on an Intel CPU, else oneDNN's ``dnnl_gemm_bf16bf16f32`` (the ``onednn`` extra; the
one AMD's Zen 4 and 5 get); ``mkl`` or ``onednn`` insists on one, ``fp32`` refuses both.
The operands are then packed into 16-bit words per call, into two buffers kept between
calls; small products stay on sgemm, where the native kernels are slower (``takes_native``,
a rule on the shape alone). Products of halves are exact in float32, so the only difference
from the float32-BLAS path is the order of the float32 accumulation (tested).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import llvmlite.binding as ll
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import get_cython_function_address, intrinsic

from ._jit import kernel
from .half import BF16, F16, bf16_from_f32, round_bf16, round_f16_value

_SYMBOL = "simdist_sgemm"
_BF16_SYMBOL = "simdist_gemm_bf16"  # Fortran gemm_bf16bf16f32 (oneMKL): uint16 a and b
_DNNL_SYMBOL = "simdist_dnnl_bf16"  # C dnnl_gemm_bf16bf16f32 (oneDNN): row-major, by value
_DNNL_SGEMM_SYMBOL = "simdist_dnnl_sgemm"  # C dnnl_sgemm (oneDNN): row-major, by value
_SGEMM64_SYMBOL = "simdist_sgemm64"  # Fortran sgemm, 64-bit integers (numpy's OpenBLAS)
_MODE_SYMBOL = "simdist_gemm_half"  # int32: what gemm does with its operands (below)
_SCRATCH_SYMBOL = "simdist_gemm_scratch"  # int64[4]: the packed operands' buffers (below)
_ALLOC_SYMBOL, _FREE_SYMBOL = "simdist_aligned_alloc", "simdist_free"  # libc's
# The mode word: the operands' format in its low bits (0: float32, BF16, F16), which native
# product runs bf16 (packed into 16-bit words for oneMKL or oneDNN), whether to verify
# that both operands hold half values, and the float32 library (oneDNN's sgemm for the
# products on_onednn gives it; numpy's ILP64 OpenBLAS instead of the int32 symbol).
PLAIN, FORMAT_BITS, NATIVE_MKL, NATIVE_DNNL, CHECK, SGEMM_DNNL, SGEMM_ILP64 = 0, 3, 4, 8, 16, 32, 64
NATIVE_EVERY_SHAPE = 128  # benchmarks only: the native kernel for every bf16 product
SGEMM_NARROW = 256  # oneMKL's sgemm, but numpy's OpenBLAS where C is narrow (on_openblas_narrow)
# The native bf16 kernels block C in wide panels: with fewer than about 96 rows or columns
# of C (attention's per-head products at head size 64 or less, a classifier's 10 columns)
# they ran slower than sgemm on the same halves on Zen 4 with oneDNN 3.2, and faster above
# (single-thread process-time sweep of shapes; the end-to-end effect is what
# scripts/bench_precision.py measures). Those products stay on the float32 BLAS: equal
# products, float32 sums, a choice made by the shape alone (runs stay deterministic).
_NATIVE_MIN = 96
# oneMKL's bf16 kernel (AMX on a Xeon, family/model 6/207), its operands packed into reused
# buffers, beat its sgemm on the same halves 1.5-3.4x on the models' layers (128-1024 rows,
# k >= 128) and lost on most products whose inner dimension is 10-32 (0.41-0.81x), in
# isolation (``scripts/bench_kernels.py --native-grid``). Inside attention, between its
# softmax passes, the per-head products (128x64x128 and the like, 1M multiply-adds) ran
# slower on it than on sgemm (``scripts/bench_kernels.py --attention``), although alone
# they ran faster. So on oneMKL: >= 96 rows, inner dimension >= 64, and >= 2^21
# multiply-adds.
_MKL_NATIVE_MIN_K, _MKL_NATIVE_MIN_VOLUME = 64, 1 << 21
# oneDNN's sgemm (SIMDIST_BLAS=onednn) beat OpenBLAS's on Zen 4 where the inner dimension
# and C's columns are both >= 64 with k * n >= 8192 (attention's per-head products at head
# size 64 and up, every layer's) and at most one operand is transposed, and lost on smaller
# products (64^3, a classifier's 10 columns) and on most A^T B^T (``SIMDIST_BLAS=openblas
# python scripts/bench_kernels.py --blas-grid``). The rule reads k and n, not the rows m
# (the batch in the forward's products), so a product split by rows (micro-batches) stays
# on oneDNN. Not bit for bit: oneDNN, like OpenBLAS's small-matrix kernels, picks its kernel
# by the row count too (a single row, fewer than 16), and no guarantee of simdist's needs it
# (its bitwise comparisons run the same products at other addresses: same bits, tested).
_DNNL_SGEMM_MIN_SIDE, _DNNL_SGEMM_MIN_AREA = 64, 8192
# oneMKL in strict CNR mode ran products with fewer than 16 columns of C (a classifier's 10,
# a 2-label head) 1.2-6x slower than numpy's OpenBLAS on every layout (Xeon 6/167/1:
# 128x512x10 nn 39.5 against 18.5 us, 512x128x10 tn 37.9 against 15.7) and as fast or faster
# from 16 columns up (``SIMDIST_BLAS=mkl python scripts/bench_kernels.py --narrow``). Beside
# oneMKL those products go to numpy's OpenBLAS (whose bits do not depend on the operands'
# addresses either); the rule reads n alone, so every rank makes the same choice.
_MKL_MIN_COLUMNS = 16
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


def _find_lib(pattern: str) -> ctypes.CDLL | None:
    """A library a wheel installed into sys.prefix/lib (the ``mkl`` and ``onednn`` extras)."""
    for path in sorted(glob.glob(os.path.join(sys.prefix, "lib", pattern))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _find_mkl() -> ctypes.CDLL | None:
    """libmkl_rt from the ``mkl`` wheel, sequential threading."""
    # before the library loads: one thread per rank, no OpenMP runtime needed
    os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    return _find_lib("libmkl_rt.so*")


def _find_dnnl() -> ctypes.CDLL | None:
    """libdnnl from the ``onednn-cpu-gomp`` wheel (GNU OpenMP, one thread: simdist's
    OMP_NUM_THREADS=1 is set before it loads), if it exports the bf16 GEMM."""
    lib = _find_lib("libdnnl.so*")
    return lib if lib is not None and hasattr(lib, "dnnl_gemm_bf16bf16f32") else None


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


def _bind() -> tuple[str, str | None]:
    """Register the kernels' external symbols with LLVM's symbol table; returns the sgemm
    backend's name and the library running bf16 products natively (None: none here)."""
    choice = os.environ.get("SIMDIST_BLAS", "auto").lower()
    if choice not in ("openblas", "scipy-openblas", "mkl", "onednn", "auto"):
        raise ValueError(
            f"SIMDIST_BLAS must be openblas, scipy-openblas, mkl, onednn or auto, got {choice!r}"
        )
    half = os.environ.get("SIMDIST_HALF_GEMM", "auto").lower()
    if half not in ("fp32", "mkl", "onednn", "auto"):
        raise ValueError(f"SIMDIST_HALF_GEMM must be fp32, mkl, onednn or auto, got {half!r}")
    intel = _cpu_vendor() == "GenuineIntel"
    bf16_isa = bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())
    want_mkl = choice == "mkl" or (choice == "auto" and intel)
    # oneMKL's bf16 product on the CPUs it is written for (Intel with AMX or AVX512_BF16);
    # oneDNN's wherever the ISA is there (it picks its kernels by CPUID, AMD's too)
    mkl_bf16 = half == "mkl" or (half == "auto" and intel and bf16_isa)
    lib = _find_mkl() if want_mkl or mkl_bf16 else None
    if lib is None and "mkl" in (choice, half):
        raise RuntimeError(
            "SIMDIST_BLAS/SIMDIST_HALF_GEMM=mkl but no libmkl_rt found (pip install mkl)"
        )
    if lib is not None:
        _strict(lib)
    dnnl = None
    if half == "onednn" or (half == "auto" and bf16_isa and not (mkl_bf16 and lib)):
        dnnl = _find_dnnl()
        if dnnl is None and half == "onednn":
            raise RuntimeError(
                "SIMDIST_HALF_GEMM=onednn but no libdnnl with dnnl_gemm_bf16bf16f32 found "
                "(pip install onednn-cpu-gomp)"
            )
    # oneDNN's sgemm where the library is installed (auto: on AVX-512 CPUs other than
    # Intel's, where oneMKL serves; measured on AMD Zen 4, see on_onednn)
    sgemm_dnnl = None
    if choice == "onednn" or (choice == "auto" and not intel and "avx512f" in _cpu_flags()):
        found = _find_lib("libdnnl.so*")
        sgemm_dnnl = getattr(found, "dnnl_sgemm", None) if found is not None else None
        if sgemm_dnnl is None and choice == "onednn":
            raise RuntimeError(
                "SIMDIST_BLAS=onednn but no libdnnl with dnnl_sgemm found "
                "(pip install onednn-cpu-gomp)"
            )
    sgemm_ = lib.sgemm_ if lib is not None and want_mkl else None
    if sgemm_ is not None:
        ll.add_symbol(_SYMBOL, ctypes.cast(sgemm_, ctypes.c_void_p).value)
    else:  # OpenBLAS: the whole sgemm, or (oneDNN) the products on_onednn leaves to it
        ll.add_symbol(_SYMBOL, _scipy_sgemm())
    # numpy's own OpenBLAS (64-bit integers) in place of SciPy's where numpy ships one;
    # beside oneMKL, for the narrow products (on_openblas_narrow)
    sgemm64 = _numpy_openblas_sgemm() if choice != "scipy-openblas" else None
    ll.add_symbol(_SGEMM64_SYMBOL, sgemm64 or ll.address_of_symbol(_SYMBOL))
    ll.add_symbol(_DNNL_SGEMM_SYMBOL, _address(sgemm_dnnl) or ll.address_of_symbol(_SYMBOL))
    if sgemm_dnnl is not None:
        _BASE_MODE.value |= SGEMM_DNNL
    if sgemm64 is not None:
        _BASE_MODE.value |= SGEMM_NARROW if sgemm_ is not None else SGEMM_ILP64
    native = "mkl" if lib is not None and mkl_bf16 else "onednn" if dnnl is not None else None
    # every symbol needs an address for the cached code to link, used or not: half_operands
    # never selects a native path this process lacks
    bf16 = lib.gemm_bf16bf16f32 if native == "mkl" else None
    ll.add_symbol(_BF16_SYMBOL, _address(bf16) or ll.address_of_symbol(_SYMBOL))
    c_bf16 = dnnl.dnnl_gemm_bf16bf16f32 if dnnl is not None else None
    ll.add_symbol(_DNNL_SYMBOL, _address(c_bf16) or ll.address_of_symbol(_SYMBOL))
    ll.add_symbol(_MODE_SYMBOL, ctypes.addressof(_MODE))
    ll.add_symbol(_SCRATCH_SYMBOL, ctypes.addressof(_SCRATCH))
    ll.add_symbol(_ALLOC_SYMBOL, _address(_LIBC.aligned_alloc))
    ll.add_symbol(_FREE_SYMBOL, _address(_LIBC.free))
    backend = "mkl" if sgemm_ is not None else "onednn" if sgemm_dnnl is not None else "openblas"
    return backend, native


def _scipy_sgemm() -> int:
    """The address of scipy's BLAS sgemm (the export of scipy.linalg.cython_blas, numba's
    way to reach it). The extension is loaded by itself: importing it the usual way imports
    scipy.linalg first, ~0.4 s on every rank of every run for one pointer. It stays in
    sys.modules under its name, where numba's own check for BLAS (on its first compile or
    cache load) finds it too. (A later ``import scipy.linalg`` works as usual but does not
    bind the attribute ``scipy.linalg.cython_blas``; ``from scipy.linalg import
    cython_blas`` does.)"""
    name = "scipy.linalg.cython_blas"
    module = sys.modules.get(name)
    if module is None:
        scipy = importlib.util.find_spec("scipy")
        folder = Path(scipy.origin).parent / "linalg" if scipy and scipy.origin else None
        found = [folder / f"cython_blas{x}" for x in EXTENSION_SUFFIXES] if folder else []
        found = [p for p in found if p.is_file()]
        if not found:  # an unusual layout: the usual import
            return get_cython_function_address(name, "sgemm")
        spec = importlib.util.spec_from_file_location(name, found[0])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    capsule = module.__pyx_capi__["sgemm"]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get_pointer(capsule, get_name(capsule))


def _bundled_openblas(package: str, suffix: str) -> ctypes.CDLL | None:
    """The OpenBLAS a wheel of ``package`` bundles (``<package>.libs/libscipy_openblas*``,
    already loaded by the package itself), if it exports the Fortran sgemm under the
    wheel's name (``scipy_sgemm`` + ``suffix``); else None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        return None
    libs = Path(spec.origin).parent.parent / f"{package}.libs"
    for path in sorted(libs.glob(f"libscipy_openblas{'64_' if '64' in suffix else ''}-*.so")):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        if hasattr(lib, f"scipy_sgemm{suffix}"):
            return lib
    return None


def _numpy_openblas_sgemm() -> int | None:
    """numpy's OpenBLAS (ILP64: 64-bit integers): the kernels' OpenBLAS wherever numpy's
    wheel ships one (see the module's docstring for why)."""
    lib = _bundled_openblas("numpy", "_64_")
    return _address(lib.scipy_sgemm_64_) if lib is not None else None


def library() -> str:
    """What runs the float32 products, with the version and kernel set OpenBLAS reports
    (for benchmark records), e.g. "openblas 0.3.31.188.0 (numpy's, ILP64; Haswell)";
    with oneDNN, "onednn + " the OpenBLAS of the products it leaves."""
    if BACKEND == "mkl":
        if _BASE_MODE.value & SGEMM_NARROW:
            return f"mkl + {_openblas_library()} below {_MKL_MIN_COLUMNS} columns"
        return BACKEND
    if BACKEND == "onednn":
        return "onednn + " + _openblas_library()
    return _openblas_library()


def _openblas_library() -> str:
    ilp64 = bool(_BASE_MODE.value & (SGEMM_ILP64 | SGEMM_NARROW))
    suffix = "64_" if ilp64 else ""
    lib = _bundled_openblas("numpy", "_64_") if ilp64 else _bundled_openblas("scipy", "_")
    where = "numpy's, ILP64" if ilp64 else "SciPy's"
    config = getattr(lib, f"scipy_openblas_get_config{suffix}", None) if lib else None
    core = getattr(lib, f"scipy_openblas_get_corename{suffix}", None) if lib else None
    if config is None or core is None:
        return f"openblas ({where})"
    config.restype = core.restype = ctypes.c_char_p
    words = config().decode().split()  # "OpenBLAS 0.3.31 DYNAMIC_ARCH NO_AFFINITY ..."
    version = words[1] if len(words) > 1 else "?"
    return f"openblas {version} ({where}; {core().decode()})"


def _address(fn) -> int | None:
    return ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None


_MODE = ctypes.c_int32(PLAIN)  # read by every gemm call (an external global of the kernels)
_BASE_MODE = ctypes.c_int32(PLAIN)  # the float32 library's bit (SGEMM_DNNL), set by _bind
# The native bf16 path's two packed operands live in buffers kept between calls (pointer and
# capacity in 16-bit words, per operand), grown by the kernels with libc's aligned_alloc and
# released by half_operands(None), so no call packs into freshly allocated pages (their
# first-touch faults; with them, gpt2-mini's bf16 step was slower than fp32's on a Xeon:
# README, scripts/bench_precision.py).
# Only the main thread runs kernels (the watchdog thread computes nothing).
_SCRATCH = (ctypes.c_int64 * 4)()
_LIBC = ctypes.CDLL(None)
BACKEND, NATIVE_BF16 = _bind()
_MODE.value = _BASE_MODE.value
NATIVE_BF16_AVAILABLE = NATIVE_BF16 is not None
_NATIVE_NAMES = {
    "mkl": "oneMKL gemm_bf16bf16f32",
    "onednn": "oneDNN dnnl_gemm_bf16bf16f32",
}


def half_operands(fmt: int | None, native: bool = True, every_shape: bool = False) -> str:
    """From now on (this process), every gemm multiplies operands in the half format ``fmt``
    (``kernels.half.BF16`` / ``F16``), or plain float32 again (None); ``native=False`` keeps
    bf16 products on the float32 BLAS; ``every_shape=True`` (benchmarks) puts every bf16
    product on the native kernel, whatever ``takes_native`` says. ``SIMDIST_HALF_GEMM_CHECK=1``
    adds the check that the operands hold half values. Returns how the products run, for the
    run's log."""
    base = _BASE_MODE.value
    if fmt is None or fmt == 0:
        _MODE.value = base
        _release_scratch()
        return f"fp32 {BACKEND} sgemm"
    if fmt not in (BF16, F16):
        raise ValueError(f"unknown half format {fmt}")
    check = CHECK if os.environ.get("SIMDIST_HALF_GEMM_CHECK", "0") not in ("", "0") else 0
    name = "bf16" if fmt == BF16 else "fp16"
    if fmt == BF16 and native and NATIVE_BF16 is not None:
        every = NATIVE_EVERY_SHAPE if every_shape else 0
        lib = NATIVE_MKL if NATIVE_BF16 == "mkl" else NATIVE_DNNL
        _MODE.value = fmt | lib | every | check | base
        return f"bf16 x bf16 -> fp32 ({_NATIVE_NAMES[NATIVE_BF16]})"
    _MODE.value = fmt | check | base
    return f"fp32 {BACKEND} sgemm on {name} operands"


def _release_scratch() -> None:
    """Free the native bf16 path's packing buffers (the kernels allocate them again)."""
    free = _LIBC.free
    free.argtypes = [ctypes.c_void_p]
    for slot in (0, 2):
        if _SCRATCH[slot]:
            free(ctypes.c_void_p(_SCRATCH[slot]))
        _SCRATCH[slot] = _SCRATCH[slot + 1] = 0


def operand_format() -> int:
    """The half format gemm's operands are in now (0: float32); Python side of
    ``half_format``."""
    return _MODE.value & FORMAT_BITS


def _fortran_gemm(symbol: str, int_bits: int = 32):
    """An intrinsic calling Fortran ``?gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
    ldc)`` at ``symbol`` on the data pointers of arrays a, b, c (column-major view of their
    memory; a and b of one element type, float32 or uint16 words); ints are int32, or int64
    for an ILP64 library (``int_bits=64``; the caller passes int64 then)."""
    nb_int = types.int64 if int_bits == 64 else types.int32

    @intrinsic
    def call(typingctx, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        sig = types.void(
            types.uint8, types.uint8, nb_int, nb_int, nb_int, types.float32,
            a, nb_int, b, nb_int, types.float32, c, nb_int,
        )  # fmt: skip

        def codegen(context, builder, signature, args):
            i8, ii, f32 = ir.IntType(8), ir.IntType(int_bits), ir.FloatType()
            ab = context.get_data_type(signature.args[6].dtype)
            # Fortran passes everything by reference: scalars go through stack slots
            scalar = [i8, i8, ii, ii, ii, f32, ab, ii, ab, ii, f32, f32, ii]
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


def _dnnl_gemm(symbol: str):
    """An intrinsic calling oneDNN's C ``dnnl_sgemm`` / ``dnnl_gemm_bf16bf16f32(transa,
    transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)`` at ``symbol``: row-major,
    arguments by value, 64-bit sizes, a and b float32 or uint16 words; returns its status."""

    @intrinsic
    def call(typingctx, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        sig = types.int32(
            types.uint8, types.uint8, types.int64, types.int64, types.int64, types.float32,
            a, types.int64, b, types.int64, types.float32, c, types.int64,
        )  # fmt: skip

        def codegen(context, builder, signature, args):
            i8, i64, f32 = ir.IntType(8), ir.IntType(64), ir.FloatType()
            ab = context.get_data_type(signature.args[6].dtype).as_pointer()
            params = [i8, i8, i64, i64, i64, f32, ab, i64, ab, i64, f32, f32.as_pointer(), i64]
            fnty = ir.FunctionType(ir.IntType(32), params)
            fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            for i in (0, 1):  # C's char: the callee may read the whole register
                fn.args[i].add_attribute("zeroext")
            out = []
            for i, (val, ty, llty) in enumerate(zip(args, signature.args, params, strict=True)):
                if i in (6, 8, 11):  # an array: its data pointer (a view's own start)
                    data = context.make_array(ty)(context, builder, val).data
                    out.append(builder.bitcast(data, llty))
                else:
                    out.append(val)
            return builder.call(fn, out)

        return sig, codegen

    return call


_dnnl_gemm_bf16 = _dnnl_gemm(_DNNL_SYMBOL)
_dnnl_sgemm = _dnnl_gemm(_DNNL_SGEMM_SYMBOL)


_sgemm = _fortran_gemm(_SYMBOL)
_sgemm64 = _fortran_gemm(_SGEMM64_SYMBOL, 64)
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


def _external_global(builder, name: str, llty):
    try:
        return builder.module.get_global(name)
    except KeyError:
        gv = ir.GlobalVariable(builder.module, llty, name)
        gv.linkage = "external"
        return gv


@intrinsic
def _scratch_word(typingctx, i):
    """Word i of the packing buffers' table (``_SCRATCH``)."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        gv = _external_global(builder, _SCRATCH_SYMBOL, ir.ArrayType(i64, 4))
        return builder.load(builder.gep(gv, [i64(0), args[0]]))

    return types.int64(types.int64), codegen


@intrinsic
def _set_scratch_word(typingctx, i, value):
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        gv = _external_global(builder, _SCRATCH_SYMBOL, ir.ArrayType(i64, 4))
        builder.store(args[1], builder.gep(gv, [i64(0), args[0]]))
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def _aligned_alloc(typingctx, nbytes):
    """libc aligned_alloc(64, nbytes) as an address (0: out of memory)."""

    def codegen(context, builder, signature, args):
        i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i8p, [i64, i64]), _ALLOC_SYMBOL
        )
        return builder.ptrtoint(builder.call(fn, [i64(64), args[0]]), i64)

    return types.int64(types.int64), codegen


@intrinsic
def _free(typingctx, address):
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p]), _FREE_SYMBOL
        )
        builder.call(fn, [builder.inttoptr(args[0], i8p)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@intrinsic
def _uint16_pointer(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(16).as_pointer())

    return types.CPointer(types.uint16)(types.int64), codegen


@intrinsic
def _float32_pointer(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.FloatType().as_pointer())

    return types.CPointer(types.float32)(types.int64), codegen


@kernel
def _scratch(slot, rows, cols):
    """A (rows, cols) uint16 array in packing buffer ``slot`` (0 or 1), grown as needed."""
    words = rows * cols
    if _scratch_word(2 * slot + 1) < words:
        old = _scratch_word(2 * slot)
        if old != 0:
            _free(old)
        nbytes = (2 * words + 63) // 64 * 64
        address = _aligned_alloc(nbytes)
        if address == 0:
            _set_scratch_word(2 * slot, 0)
            _set_scratch_word(2 * slot + 1, 0)
            raise MemoryError("gemm: no memory for the bf16 operand buffers")
        _set_scratch_word(2 * slot, address)
        _set_scratch_word(2 * slot + 1, nbytes // 2)
    return carray(_uint16_pointer(_scratch_word(2 * slot)), (rows, cols))


@kernel
def _memory_rows(x):
    """x's 2-D memory as rows (at their stride): x itself ('N'), or x.T for a transposed
    view ('T'), with the BLAS op char that reads them back as x."""
    if x.shape[1] == 1 or x.strides[1] == 4:
        return x, np.uint8(78)
    return x.T, np.uint8(84)


@kernel
def _pack_bf16(x, slot):
    """x's memory rows as contiguous bf16 words, rounded to nearest even, in packing buffer
    ``slot``: (words, op char, leading dim)."""
    rows, op = _memory_rows(x)
    R, C = rows.shape
    out = _scratch(slot, R, C)
    for i in range(R):
        # each memory row as a contiguous array, so the loop vectorises whatever x's layout
        src = carray(_float32_pointer(rows.ctypes.data + i * rows.strides[0]), C)
        dst = out[i]
        for j in range(C):
            dst[j] = bf16_from_f32(src[j])
    return out, op, np.int32(max(C, 1))


@kernel
def half_format():
    """Inside a kernel: the half format gemm's operands are in now (0: float32). A kernel
    whose own float32 results enter a product (attention's probabilities) rounds them."""
    return _half_mode() & FORMAT_BITS


@kernel
def _require_half(x, fmt):
    """Raise unless every element of x is a value of the half format (NaN passes)."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[i, j]
            r = round_bf16(v) if fmt == BF16 else round_f16_value(v)
            if r != v and v == v:
                raise ValueError(
                    "gemm: an operand is not a half-precision value (a stored tensor was "
                    "not rounded; see kernels/blas.py, mixed precision)"
                )


@kernel
def _op(x):
    """(BLAS op char, leading dimension) of a 2-D float32 view with one unit stride."""
    if x.shape[1] == 1 or x.strides[1] == 4:  # row-major rows, possibly strided
        return np.uint8(78), np.int32(max(x.strides[0] // 4, x.shape[1], 1))  # 'N'
    if x.shape[0] == 1 or x.strides[0] == 4:  # a transposed view of a row-major matrix
        return np.uint8(84), np.int32(max(x.strides[1] // 4, x.shape[0], 1))  # 'T'
    raise ValueError("gemm operands need a unit stride along one axis")


@kernel
def on_onednn(k, n, a_transposed, b_transposed):
    """Whether SIMDIST_BLAS=onednn runs a product of inner dimension k and n columns on
    oneDNN's sgemm (else OpenBLAS's): the shape rule above, from k, n and the op flags."""
    return (
        min(k, n) >= _DNNL_SGEMM_MIN_SIDE
        and k * n >= _DNNL_SGEMM_MIN_AREA
        and not (a_transposed and b_transposed)
    )


@kernel
def on_openblas_narrow(n):
    """Whether, beside oneMKL (the SGEMM_NARROW bit), a product with n columns of C runs
    on numpy's OpenBLAS instead (the rule at _MKL_MIN_COLUMNS)."""
    return n < _MKL_MIN_COLUMNS


@kernel
def takes_native(mode, m, k, n):
    """Whether gemm, in operand mode ``mode``, runs an m x k x n product on the native bf16
    kernel (the shape rules above; fixed by the shape, so runs stay deterministic)."""
    if mode & NATIVE_EVERY_SHAPE:
        return k > 0 and (mode & (NATIVE_MKL | NATIVE_DNNL)) != 0
    if mode & NATIVE_MKL:
        return m >= _NATIVE_MIN and k >= _MKL_NATIVE_MIN_K and m * k * n >= _MKL_NATIVE_MIN_VOLUME
    return (mode & NATIVE_DNNL) != 0 and k > 0 and m >= _NATIVE_MIN and n >= _NATIVE_MIN


@kernel
def gemm_native(a, b, c, alpha, beta, mode):
    """gemm's bf16 product on the native kernel that ``mode`` names (NATIVE_MKL or
    NATIVE_DNNL), whatever the shape: both operands packed into bf16 words (gemm checks
    shapes and picks the path; ``bench_kernels.py --native-grid`` calls it directly)."""
    m, k = a.shape
    n = c.shape[1]
    ldc = max(c.strides[0] // 4, n, 1)
    ha, opa, lda = _pack_bf16(a, 0)
    hb, opb, ldb = _pack_bf16(b, 1)
    if mode & NATIVE_MKL:
        _gemm_bf16(
            opb, opa, np.int32(n), np.int32(m), np.int32(k), alpha, hb, ldb, ha, lda, beta, c,
            np.int32(ldc),
        )  # fmt: skip
    elif _dnnl_gemm_bf16(
        opa, opb, np.int64(m), np.int64(n), np.int64(k), alpha, ha, np.int64(lda), hb,
        np.int64(ldb), beta, c, np.int64(ldc),
    ) != 0:  # fmt: skip
        raise RuntimeError("gemm: oneDNN dnnl_gemm_bf16bf16f32 failed")


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
    if mode & CHECK:
        _require_half(a, mode & FORMAT_BITS)
        _require_half(b, mode & FORMAT_BITS)
    m32, n32, k32 = np.int32(m), np.int32(n), np.int32(k)
    if takes_native(mode, m, k, n):
        gemm_native(a, b, c, alpha, beta, mode)
    elif mode & SGEMM_DNNL and on_onednn(k, n, opa == 84, opb == 84):
        # float32 (or half values, exact in float32) on oneDNN: row-major as it is
        if _dnnl_sgemm(
            opa, opb, np.int64(m), np.int64(n), np.int64(k), alpha, a, np.int64(lda), b,
            np.int64(ldb), beta, c, np.int64(ldc),
        ) != 0:  # fmt: skip
            raise RuntimeError("gemm: oneDNN dnnl_sgemm failed")
    elif mode & SGEMM_ILP64 or (mode & SGEMM_NARROW and on_openblas_narrow(n)):
        # numpy's OpenBLAS (64-bit integers): the float32 library, or oneMKL's narrow products
        _sgemm64(
            opb, opa, np.int64(n), np.int64(m), np.int64(k), alpha, b, np.int64(ldb), a,
            np.int64(lda), beta, c, np.int64(ldc),
        )  # fmt: skip
    else:  # float32, or operands holding half values: their products are exact in float32
        _sgemm(opb, opa, n32, m32, k32, alpha, b, ldb, a, lda, beta, c, ldc)


def _warm() -> None:
    """Compile (or load from the cache) for the layouts the kernels pass."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.ones((3, 2), np.float32)
    z = np.zeros((2, 2), np.float32)
    gemm(x, y, z, np.float32(1.0), np.float32(0.0))
    gemm(y.T, x.T, z, np.float32(1.0), np.float32(1.0))
