"""One run for every execution mode: set-up, resume, checkpoints, summaries, eval, progress
and every artifact in model_dir.

``setup`` turns argv into a ``Run``: params resolved and checked on every rank, the
execution mode's schedule (``simdist.schedules``: which ranks do what in a step) chosen and
built, and a resumed state when model_dir holds a checkpoint. ``simdist.train`` then runs
the one training loop over ``schedule.step``. Rank 0 alone prints and writes shared
artifacts (params.yaml, events, performance.json, checkpoints); other ranks contribute
through collectives.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simdist import checkpoint
from simdist.comm.groups import WORKER, Groups, Roles, wait
from simdist.comm.world import world
from simdist.config import ConfigError, Params, batch_sizes, dump_yaml, load_params
from simdist.device.profile import ProfileError, load_profile
from simdist.events import EventWriter
from simdist.faults import check_same_run
from simdist.hostcpu import other_cpu_note
from simdist.kernels.registry import jit_seconds, warm_all
from simdist.lr_schedule import parse_schedule
from simdist.schedules import DataParallel, InputWorkers, Schedule, StepResult, WeightStreaming
from simdist.schedules.pipeline import Pipeline
from simdist.schedules.tensor_parallel import TensorParallelWeight
from simdist.streaming import options_from


def report_config_error(e: Exception) -> int:
    """Bad input: one clear message (from rank 0), exit code 2, nothing written."""
    if world().Get_rank() == 0:
        sys.stderr.write(f"simdist: error: {e}\n")
    return 2


def agree(comm, error: str | None) -> None:
    """Every rank learns whether any rank failed a check, so no rank waits alone."""
    errors = comm.allgather(error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, msg = failed[0]
        raise ConfigError(msg if len(set(e for _, e in failed)) == 1 else f"rank {rank}: {msg}")


@dataclass
class Timers:
    started: float  # process entry
    compile_time: float = 0.0
    programming_time: float = 0.0
    train_start: float = 0.0
    train_time: float = 0.0
    first_step: int = 0
    jit_at_start: float = 0.0  # jit_seconds() when training started


class Run:
    def __init__(self, params: Params, schedule: Schedule, started: float):
        self.params, self.schedule = params, schedule
        self.comm = schedule.comm  # the ranks that run the schedule together
        self.rank = world().Get_rank()
        self.is_main = self.rank == 0
        self.timers = Timers(started)
        r = params.runconfig
        self.model_dir = Path(r.model_dir)
        self.micro_batch, self.global_batch = batch_sizes(params, schedule.replicas)
        self.step = 0
        o = params.optimizer
        self.learning_rate = parse_schedule(o.learning_rate, o.warmup_steps)  # rate of a step
        # the simulated accelerator's profile: read here once, every schedule takes it from here
        try:
            self.profile = load_profile(params.runconfig.device_profile)
        except ProfileError as e:
            raise ConfigError(f"runconfig.device_profile: {e}") from None
        self.events: EventWriter | None = None
        self._summary_t = (0.0, 0)
        self._bar: ProgressBar | None = None
        self._log = RunLog(self.model_dir, self.is_main)

    # ----------------------------------------------------------------- set-up
    def build(self) -> None:
        self._note_profile_cpu()
        s = self.schedule
        s.prepare(self)
        if s.compiles:
            # Compile once: rank 0 compiles into numba's on-disk cache, the others then load it.
            if self.is_main:
                self.timers.compile_time = self._compile()
            self.barrier()
            if not self.is_main:
                self.timers.compile_time = self._compile()
            self.barrier()  # or rank 0 would wait for them inside set-up's collectives, spinning
            self.log(f"kernels ready in {self.timers.compile_time:.2f} s (rank 0: compile or load)")
        s.allocate(self)
        self._check_eval_has_checkpoint()
        self._resume()  # before model_dir is touched: a bad checkpoint must leave it as it was
        self._prepare_model_dir()

    def _note_profile_cpu(self) -> None:
        """A profile calibrated on another CPU predicts for that machine: say so first."""
        note = other_cpu_note(self.profile.name, self.profile.sources.get("cpu"))
        if note:
            self.log(note)

    def barrier(self) -> None:
        """A barrier that waits politely (simdist.comm.groups.wait): MPI's blocking one
        busy-polls, and the ranks of a simulated job share a few cores, so ranks waiting for
        one that compiles, loads or writes a checkpoint would take its CPU."""
        wait(self.comm.Ibarrier())

    def _compile(self) -> float:
        # only the kernels this model calls (loading one costs ~25 ms on every rank); a model
        # without a declaration gets them all
        seconds = warm_all(getattr(getattr(self.schedule, "model", None), "kernel_modules", None))
        self.schedule.warm()
        return seconds

    def open_log(self) -> None:
        """model_dir is ours (set-up succeeded on every rank): run.log from here on."""
        if self.is_main:
            self._log.open()
            self.log(f"model_dir: {self.model_dir}")

    def _prepare_model_dir(self) -> None:
        error = None
        if self.is_main and self.model_dir.exists() and not self.model_dir.is_dir():
            error = (
                f"runconfig.model_dir {str(self.model_dir)!r} is a file, not a directory; "
                "choose another runconfig.model_dir"
            )
        elif self.is_main:
            try:
                self.model_dir.mkdir(parents=True, exist_ok=True)
                probe = self.model_dir / f".write-test-{os.getpid()}"
                probe.write_text("")
                probe.unlink()
            except OSError as e:
                error = (
                    f"runconfig.model_dir {str(self.model_dir)!r} is not writable: {e}; "
                    "choose another runconfig.model_dir or fix its permissions"
                )
        agree(self.comm, error)

    def _check_eval_has_checkpoint(self) -> None:
        """``mode: eval`` scores a checkpoint: without one it would score the random
        initial weights and look like a result."""
        r, error = self.params.runconfig, None
        if r.mode == "eval" and not r.checkpoint_path and self.is_main:
            if not r.autoload:
                error = (
                    "runconfig.mode eval with runconfig.autoload false and no "
                    "runconfig.checkpoint_path: nothing to evaluate; give a checkpoint_path"
                )
            elif checkpoint.latest_checkpoint(self.model_dir) is None:
                error = (
                    f"runconfig.mode eval: {str(self.model_dir)!r} holds no checkpoint to "
                    "evaluate; train into it first (mode train or train_and_eval), point "
                    "runconfig.model_dir at a run's directory, or give runconfig.checkpoint_path"
                )
        agree(self.comm, error)

    def _resume(self) -> None:
        """The one checkpoint reader: every rank that holds state reads its part."""
        own = self.schedule.state_shard
        if own is None:
            return
        r = self.params.runconfig
        path = None
        if r.checkpoint_path:
            path = Path(r.checkpoint_path)
            if not path.is_file():
                raise ConfigError(
                    f"runconfig.checkpoint_path: {path} does not exist; give an existing "
                    "checkpoint file, or null to resume from model_dir's latest checkpoint"
                )
        elif r.autoload:
            path = checkpoint.latest_checkpoint(self.model_dir)
            if path is None and (orphans := checkpoint.uncommitted(self.model_dir)):
                self.log(
                    f"note: {self.model_dir} holds {', '.join(orphans)} but no {checkpoint.INDEX} "
                    "listing them (a first save cut short, or the index removed): starting "
                    "at step 0; give runconfig.checkpoint_path=FILE to resume from one"
                )
        if path is None:
            return
        # a schedule whose ranks hold slices (tensor parallel) reads whole tensors
        layout = getattr(self.schedule, "checkpoint_layout", self.schedule.layout)
        shapes = {s.name: s.shape for s in layout.specs}
        # eval reads the weights only: a ZeRO checkpoint's optimizer shards may be absent
        weights_only = r.mode == "eval"
        step, tensors, attrs = checkpoint.load(
            path, shapes, self.schedule.model.name, optimizer=not weights_only
        )
        tp_was, tp = int(attrs.get("tensor_parallel", 1)), r.tensor_parallel
        # one rank holds the whole model in either mode: the mode matters from 2 ranks up
        mode_was = str(attrs.get("tensor_parallel_mode", "batch")) if tp_was > 1 else "batch"
        mode = r.tensor_parallel_mode if tp > 1 else "batch"
        if tp_was != tp or mode_was != mode:  # fixed when a run starts (SambaFlow)
            differ = []
            if tp_was != tp:
                differ.append(f"runconfig.tensor_parallel={tp_was}, this run has {tp}")
            if mode_was != mode:
                differ.append(f"runconfig.tensor_parallel_mode={mode_was}, this run has {mode}")
            raise ConfigError(
                f"{path} was written with {'; and with '.join(differ)}: reshard it first "
                f"(python -m simdist.checkpoint reshard {path} OUT --tensor-parallel {tp} "
                f"--tensor-parallel-mode {mode}) and resume from OUT (runconfig.checkpoint_path)",
                "runconfig.tensor_parallel" if tp_was != tp else "runconfig.tensor_parallel_mode",
            )
        base = own.params_lo
        for seg in layout.segments(base, base + own.params.size):
            off = layout.offsets[seg.name]
            flat = tensors[seg.name].reshape(-1)
            own.write_params(seg.lo, flat[seg.lo - off : seg.hi - off])
        saved = set() if weights_only else set(checkpoint.optimizer_keys(path, attrs))
        if not saved and not weights_only:  # weights only (e.g. imported)
            self.log(f"{path} holds no optimizer state: the optimizer starts fresh")
        loaded = set()
        for key, buf in own.state.items():
            # mixed precision's master weights: absent from an fp32 checkpoint (the
            # schedule's ``restore`` takes them from its parameters)
            if saved and (key in saved or key != "master"):
                buf[...] = checkpoint.read_optimizer_range(path, attrs, key, own.lo, own.hi)
                loaded.add(key)
        self.schedule.restore(self, path, attrs, loaded)
        self.step = step
        mode = attrs.get("execution_mode", "pipelined")
        self.log(
            f"resumed from {path} at global_step = {step} (written in {mode} mode, world size "
            f"{attrs.get('world_size')}, ZeRO-{attrs.get('zero_opt_level')})"
        )

    # ----------------------------------------------------------------- training
    def start_training(self) -> None:
        r = self.params.runconfig
        if self.is_main:
            (self.model_dir / "params.yaml").write_text(dump_yaml(self.params))
            self.events = EventWriter(str(self.model_dir))
        self.barrier()
        now = time.perf_counter()
        self.timers.programming_time = now - self.timers.started
        self.timers.train_start = now
        self.timers.jit_at_start = jit_seconds()
        self.timers.first_step = self.step
        self._summary_t = (now, self.step)
        self.schedule.start(self)
        if self.is_main:
            self._bar = ProgressBar(self.stop_step, self.step, r.progress_bar)
        if self.step >= r.max_steps:
            self.log(f"nothing to train: global_step {self.step} >= max_steps {r.max_steps}")
        elif self.stop_step < r.max_steps:
            self.log(
                f"steps_this_run {r.steps_this_run}: training to global_step {self.stop_step} "
                f"of max_steps {r.max_steps}; run again to resume from its checkpoint"
            )

    @property
    def stop_step(self) -> int:
        """The global step this invocation trains to: max_steps, or sooner with
        ``runconfig.steps_this_run`` (counted from where it started or resumed)."""
        r = self.params.runconfig
        if r.steps_this_run is None:
            return r.max_steps
        return min(r.max_steps, self.timers.first_step + r.steps_this_run)

    def after_step(self, result: StepResult) -> None:
        """``result.stop``: the ranks agreed to stop here (a signal): summary and checkpoint
        now."""
        r, step = self.params.runconfig, self.step
        last = step == self.stop_step or result.stop
        if step % r.save_summary_steps == 0 or last:
            mean_loss = self.schedule.mean_loss(self, result)  # collective
            if self.is_main:
                write_summary(self, step, mean_loss, result.norm)
        if self._bar:
            self._bar.update(step, result.loss if result.mean_loss is None else result.mean_loss)
        early = step == self.stop_step < r.max_steps  # steps_this_run: the next run resumes here
        if (
            result.stop
            or early
            or r.save_checkpoints_steps
            and (step % r.save_checkpoints_steps == 0 or last)
        ):
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        """The one checkpoint writer. Sharded optimizer state: every holder writes its range
        as a shard, then rank 0 commits the main file (parameters, attributes, index)."""
        s = self.schedule
        if hasattr(s, "before_checkpoint"):  # tensor parallel: gather the shards (collective)
            s.before_checkpoint(self)
        own = s.state_shard
        holds = own is not None or self.is_main  # (input workers hold no layout)
        # tensor parallel: the whole tensors' layout
        whole = None
        if holds:
            whole = s.checkpoint_layout if hasattr(s, "checkpoint_layout") else s.layout
        layout = whole.describe() if holds else None
        shards, full_state = [], None
        if own is not None and own.sharded:
            shard = checkpoint.save_optimizer_shard(
                self.model_dir, self.step, own.index, own.count, own.lo, own.hi, layout, own.state
            )
            shards = own.comm.gather(shard, root=0)
        elif own is not None and self.is_main:
            full_state = {
                key: {k: v.copy() for k, v in whole.views(buf).items()}
                for key, buf in own.state.items()
            }
        params = s.checkpoint_parameters(self)  # collective among the holders
        if self.is_main:
            attrs = {
                "model": s.model.name,
                "world_size": s.replicas,
                "zero_opt_level": s.zero_level,
                "optimizer_type": self.params.optimizer.optimizer_type,
                "layout": layout,
                **s.checkpoint_attrs(),
            }
            path = checkpoint.save(
                self.model_dir,
                self.step,
                params,
                full_state,
                attrs,
                self.params.runconfig.keep_checkpoint_max,
                shards,
            )
            self.log(f"saved checkpoint {path}")
        self.barrier()

    def finish_training(self) -> None:
        self.barrier()
        t = self.timers
        t.train_time = time.perf_counter() - t.train_start
        if self._bar:
            self._bar.close()
        late = jit_seconds() - t.jit_at_start
        if late >= 0.005:  # a kernel the warm-up missed: its compile or load is in the step times
            self.log(f"note: {late:.2f} s compiling or loading kernels during training")
        steps = self.step - t.first_step
        samples = steps * self.global_batch
        rate = samples / t.train_time if t.train_time > 0 else 0.0
        self.log(
            f"Training finished with {samples} samples in {t.train_time:.3f} seconds, "
            f"{rate:.2f} samples/second."
        )
        if not self.schedule.evaluates:
            return
        if steps == 0:  # keep the figures of the run that trained (nothing was timed here)
            self.log("performance.json left as it was: no step ran")
            return
        common = {
            "total_samples": samples,
            "total_time": t.train_time,
            "samples_per_sec": rate,
            "compile_time": t.compile_time,
            "programming_time": t.programming_time,
            "steps": steps,
            "global_step": self.step,
        }
        perf = self.schedule.performance(self, common)  # collective
        if self.is_main:
            (self.model_dir / "performance.json").write_text(json.dumps(perf, indent=1))

    # ----------------------------------------------------------------- eval
    def evaluate(self) -> dict:
        """The schedule's ranks score shares of the held-out set; the sums are combined."""
        s = self.schedule
        if not s.evaluates:
            return {}
        extra = getattr(getattr(s, "model", None), "extra_eval", None)  # {metric: [sum, n]}
        for acc in (extra or {}).values():
            acc[:] = [0.0, 0.0]
        totals = s.coll.allreduce_scalars(s.eval_sums(self))
        count = totals[2] * totals[3]
        result = {
            "global_step": self.step,
            "accuracy": totals[1] / count,
            "loss": totals[0] / count,
            "eval_samples": int(totals[2]),
        }
        for key in sorted(extra or {}):  # the same keys on every rank (the model's)
            num, den = s.coll.allreduce_scalars(np.array(extra[key], np.float64))
            if den > 0:  # a metric nothing scored (greedy_eval_samples: 0)
                result[key] = num / den
        if self.is_main:
            self.log(f"eval: accuracy = {result['accuracy']:.4f}, loss = {result['loss']:.6f}")
            self.model_dir.mkdir(parents=True, exist_ok=True)
            (self.model_dir / "eval.json").write_text(json.dumps(result, indent=1))
        return result

    def close(self) -> None:
        if self.events:
            self.events.close()
        self.schedule.close()

    def log(self, message: str) -> None:
        self._log(message)


