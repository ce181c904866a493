"""``mpirun -np N python -m simdist.train [--params FILE_OR_PRESET] [--section.key=value ...]``

Synchronous data-parallel training (ZeRO-0/1/2) with one simulated accelerator per rank.
``main`` sets the run up (``simdist.run.setup``), then the loop below is the whole of
training: micro-batches forward/backward, gradient sync, clipping, update, parameter
gather, summaries and checkpoints.
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
    if getattr(run, "own_loop", False):  # weight-streaming ranks, input workers: their loop
        return run.train()
    p, model, sync = run.params, run.model, run.sync
    accum = p.optimizer.grad_accum_steps
    dloss = 1.0 / (run.micro_batch * accum)  # mean over this replica's samples this step
    lo, hi = sync.update_range
    run.start_training()
    # guard: stall watchdog phases, the per-step agreement (NaN/Inf, stop signals), hooks
    with StepGuard(run) as guard:
        hook = guard.hook  # test-only fault injection (SIMDIST_FAULT); None in real runs
        for step in range(run.step, p.runconfig.max_steps):
            n = step + 1  # this step produces global_step n
            guard.enter("forward_backward", n)
            loss = 0.0
            for micro, indices in enumerate(run.sampler.indices(step)):
                x, y = run.data.train_batch(indices)
                if hook:
                    hook.at_batch(n, micro, x)
                loss += model.forward(run.pviews, x, y) / accum
                model.backward(run.pviews, run.gradients(micro), dloss)
                run.accumulate_gradients(micro)
            guard.enter("reduce_gradients", n)
            grads, own_sumsq = sync.reduce_gradients(run.grads)  # averaged, for [lo, hi)
            sumsq, stop = guard.check(n, grads, loss, own_sumsq)  # NaN/Inf raise on all ranks
            norm = run.clip(grads, sumsq)
            guard.enter("update", n)
            run.optimizer.step(run.params_flat[lo:hi], grads, n, run.learning_rate(step))
            guard.enter("gather_parameters", n)
            sync.gather_parameters(run.params_flat)
            run.step = n
            guard.enter("after_step", n)
            run.after_step(loss, norm, stop)
            if stop:  # a signal reached some rank: all checkpointed this step, all stop
                raise guard.preempted()
    run.finish_training()


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
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
