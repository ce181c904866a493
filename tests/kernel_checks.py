"""Reusable checks for numba kernel tests (import from any tests/test_*.py).

- ``central_fd(f, x)`` / ``directional_fd(f, x, d)``: finite differences of a scalar float64
  function, for checking analytic backward kernels against a float64 reference forward.
- ``float64_ops(dispatcher)``: float64 arithmetic/conversions in a kernel's compiled code.
- ``nrt_allocations(fn, *args)``: heap allocations numba's runtime makes during one call.
- ``max_ulp(a, b)``: largest distance in units in the last place between float32 arrays.
- ``fresh_python(code, **env)``: stdout of ``code`` run in a new interpreter (what binds
  or imports once per process), failing the test with its stderr if it fails.
"""

import re
from collections.abc import Callable

import numpy as np
from numba import jit, njit
from numba.core.dispatcher import Dispatcher
from numba.core.runtime import _nrt_python, rtsys


def central_fd(f: Callable[[np.ndarray], float], x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """d f / d x by central differences, one element of float64 x at a time (x is restored).

    Truncation error is O(h**2) (zero for f quadratic in x); rounding error ~1e-16*|f|/h.
    """
    assert x.dtype == np.float64, "differentiate the float64 reference, not the kernel"
    grad = np.empty_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + h
        fp = f(x)
        flat[i] = orig - h
        fm = f(x)
        flat[i] = orig
        gflat[i] = (fp - fm) / (2 * h)
    return grad


def directional_fd(
    f: Callable[[np.ndarray], float], x: np.ndarray, direction: np.ndarray, h: float = 1e-6
) -> float:
    """(f(x + h*d) - f(x - h*d)) / 2h for float64 x: compare with sum(grad * d).

    One pair of evaluations checks every element of the gradient at once, which makes it
    affordable at production shapes where ``central_fd`` is not.
    """
    assert x.dtype == np.float64
    return (f(x + h * direction) - f(x - h * direction)) / (2 * h)


# float64 in LLVM IR: arithmetic/compares on double or <N x double>, float<->double
# conversions, int->double conversions (the `x / n` trap), f64 intrinsics and libm calls.
_F64 = re.compile(
    r"\b(?:fadd|fsub|fmul|fdiv|frem|fneg|fcmp)\b.*\bdouble\b"
    r"|\b(?:fptrunc|fpext)\b"
    r"|\b(?:sitofp|uitofp)\b.*\bto (?:<\d+ x )?double\b"
    r"|@llvm\.[\w.]*f64\b"
    r"|\bcall\b.*\bdouble\b.*@"
)
_DEFINE = re.compile(r'^define [^@]*@"?([^"(]+)"?\(.*?^}', re.M | re.S)


def float64_ops(dispatcher: Dispatcher) -> dict[str, list[str]]:
    """{signature: IR lines doing float64 work} for every compiled signature of a kernel.

    Call the kernel (or ``warm_all()``) first: the signatures it was called with are the
    ones scanned. They are recompiled here by an uncached copy with the same jit options,
    because numba returns no IR for code loaded from its on-disk cache (it warns and
    ``inspect_llvm()`` comes back empty), which would make every kernel look clean.
    Only the kernel's own functions are scanned: numba's Python-call wrappers
    (``cpython.*``, ``cfunc.*``) legitimately unbox a float32 argument through a C double
    (an ``fptrunc``) and are skipped.
    """
    assert dispatcher.signatures, "call the kernel first: nothing is compiled"
    fresh = jit(**dispatcher.targetoptions)(dispatcher.py_func)
    for sig in dispatcher.signatures:
        fresh.compile(sig)
    found = {}
    for sig, ir in fresh.inspect_llvm().items():
        assert ir, f"no IR for {sig}"
        lines = []
        for match in _DEFINE.finditer(ir):
            name = match.group(1)
            if name.startswith(("_ZN7cpython", "cfunc.")):
                continue
            lines += [ln.strip() for ln in match.group(0).splitlines()[1:] if _F64.search(ln)]
        found[str(sig)] = lines
    return found


@njit(cache=True)  # one baseline per argument-type list; cached, it costs nothing next run
def _unbox_only(*args):
    """Takes the same arguments as the kernel and does nothing: the allocation baseline."""
    return None


def nrt_allocations(fn: Callable[..., object], *args: object) -> int:
    """Allocations numba's runtime (NRT) makes inside one call of jitted ``fn(*args)``.

    NRT statistics are switched on for the measurement (they are off by default in 0.68).
    Passing an array from Python creates one NRT MemInfo per array argument, so the same
    arguments are also passed to a do-nothing jitted function and that baseline is
    subtracted. ``fn`` and the baseline are called once first so compilation is not
    counted. Calls ``fn`` twice in all: use arguments for which that is harmless.
    """
    was_enabled = _nrt_python.memsys_stats_enabled()
    _nrt_python.memsys_enable_stats()
    try:
        fn(*args)
        _unbox_only(*args)
        s0 = rtsys.get_allocation_stats()
        fn(*args)
        s1 = rtsys.get_allocation_stats()
        _unbox_only(*args)
        s2 = rtsys.get_allocation_stats()
    finally:
        if not was_enabled:
            _nrt_python.memsys_disable_stats()
    return (s1.alloc - s0.alloc) - (s2.alloc - s1.alloc)


def max_ulp(a: np.ndarray, b: np.ndarray) -> int:
    """Largest ulp distance between same-shaped finite float32 arrays (0 = bitwise equal)."""
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    # Map the float bit patterns to a monotonic integer line, so that adjacent floats differ
    # by 1 across zero too (-0.0 and +0.0 both map to 0).
    ia = a.view(np.int32).astype(np.int64)
    ib = b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.abs(ia - ib).max(initial=0))


def onednn_sgemm_installed() -> bool:
    """Whether this venv has oneDNN with ``dnnl_sgemm`` (what SIMDIST_BLAS=onednn binds)."""
    import ctypes
    import glob
    import os
    import sys

    for path in sorted(glob.glob(os.path.join(sys.prefix, "lib", "libdnnl.so*"))):
        try:
            return hasattr(ctypes.CDLL(path), "dnnl_sgemm")
        except OSError:
            continue
    return False


def mkl_installed() -> bool:
    """Whether this venv has oneMKL's runtime (what SIMDIST_BLAS=mkl binds)."""
    import glob
    import os
    import sys

    return bool(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))


def fresh_python(code: str, **env: str) -> str:
    """Run ``code`` in a new interpreter (this environment plus ``env``); its stdout,
    stripped. A non-zero exit fails the calling test with the process's output."""
    import os
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.strip()
