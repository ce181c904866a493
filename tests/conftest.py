import os
import sys

import simdist  # noqa: F401  (pins one compute thread per process before numpy loads)

# Mixed precision: every GEMM of every run the tests start verifies that both operands hold
# half values (kernels/blas.py), so a tensor a model forgets to round fails the suite.
os.environ.setdefault("SIMDIST_HALF_GEMM_CHECK", "1")
# float32 products on OpenBLAS however pytest is started (scripts/test.sh sets it too): the
# Open MPI venv tests/test_multihost.py compares bit for bit may lack oneDNN; tests that
# want oneMKL or oneDNN's sgemm ask for them.
os.environ.setdefault("SIMDIST_BLAS", "openblas")
# The suite starts hundreds of MPI jobs, every rank a fresh interpreter: with
# PYTHONDONTWRITEBYTECODE set (some machines set it) each would compile simdist's ~100
# modules from source again (~1 s a rank). Bytecode goes to build/pycache instead.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    prefix = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build")
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(prefix, "pycache"))
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False
