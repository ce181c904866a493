import os

import simdist  # noqa: F401  (pins one compute thread per process before numpy loads)

# Mixed precision: every GEMM of every run the tests start verifies that both operands hold
# half values (kernels/blas.py), so a tensor a model forgets to round fails the suite.
os.environ.setdefault("SIMDIST_HALF_GEMM_CHECK", "1")
# float32 products on OpenBLAS however pytest is started (scripts/test.sh sets it too): the
# Open MPI venv tests/test_multihost.py compares bit for bit may lack oneDNN; tests that
# want oneMKL or oneDNN's sgemm ask for them.
os.environ.setdefault("SIMDIST_BLAS", "openblas")
