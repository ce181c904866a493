#!/usr/bin/env bash
# Create (idempotently) a virtual environment whose mpi4py is built against the system
# Open MPI, so the Open MPI path of the launcher and of scripts/multihost.py can be tested
# next to the project's own MPICH venv.
#
# Usage: scripts/setup_openmpi.sh [VENV_DIR]     (default: /tmp/ompi-venv)
# Env:   PYTHON  interpreter used to create the venv (default: python3)
#        SIMDIST_OMPI_APT=0  never call apt-get (fail instead when Open MPI is missing)
#
# Takes ~3 min the first time (mpi4py compiles from source); a second call that finds a
# working venv returns at once.
set -euo pipefail

venv=${1:-/tmp/ompi-venv}
python=${PYTHON:-python3}

# An existing venv counts only if its mpi4py really links Open MPI: a wheel built against
# MPICH would pass an import check and then fail under mpirun.openmpi.
check='from mpi4py import MPI; import numpy, sys; sys.exit("Open MPI" not in MPI.Get_library_version())'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "setup_openmpi: $venv already has mpi4py on Open MPI"
    exit 0
fi

if ! command -v mpicc.openmpi >/dev/null || ! command -v mpirun.openmpi >/dev/null; then
    if [ "${SIMDIST_OMPI_APT:-1}" != 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup_openmpi: installing openmpi-bin libopenmpi-dev"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev
    else
        echo "setup_openmpi: mpicc.openmpi not found; install openmpi-bin libopenmpi-dev" >&2
        exit 1
    fi
fi

if [ -f "$venv/pyvenv.cfg" ]; then
    # A venv whose mpi4py is missing or built on another MPI: pip would keep that build
    # ("already satisfied"), so start over.
    "$python" -m venv --clear "$venv"
elif [ -e "$venv" ] && [ -n "$(ls -A "$venv")" ]; then
    echo "setup_openmpi: $venv exists and is not a virtual environment; not touching it" >&2
    exit 1
else
    "$python" -m venv "$venv"
fi
# --no-binary: the PyPI wheel of mpi4py is not built against this Open MPI;
# --no-cache-dir: pip would otherwise reuse a wheel it once compiled with another mpicc.
MPICC=mpicc.openmpi "$venv/bin/pip" install -q --no-cache-dir --no-binary mpi4py mpi4py numpy
"$venv/bin/python" -c "$check" || {
    echo "setup_openmpi: mpi4py in $venv does not report Open MPI" >&2
    exit 1
}
echo "setup_openmpi: $venv ready ($("$venv/bin/python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().split(chr(10))[0].strip(chr(0)))'))"
