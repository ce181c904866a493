"""Process-level MPI set-up: the world communicator and abort-on-exception.

An exception on one rank while the others wait in a collective would hang the job; like
``python -m mpi4py``, simdist turns an uncaught exception on any rank into MPI_Abort, so
mpirun ends every rank and exits non-zero.
"""

from __future__ import annotations

import sys
import time
import traceback

from mpi4py import MPI


def world():
    return MPI.COMM_WORLD


def abort(exc: BaseException, code: int = 1) -> None:
    """Print the error once (from the failing rank) and take the whole job down."""
    comm = MPI.COMM_WORLD
    text = "".join(traceback.format_exception(exc))
    sys.stderr.write(f"[simdist rank {comm.Get_rank()}/{comm.Get_size()}] {text}")
    sys.stderr.flush()
    if comm.Get_size() > 1:
        abort_job(code)
    sys.exit(code)


def abort_job(code: int) -> None:
    """MPI_Abort of the whole job, after a short pause: the launcher forwards a rank's
    stderr through a pipe, and an abort that tears the job down at once can drop the
    message this rank has just written (seen with MPICH's hydra on a loaded machine)."""
    time.sleep(0.3)
    MPI.COMM_WORLD.Abort(code)


def wtime() -> float:
    return MPI.Wtime()


def processor_name() -> str:
    return MPI.Get_processor_name()
