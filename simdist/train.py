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
from simdist.config import ConfigError
from simdist.run import Run, report_config_error, setup


def train(run: Run) -> None:
    p, model, sync = run.params, run.model, run.sync
    accum = p.optimizer.grad_accum_steps
    dloss = 1.0 / (run.micro_batch * accum)  # mean over this replica's samples this step
    lo, hi = sync.update_range
    run.start_training()
    for step in range(run.step, p.runconfig.max_steps):
        loss = 0.0
        for micro, indices in enumerate(run.sampler.indices(step)):
            x, y = run.data.train_batch(indices)
            loss += model.forward(run.pviews, x, y) / accum
            model.backward(run.pviews, run.gradients(micro), dloss)
            run.accumulate_gradients(micro)
        grads = sync.reduce_gradients(run.grads)  # averaged, for [lo, hi)
        norm = run.clip(grads)
        run.optimizer.step(run.params_flat[lo:hi], grads, step + 1, p.optimizer.learning_rate)
        sync.gather_parameters(run.params_flat)
        run.step = step + 1
        run.after_step(loss, norm)
    run.finish_training()


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    try:
        run = setup(argv, started)
    except (ConfigError, CheckpointError) as e:
        return report_config_error(e)
    try:
        if run.params.runconfig.mode in ("train", "train_and_eval"):
            train(run)
        if run.params.runconfig.mode in ("eval", "train_and_eval"):
            run.evaluate()
        run.close()
    except BaseException as e:  # noqa: BLE001 - any failure must take all ranks down
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        from simdist.comm.world import abort

        abort(e)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
