#!/usr/bin/env bash
# CI provisioning for the multi-host and Open MPI tests (tests/test_multihost.py), run by
# .ci/run before the tests. Idempotent: a second run checks and returns in seconds.
#
#   1. apt packages iproute2 (ip, tc), openmpi-bin, libopenmpi-dev, when missing (root only)
#   2. the project's .venv (scripts/setup_env.sh with the test extras, as scripts/test.sh)
#   3. the Open MPI venv with simdist: scripts/setup_openmpi.sh build/ompi-venv
#      (SIMDIST_OMPI_VENV overrides it; tests/test_multihost.py looks in the same places)
#
# Best effort by design: what cannot be set up here (not root, no apt-get, no network) is
# reported, the tests that need it skip with the reason, and the exit status stays 0.
# SIMDIST_PROVISION_STRICT=1 turns every such failure into exit 1.
# Cold: ~25 s for apt (44 packages, 24 MB) and ~1 min for the Open MPI venv with the
# mpi4py wheel (3-9 min if mpi4py has to compile), on top of the project's own .venv.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

APT_PACKAGES=(iproute2 openmpi-bin libopenmpi-dev)
venv=${SIMDIST_OMPI_VENV:-build/ompi-venv}
strict=${SIMDIST_PROVISION_STRICT:-0}
summary=()
failed=0

say() { echo "ci_provision: $*"; }
note() { summary+=("$1"); say "$1"; }
problem() {
    note "$1"
    failed=1
}

# 1. System packages.
t0=$SECONDS
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed; then
        missing+=("$pkg")
    fi
done
if [ ${#missing[@]} = 0 ]; then
    note "apt: ${APT_PACKAGES[*]} already installed"
elif [ "$(id -u)" != 0 ]; then
    problem "apt: not root, cannot install ${missing[*]}; netns/Open MPI tests will skip"
elif ! command -v apt-get >/dev/null; then
    problem "apt: no apt-get here, cannot install ${missing[*]}; netns/Open MPI tests will skip"
else
    say "apt: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Lock timeout: another apt run (unattended upgrades) may hold the lock for a while.
    if timeout 600 apt-get -o DPkg::Lock::Timeout=120 update -qq \
        && timeout 900 apt-get -o DPkg::Lock::Timeout=120 install -y -qq "${missing[@]}" >/dev/null; then
        note "apt: installed ${missing[*]} in $((SECONDS - t0)) s"
    else
        problem "apt: installing ${missing[*]} failed (apt says why above); dependent tests will skip"
    fi
fi

# 2. The project's venv first: setup_openmpi.sh copies its numpy/numba/... versions, and
# the same extras as scripts/test.sh keep that script from reinstalling.
t0=$SECONDS
if (SIMDIST_EXTRAS=test . scripts/setup_env.sh) >/dev/null; then
    note "project .venv ready ($((SECONDS - t0)) s)"
else
    problem "project .venv: scripts/setup_env.sh failed (the test run will show why)"
fi

# 3. The Open MPI venv.
t0=$SECONDS
if ! command -v mpirun.openmpi >/dev/null || ! command -v mpicc.openmpi >/dev/null; then
    problem "Open MPI venv: no mpirun.openmpi/mpicc.openmpi; Open MPI tests will skip"
elif SIMDIST_OMPI_APT=0 timeout 1500 bash scripts/setup_openmpi.sh "$venv"; then
    note "Open MPI venv $venv ready ($((SECONDS - t0)) s)"
else
    problem "Open MPI venv: scripts/setup_openmpi.sh $venv failed; Open MPI tests will skip"
fi

say "summary:"
printf '  - %s\n' "${summary[@]}"
if [ "$failed" != 0 ] && [ "$strict" != 0 ]; then
    exit 1
fi
exit 0
