"""Launch an MPI program from a serial pytest test: ``run_mpi(np, args, timeout)``.

Runs ``mpiexec -n NP <this python> -m mpi4py ARGS...`` from the repository root with the
caller's environment. ``-m mpi4py`` makes an uncaught exception on any rank abort the whole
job instead of leaving the other ranks hanging. On timeout the whole process group (mpiexec
and every rank) is killed and the result has return code 124, like timeout(1), so callers
only need ``assert proc.returncode == 0, proc.stdout``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def mpiexec() -> str:
    """The mpiexec next to this interpreter (the venv's MPICH wheel), else the one on PATH."""
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if found is None:
        raise FileNotFoundError("mpiexec not found next to the interpreter or on PATH")
    return found


def run_mpi(np: int, args: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``args`` (a script path or ``-m module`` plus its arguments) on ``np`` ranks.

    stdout and stderr are merged into ``stdout`` (text) so a failure shows everything in order;
    ``stderr`` is left empty.
    """
    cmd = [mpiexec(), "-n", str(np), sys.executable, "-m", "mpi4py", *map(str, args)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # own process group: a timeout can kill every rank
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        note = f"\nrun_mpi: timed out after {timeout} s; killed mpiexec and its ranks\n"
        return subprocess.CompletedProcess(cmd, 124, (out or "") + note, "")
