"""``mpirun -np N python -m simdist.train [--params FILE_OR_PRESET] [--section.key=value ...]``

Training in any execution mode: data parallel with ZeRO 0-2, weight streaming with weight
servers, input workers (``simdist.schedules``). ``main`` sets the run up
(``simdist.run.setup``: the mode's schedule built, a checkpoint resumed), then the loop
below is the whole of training, the same for every mode: the schedule's step (which ranks
do what, through which collectives), then summaries, progress and checkpoints.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from simdist.checkpoint import CheckpointError
from simdist.comm.world import world
from simdist.config import ConfigError
from simdist.faults import AgreedStop, SetupGate, StepGuard, finish_agreed_stop
from simdist.run import Run, setup


def train(run: Run) -> None:
    run.start_training()
    # guard: stall watchdog phases, the per-step agreement (NaN/Inf, stop signals), hooks
    with StepGuard(run) as guard:
        for step in range(run.step, run.stop_step):
            result = run.schedule.step(run, step, guard)  # produces global_step step + 1
            run.step = step + 1
            guard.enter("after_step", run.step)
            run.after_step(result)  # summaries, progress, checkpoints
            if result.stop:  # a signal reached some rank: all checkpointed this step, all stop
                raise guard.preempted()
    run.finish_training()


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        if world().Get_rank() == 0:
            from simdist.config import usage

            print(usage())
        return 0
    gate = SetupGate(world())  # bad input seen by only some ranks must not hang the others
    try:
        run = setup(argv, started)
    except (ConfigError, CheckpointError) as e:
        return gate.fail(e)
    except BaseException as e:  # noqa: BLE001 - a failure in set-up takes all ranks down too
        _abort(e)
    gate.close()
    try:
        if run.params.runconfig.mode in ("train", "train_and_eval"):
            train(run)
        if run.params.runconfig.mode in ("eval", "train_and_eval"):
            run.evaluate()
        run.close()
    except AgreedStop as e:  # every rank raised it at the same step: a clean, agreed exit
        return finish_agreed_stop(run, e)
    except BaseException as e:  # noqa: BLE001 - any failure must take all ranks down
        _abort(e)
    return 0


def _abort(e: BaseException) -> None:
    if isinstance(e, SystemExit) and e.code in (0, None):
        raise e
    from simdist.comm.world import abort

    abort(e)


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
