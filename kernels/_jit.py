"""The one place that decides how kernels are compiled.

numba's on-disk cache key does not include jit options such as fastmath, so they are fixed
literals here, never read from the environment. ``error_model="numpy"`` keeps divisions and
square roots free of Python's zero-division checks (several times faster).

Where the compiled code is cached: numba keys a cached function by its own file alone, yet
the machine code it caches holds every kernel the function calls (numba compiles callees
into the caller). After an edit to kernels/blas.py, a cache of kernels/linear.py would go on
running the old ``gemm``; a ``git pull`` onto a used checkout would mix versions. So every
kernel caches in a directory named by a digest of all kernel sources (kernels/*.py):
``kernels/__pycache__/simdist-<digest>`` (under ``NUMBA_CACHE_DIR`` when that is set, or the
user's cache directory when the package's is read-only). Any edit starts a fresh cache; a
checkout that goes back to earlier sources finds theirs again.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import llvmlite.binding as llvm
from numba import config, njit

_HERE = Path(__file__).resolve().parent


def _wide_vectors() -> None:
    """Let LLVM vectorise with 512-bit registers wherever the CPU has AVX-512.

    LLVM's tuning for Intel's AVX-512 server cores sets ``prefer-256-bit`` (Skylake-SP lost
    clock speed on 512-bit instructions), so numba compiled our loops to 256-bit vectors on
    the Xeons this project runs on (its Zen 4 and Zen 5 tuning already takes 512-bit). With
    the preference off, GELU ran 1.4x faster there and the layernorms, attention and AdamW
    2-6 % (``python scripts/bench_kernels.py --vector-width``, Xeon 6/207/2). Results do
    not change: the kernels compile without fastmath, so LLVM never reorders a
    floating-point sum, and a lane's arithmetic is the same at any width.
    A user's own ``NUMBA_CPU_FEATURES`` is left as it is. The features are part of numba's
    cache key, so both widths keep their own compiled code.
    """
    if config.CPU_FEATURES is not None:
        return
    features = llvm.get_host_cpu_features()
    if features.get("avx512f"):
        config.CPU_FEATURES = features.flatten() + ",-prefer-256-bit"


_wide_vectors()


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_HERE.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def _cache_dir() -> str:
    name = f"simdist-{_sources_digest()}"
    if config.CACHE_DIR:  # the user's NUMBA_CACHE_DIR
        return os.path.join(config.CACHE_DIR, name)
    here = str(_HERE / "__pycache__" / name)
    if _writable(here):
        return here
    return os.path.join(os.path.expanduser("~"), ".cache", "simdist", name)


CACHE_DIR = _cache_dir()
_njit = njit(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)


def kernel(fn):
    """``njit`` with the options above, cached in ``CACHE_DIR`` (numba fixes a function's
    cache location when it is decorated)."""
    saved = config.CACHE_DIR
    config.CACHE_DIR = CACHE_DIR
    try:
        return _njit(fn)
    finally:
        config.CACHE_DIR = saved
