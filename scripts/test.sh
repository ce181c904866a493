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
exec python -m pytest -q "$@"
