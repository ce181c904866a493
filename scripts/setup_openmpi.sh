#!/usr/bin/env bash
# Create (idempotently) a virtual environment whose mpi4py runs on the system Open MPI,
# with simdist from this checkout installed editable (no deps) and its dependencies at the
# versions of the project's .venv, so simdist programs, the Open MPI path of the launcher
# and scripts/multihost.py can run on Open MPI next to the project's own MPICH venv.
#
# Usage: scripts/setup_openmpi.sh [VENV_DIR]     (default: build/ompi-venv in the checkout)
# Env:   PYTHON  interpreter used to create the venv (default: python3)
#        SIMDIST_OMPI_APT=0          never call apt-get (fail instead when Open MPI is missing)
#        SIMDIST_OMPI_SIMDIST=0      mpi4py + numpy only (enough for tests/mpi/multihost_probe.py)
#        SIMDIST_OMPI_FROM_SOURCE=1  compile mpi4py with mpicc.openmpi even if the wheel works
#
# First run: ~1 min with the mpi4py binary wheel, 3-9 min when mpi4py has to compile; a
# second call that finds a complete venv returns in about a second. A venv shared by two
# checkouts follows the one that ran this last (simdist is an editable install), so CI
# uses a path inside its own clone.
set -euo pipefail

python=${PYTHON:-python3}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)  # physical: tests compare with Path.resolve()
venv=${1:-$repo/build/ompi-venv}
with_simdist=${SIMDIST_OMPI_SIMDIST:-1}

# Same numpy/numba/... as the MPICH venv: the arithmetic is then the same, so an Open MPI
# training run can be compared bit for bit with an MPICH one, and both use one numba cache.
pins=()
if [ "$with_simdist" != 0 ]; then
    dists="numpy numba llvmlite scipy h5py PyYAML tqdm safetensors"
    if [ -x "$repo/.venv/bin/python" ]; then
        # shellcheck disable=SC2207  # names and versions never contain spaces
        pins=($("$repo/.venv/bin/python" - $dists <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(name)
EOF
        ))
    else
        read -r -a pins <<<"$dists"
    fi
fi

is_openmpi='import sys; from mpi4py import MPI; sys.exit("Open MPI" not in MPI.Get_library_version())'

# One check for everything the venv must hold. mpi4py must really run on Open MPI: one
# bound to MPICH would pass an import check and then fail under mpirun.openmpi.
# Exit 10: mpi4py missing or on another MPI (rebuild); 11: only pins or simdist are off.
check() {
    "$venv/bin/python" - "$repo" "$with_simdist" "${pins[@]}" <<'EOF' 2>/dev/null
import sys
from importlib import metadata, util
repo, with_simdist, pins = sys.argv[1], sys.argv[2] != "0", sys.argv[3:]
try:
    from mpi4py import MPI
    import numpy  # noqa: F401
except ImportError:
    sys.exit(10)
if "Open MPI" not in MPI.Get_library_version():
    sys.exit(10)
for pin in pins:
    name, _, version = pin.partition("==")
    try:
        if version and metadata.version(name) != version:
            sys.exit(11)
    except metadata.PackageNotFoundError:
        sys.exit(11)
if with_simdist:
    spec = util.find_spec("simdist")
    if spec is None or not (spec.origin or "").startswith(repo + "/"):
        sys.exit(11)
EOF
}

if [ -x "$venv/bin/python" ]; then
    state=0
    check || state=$?
    if [ "$state" = 0 ]; then
        echo "setup_openmpi: $venv already complete (mpi4py on Open MPI${pins:+, ${pins[*]}})"
        exit 0
    fi
else
    state=10
fi

if [ "$state" = 10 ]; then
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
    mpi4py=mpi4py
    if [ -x "$repo/.venv/bin/python" ]; then
        v=$("$repo/.venv/bin/python" -c 'from importlib import metadata as m; print(m.version("mpi4py"))' 2>/dev/null) \
            && mpi4py="mpi4py==$v"
    fi
    # mpi4py >= 4.1 wheels carry an Open MPI build next to the MPICH one and pick by the
    # libmpi they find at import (libmpi.so.12 = MPICH first, then libmpi.so.40 = Open MPI):
    # seconds instead of minutes. Where that finds MPICH (a system MPICH installed too) or
    # the wheel is unavailable, compile against mpicc.openmpi instead.
    built=wheel
    if [ "${SIMDIST_OMPI_FROM_SOURCE:-0}" = 0 ] \
        && "$venv/bin/pip" install -q --only-binary mpi4py "$mpi4py" numpy \
        && "$venv/bin/python" -c "$is_openmpi" 2>/dev/null; then
        echo "setup_openmpi: $mpi4py binary wheel runs on Open MPI"
    else
        built=source
        echo "setup_openmpi: building $mpi4py from source against Open MPI in $venv"
        # --no-binary: a wheel would not be this Open MPI's own build; --no-cache-dir: pip
        # would otherwise reuse a wheel it once compiled with another mpicc.
        MPICC=mpicc.openmpi "$venv/bin/pip" install -q --no-cache-dir --force-reinstall \
            --no-binary mpi4py "$mpi4py" numpy
    fi
fi

if [ "$with_simdist" != 0 ]; then
    echo "setup_openmpi: installing ${pins[*]} and simdist (editable, from $repo)"
    "$venv/bin/pip" install -q "${pins[@]}"
    # --no-deps: install_requires names the mpich wheel, whose mpiexec would shadow Open MPI's.
    "$venv/bin/pip" install -q --no-deps -e "$repo"
fi

check || {
    echo "setup_openmpi: $venv is still incomplete (mpi4py on Open MPI, ${pins[*]}, simdist)" >&2
    exit 1
}
echo "setup_openmpi: $venv ready, mpi4py ${built:-as found} ($("$venv/bin/python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().split(chr(10))[0].strip(chr(0)))'))"
