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
