"""Run ``simdist.train.main`` once per bad-input case inside ONE MPI job (one launch instead
of one per case). Under mpiexec:

    mpiexec -n 2 python -m mpi4py tests/mpi/bad_inputs.py CASES.json RESULTS.json

CASES.json: a list of argv lists. RESULTS.json (written by rank 0): per case the return
code of ``main`` and what rank 0 wrote to stderr. Every case must fail in set-up on every
rank, so each ``main`` returns (exit code 2) instead of training or aborting.
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per rank before numpy loads)

# isort: split
import contextlib
import io
import json
import sys
from pathlib import Path

from simdist.comm.world import world
from simdist.train import main


def run_cases(cases: list[list[str]]) -> list[dict]:
    results = []
    for argv in cases:
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(argv)
        results.append({"argv": argv, "rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue()})
    return results


if __name__ == "__main__":
    cases_path, results_path = map(Path, sys.argv[1:3])
    results = run_cases(json.loads(cases_path.read_text()))
    if world().Get_rank() == 0:
        results_path.write_text(json.dumps(results, indent=1))
