#!/usr/bin/env bash
# Creates .venv (if missing) and installs simdist with its dependencies (MPICH comes from the
# `mpich` wheel, so mpirun/mpiexec land in .venv/bin). Sourced by train.sh and test.sh;
# re-installs only when setup.cfg changed. Set SIMDIST_EXTRAS to add extras, e.g. "test".
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python_bin="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
extras="${SIMDIST_EXTRAS:-}"
stamp=".venv/.simdist-installed"
want="$(sha256sum setup.cfg pyproject.toml | sha256sum | cut -c1-16) ${extras}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "simdist: installing into .venv (one time) ..." >&2
    python -m pip install -q --upgrade pip >&2
    python -m pip install -q -e ".${extras:+[$extras]}" >&2
    echo "$want" > "$stamp"
fi
# On AVX-512 CPUs other than Intel's with bf16 dot products (AMD Zen 4 and 5), oneDNN (the
# `onednn` extra, Apache 2.0, a 39 MB wheel): its sgemm runs the models' larger float32
# products 1.1-1.6x faster than OpenBLAS there, and its bf16 GEMM runs bf16 products natively
# (kernels/blas.py). Optional: without it simdist runs on OpenBLAS.
# Tried once per venv (.venv/.simdist-onednn): an offline machine does not wait on pip again.
if ! grep -q GenuineIntel /proc/cpuinfo && grep -qw avx512f /proc/cpuinfo \
    && grep -qwE "amx_bf16|avx512_bf16" /proc/cpuinfo \
    && ! ls .venv/lib/libdnnl.so* >/dev/null 2>&1 && [ ! -f .venv/.simdist-onednn ]; then
    touch .venv/.simdist-onednn
    python -m pip install -q "onednn-cpu-gomp==2023.2.0" >&2 \
        || echo "simdist: onednn-cpu-gomp not installable; float32 products stay on OpenBLAS" >&2
fi
