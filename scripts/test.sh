#!/usr/bin/env bash
# Quick start: set up .venv with the test extras (and the optional PyTorch reference,
# torch==2.13.0, when it can be installed), then run the whole test suite with pytest.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -k collectives
set -euo pipefail
SIMDIST_EXTRAS=test . "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
if ! python -c "import torch" 2>/dev/null; then
    # Only 2.13.0: any other version would pull a multi-GB CUDA build.
    python -m pip install -q torch==2.13.0 >&2 \
        || echo "simdist: torch==2.13.0 not installable; PyTorch parity tests will be skipped" >&2
fi
# On an Intel CPU with AMX or AVX512_BF16, the optional oneMKL extra too: its bf16 GEMM is
# what bf16 runs use there, and tests/test_precision.py checks it gives the float32-BLAS
# path's results (skipped, with the reason, where it is absent). float32 products stay on
# OpenBLAS (SIMDIST_BLAS below; tests that need oneMKL or oneDNN's sgemm ask for it), as in
# the Open MPI venv that tests/test_multihost.py compares bit for bit with this one.
if grep -q GenuineIntel /proc/cpuinfo && grep -qwE "amx_bf16|avx512_bf16" /proc/cpuinfo \
    && ! ls .venv/lib/libmkl_rt.so* >/dev/null 2>&1; then
    python -m pip install -q "mkl>=2024" >&2 \
        || echo "simdist: mkl not installable; the native bf16 GEMM test will be skipped" >&2
fi
# Elsewhere with AVX-512 and AVX512_BF16 or AMX (AMD Zen 4 and 5), setup_env.sh installed
# oneDNN: its bf16 GEMM for the same test, its sgemm for tests/test_kernels.py's check.
export SIMDIST_BLAS="${SIMDIST_BLAS:-openblas}"
exec python -m pytest -q "$@"