class RunLog:
    """Rank 0's messages: printed at once, and appended to model_dir/run.log once the
    directory is ours to write (nothing goes into model_dir until set-up has succeeded)."""

    def __init__(self, model_dir: Path, is_main: bool):
        self.path, self.is_main = Path(model_dir) / "run.log", is_main
        self.pending: list[str] = []
        self.opened = False

    def open(self) -> None:
        self.opened = True

    def __call__(self, message: str) -> None:
        if not self.is_main:
            return
        print(message, flush=True)
        self.pending.append(message)
        if self.opened:
            with open(self.path, "a") as f:
                f.write("\n".join(self.pending) + "\n")
            self.pending.clear()


def write_summary(run: Run, step: int, mean_loss: float, norm: float | None) -> None:
    """Rank 0: the summary line and TensorBoard scalars, with the samples/s since the
    previous summary."""
    now = time.perf_counter()
    t0, s0 = run._summary_t
    rate = (step - s0) * run.global_batch / max(now - t0, 1e-9)
    run._summary_t = (now, step)
    extra = f", grad_norm = {norm:.4f}" if norm is not None else ""
    run.log(f"global_step = {step}, loss = {mean_loss:.6f}{extra}")
    run.events.scalar("loss", mean_loss, step)
    run.events.scalar("samples_per_sec", rate, step)
    run.events.scalar("learning_rate", run.learning_rate(step - 1), step)  # the step's own rate
    for name, value in run.schedule.summary_scalars().items():
        run.events.scalar(name, value, step)
    run.events.flush()


