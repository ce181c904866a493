"""What an execution mode is to ``simdist.run.Run``: a schedule.

A schedule says which ranks do what in a training step and through which collectives:
what this rank holds (parameters, gradients, optimizer state, a streaming window, nothing),
what it computes and sends in a step, and how the ranks agree on the step's loss, norm and
stop flag. Everything else (set-up order, resume, checkpoints, summaries, eval, progress,
performance.json, model_dir) is ``Run``'s, the same for every mode. A new mode (pipeline
or tensor parallel) is one new module with one ``Schedule`` subclass, chosen in
``simdist.run.schedule_for``.

The life of a schedule, as ``Run`` drives it:

====================  ================================================================
``prepare(run)``      build the model (and data) this rank needs; first log line
(Run compiles)        kernels, rank 0 first, when ``compiles``
``allocate(run)``     this rank's buffers, optimizer and initial parameters
``state_shard``       what ``Run``'s checkpoint reader and writer fill and save
``feed(run)``         once the first step is agreed: where the batches come from
``start(run)``        training starts (reset counters)
``step(run, s, g)``   one step producing global_step s + 1 (``g``: the StepGuard)
``mean_loss(r, res)`` a summary step's mean loss over replicas (collective)
``eval_sums(run)``    this rank's eval sums (collective among the schedule's ranks)
``performance(...)``  the mode's performance.json fields (collective)
``close()``           release feeds and workers
====================  ================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class StepResult:
    """What a step leaves for ``Run``: this rank's loss contribution, the clipping norm
    (None without clipping), whether the ranks agreed to stop, and the mean loss over the
    replicas when the agreement already carried it (else ``mean_loss`` computes it)."""

    loss: float
    norm: float | None = None
    stop: bool = False
    mean_loss: float | None = None


@dataclass
class StateShard:
    """What this rank holds for the checkpoint reader and writer: the flat parameters
    ``params`` from flat index ``params_lo`` on, and the optimizer state of [lo, hi).
    ``sharded``: each holder saves its optimizer range as a shard (``index`` of ``count``,
    gathered over ``comm`` to world rank 0); else rank 0 holds all of it and saves it in
    the main file. ``write``: how the reader stores float32 values from a flat index when
    ``params`` are not float32 (mixed precision's 16-bit words); None: copied in."""

    comm: Any
    index: int
    count: int
    lo: int
    hi: int
    state: dict[str, np.ndarray]
    sharded: bool
    params: np.ndarray
    params_lo: int = 0
    write: Callable[[int, np.ndarray], None] | None = None

    def write_params(self, a: int, values: np.ndarray) -> None:
        """Flat parameters [a, a + values.size) (within what this rank holds) = values."""
        if self.write is not None:
            self.write(a, values)
        else:
            self.params[a - self.params_lo : a - self.params_lo + values.size] = values


class Schedule:
    """One execution mode. Attributes ``Run`` reads: ``comm`` (the ranks that run this
    schedule together: barriers, the per-step agreement, summaries), ``coll`` (collectives
    over ``comm``), ``replicas`` (data-parallel replicas: batch sizes), ``ranks`` (the
    job's ranks, performance.json's world_size), ``layout``, ``model``."""

    name = "?"
    compiles = True  # this rank runs kernels: compile them before allocating
    watched = True  # the stall watchdog covers this rank's steps
    evaluates = True  # this rank takes part in eval and performance.json
    zero_level = 0  # checkpoint attribute zero_opt_level
    state_shard: StateShard | None = None
    data: Any = None

    def restore(self, run, path, attrs: dict[str, Any], loaded: set[str]) -> None:
        """After ``Run`` read checkpoint ``path`` (its ``attrs``; ``loaded``: the optimizer
        state keys it filled): restore what else the mode keeps (loss scaler)."""

    def summary_scalars(self) -> dict[str, float]:
        """Mode-specific TensorBoard scalars at a summary step."""
        return {}

    def num_eval(self) -> int:
        """Held-out samples eval scores: all of them, or the first ``runconfig.eval_steps``
        batches of ``eval_input.batch_size`` per replica."""
        n, steps = self.data.num_eval, self.params.runconfig.eval_steps
        if steps is None:
            return n
        return min(n, steps * self.params.eval_input.batch_size * self.replicas)

    def eval_meta(self, n: int) -> tuple[int, float]:
        """(samples, targets per sample) of the first ``n`` held-out samples: the run
        divides the eval sums by their product."""
        per_sample = getattr(self.data, "eval_targets_per_sample", None)
        return n, per_sample(n) if per_sample else self.data.targets_per_sample

    def __init__(self, comm, replicas: int, ranks: int):
        self.comm, self.replicas, self.ranks = comm, replicas, ranks
        self.coll: Any = None

    def prepare(self, run) -> None:
        raise NotImplementedError

    def allocate(self, run) -> None:
        """This rank's buffers, optimizer and initial parameters (none by default)."""

    def warm(self) -> None:
        """Compile kernels beyond ``simdist.kernels.registry`` (after ``warm_all``)."""

    def feed(self, run) -> None:
        """Where the batches come from, once ``run.step`` is agreed (nothing by default)."""

    def start(self, run) -> None:
        """Training starts: reset per-run counters (none by default)."""

    def step(self, run, step: int, guard) -> StepResult:
        raise NotImplementedError

    def mean_loss(self, run, result: StepResult) -> float:
        return 0.0 if result.mean_loss is None else result.mean_loss

    def checkpoint_parameters(self, run) -> dict[str, np.ndarray] | None:
        """Collective over the holders: all parameters by name, on world rank 0."""
        return None

    def checkpoint_attrs(self) -> dict[str, Any]:
        return {}

    def eval_sums(self, run) -> np.ndarray:
        """[loss sum, correct, eval samples, targets per sample] of this rank (the last two
        from one rank only): ``Run.evaluate`` adds them over ``coll``."""
        return np.zeros(4, np.float64)

    def performance(self, run, common: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        if hasattr(self.data, "close"):
            self.data.close()
