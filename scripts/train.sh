#!/usr/bin/env bash
# Quick start: set up .venv if needed, then train FC-MNIST on 4 MPI ranks with the default
# params (the 5,000-digit MNIST subset shipped with simdist). Extra arguments go to
# simdist.train, e.g.  bash scripts/train.sh --runconfig.max_steps=100   (NP=2 for 2 ranks)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec mpirun -np "${NP:-4}" python -m simdist.train "$@"