class ProgressBar:
    """Rank 0's progress bar (tqdm) on stderr, never in run.log or stdout.

    ``runconfig.progress_bar``: true or false force it; ``auto`` shows it only when stderr
    is a terminal and the ``CI`` environment variable is unset: a bar's carriage returns
    only clutter a captured log, and CI services capture stderr even where they fake a
    terminal."""

    def __init__(self, total: int, initial: int, mode: str | bool):
        on = sys.stderr.isatty() and not os.environ.get("CI") if mode == "auto" else bool(mode)
        self.bar = None
        if on:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, file=sys.stderr, unit="step", dynamic_ncols=True
            )

    def update(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def schedule_for(params: Params, comm) -> Schedule:
    """This rank's execution mode. Collective over ``comm`` (every rank calls it): with
    weight servers or input workers the ranks first split into roles
    (``simdist.comm.groups``)."""
    r = params.runconfig
    if r.execution_mode != "weight_streaming" and not r.input_workers_per_replica:
        if not r.enable_data_parallel and comm.Get_size() > 1:
            raise ConfigError(
                f"runconfig.enable_data_parallel is false but {comm.Get_size()} ranks were "
                "started; enable data parallelism or run one rank"
            )
        weight = r.tensor_parallel > 1 and r.tensor_parallel_mode == "weight"
        if r.pipeline_parallel > 1:
            return Pipeline(comm, r.pipeline_parallel, r.tensor_parallel, weight)
        if weight:
            return TensorParallelWeight(comm, r.tensor_parallel)
        return DataParallel(comm)
    opts = options_from(params)
    W = opts.weight_servers if opts.execution_mode == "weight_streaming" else 0
    roles = Roles.plan(comm.Get_size(), W, opts.input_workers_per_replica)
    if not r.enable_data_parallel and roles.replicas > 1:
        raise ConfigError(
            f"runconfig.enable_data_parallel is false but the ranks make {roles.replicas} "
            "replicas; enable data parallelism or use fewer ranks"
        )
    groups = Groups(comm, roles)
    if groups.role == WORKER:
        return InputWorkers(groups, _alone(comm))
    if opts.execution_mode == "weight_streaming":
        return WeightStreaming(groups, opts)
    return DataParallel(groups.devices, groups)


def _alone(comm):
    """A communicator of this rank alone: its barriers and agreements are trivial
    (MPI_Comm_create_group involves only the group's members, here this rank)."""
    group = comm.Get_group().Incl([comm.Get_rank()])
    alone = comm.Create_group(group)
    group.Free()
    return alone


def setup(argv: list[str], started: float) -> Run:
    comm = world()
    params = load_params(argv)
    params = check_same_run(comm, params)  # same params and code on every rank, else exit 2
    r = params.runconfig
    if comm.Get_size() < r.min_world_size:
        raise ConfigError(
            f"this run needs at least runconfig.min_world_size = {r.min_world_size} ranks, "
            f"but was started with {comm.Get_size()}; launch with mpirun -np "
            f"{r.min_world_size} (or more)"
        )
    run = Run(params, schedule_for(params, comm), started)
    if run.comm is comm:  # every rank runs the schedule: a failure is seen by all
        run.build()
    else:  # roles: the ranks of one role must not wait alone on a failure in another
        error = None
        try:
            run.build()
        except (ConfigError, checkpoint.CheckpointError) as e:  # reported through agreement
            error = str(e)
        results = comm.allgather((error, run.step if error is None else -1))
        failed = [e for e, _ in results if e]
        if failed:
            raise ConfigError(failed[0])
        run.step = max(0, max(s for _, s in results))  # servers resumed; devices learn it
    run.schedule.feed(run)
    run.open_log()
    return run


__all__ = ["Run", "RunLog", "Timers", "agree", "report_config_error", "setup", "write_summary"]
