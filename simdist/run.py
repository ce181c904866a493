"""Everything around the training loop: set-up, summaries, checkpoints, eval, artifacts.

``setup`` turns argv into a ``Run``: params resolved and checked on every rank, the model
and its flat parameter/gradient buffers, the optimizer over this rank's update range, the
collectives, the data and sampler, and a resumed state when model_dir holds a checkpoint.
Rank 0 alone prints and writes shared artifacts (params.yaml, events, performance.json,
checkpoints); other ranks contribute through collectives.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simdist import checkpoint, simulate
from simdist.arena import Layout
from simdist.comm import Collectives
from simdist.comm.shm import window_room_error
from simdist.comm.topology import Placement, placement
from simdist.comm.world import world
from simdist.config import ConfigError, Params, batch_sizes, dump_yaml, load_params
from simdist.data.datasets import build_dataset
from simdist.data.sampler import DistributedSampler
from simdist.events import EventWriter
from simdist.faults import check_same_run
from simdist.input_workers import MeasuredInput, input_report
from simdist.kernels.registry import warm_all
from simdist.lr_schedule import parse_schedule
from simdist.memplan import DeviceAllocator, check_device_memory
from simdist.models import build_model
from simdist.models.base import GradientViews
from simdist.optim import Optimizer
from simdist.parallel import GradientSync


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


class Run:
    def __init__(self, params: Params, comm, started: float):
        self.params, self.comm = params, comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.is_main = self.rank == 0
        self.timers = Timers(started)
        r = params.runconfig
        self.model_dir = Path(r.model_dir)
        self.micro_batch, self.global_batch = batch_sizes(params, self.world)
        self.placement = (
            placement(comm)
            if r.ranks_per_node is None
            else Placement.blocks(self.rank, self.world, r.ranks_per_node)
        )
        if r.collective_algorithm == "hierarchical" and not self.placement.uniform:
            raise ConfigError(
                "runconfig.collective_algorithm=hierarchical needs the same number of ranks on "
                f"every node; this run has {list(self.placement.ranks_per_node)} on its "
                f"{self.placement.num_nodes} nodes (use auto, ring or rhd, or place ranks evenly)"
            )
        if r.collective_algorithm == "shm" and self.placement.num_nodes > 1:
            raise ConfigError(
                "runconfig.collective_algorithm=shm needs every rank on one node (shared "
                f"memory); this run has {self.placement.num_nodes} nodes (use auto, ring, rhd "
                "or hierarchical)"
            )
        self.coll = Collectives(
            comm, r.collective_algorithm, r.check_collectives, placement=self.placement
        )
        # the simulated accelerator (simdist.simulate); its accounted memory backs run.memory
        self.device = simulate.create_device(r, comm, self.placement)
        self.memory = DeviceAllocator(self.device.memory, self.coll)
        self.step = 0
        o = params.optimizer
        self.learning_rate = parse_schedule(o.learning_rate, o.warmup_steps)  # rate of a step
        self.events: EventWriter | None = None
        self._summary_t = (0.0, 0)
        self._log = RunLog(self.model_dir, self.is_main)

    # ----------------------------------------------------------------- set-up
    def build(self) -> None:
        p, r = self.params, self.params.runconfig
        self.model = build_model(p.model)
        if hasattr(self.model, "bind_step"):  # dropout masks hash (seed, global step, sample)
            self.model.bind_step(r.seed, lambda: self.step)
        self.data = build_dataset(p, self.micro_batch)
        self._choose_shared_buffers()
        check_device_memory(self)  # simulated OOM now, before any buffer exists
        self.log(
            f"simdist: {self.world} replica(s), model {self.model.name}, micro-batch "
            f"{self.micro_batch} x {p.optimizer.grad_accum_steps} accumulation, global batch "
            f"{self.global_batch} ({self._batch_origin()}), ZeRO-{r.zero_opt_level}, "
            f"collectives {r.collective_algorithm}; data: {self.data.source}"
        )
        # Compile once: rank 0 compiles into numba's on-disk cache, the others then load it.
        if self.is_main:
            self.timers.compile_time = warm_all()
        self.comm.Barrier()
        if not self.is_main:
            self.timers.compile_time = warm_all()
        self.log(f"kernels ready in {self.timers.compile_time:.2f} s (rank 0: compile or load)")

        specs = self.model.parameter_specs()
        self.layout = layout = Layout(specs, self.world)
        # buffers of the training collectives: shared memory where the ranks share a node
        self.params_flat = self.memory.alloc("parameters", "params", layout.padded, shared=True)
        self.pviews = layout.views(self.params_flat)
        accum = p.optimizer.grad_accum_steps
        self.sync = GradientSync(
            self.coll, layout, r.zero_opt_level, r.collective_algorithm, self.shared_buffers
        )
        place = self.placement
        self.log(
            f"placement: {place.num_nodes} node(s), ranks per node "
            f"{list(dict.fromkeys(place.ranks_per_node))}"
            f"{' (virtual: runconfig.ranks_per_node)' if r.ranks_per_node else ''}; "
            f"gradient collectives: {self.sync.algorithm}"
        )
        self.micro_grads = None
        if r.zero_opt_level == 2:
            # gradients exist only as this rank's slice plus a bucket (see parallel.py)
            self.grads = None
            self.gviews = self.sync.make_sharded(self.model.gradient_groups(), self.memory.alloc)
        else:
            self.grads = self.memory.alloc("gradients", "grads", layout.padded, shared=True)
            if accum > 1:  # the model writes each micro-batch into scratch, summed into grads
                self.micro_grads = self.memory.alloc("gradients", "micro_grads", layout.padded)
            self.gviews = GradientViews(layout.views(self.micro_grads if accum > 1 else self.grads))
        nbytes = self.model.activation_bytes(self.micro_batch)
        self.memory.reserve("activations", "model.arena", nbytes)  # accounted, then allocated
        self.model.allocate(self.micro_batch)

        lo, hi = self.sync.update_range
        self.optimizer = Optimizer(p.optimizer, layout, lo, hi, self.memory.alloc)
        self.sampler = DistributedSampler(
            self.data.num_train,
            self.global_batch,
            self.world,
            self.rank,
            r.seed,
            p.train_input.shuffle,
            accum,
        )
        self.model.init_parameters(self.pviews, np.random.default_rng(r.seed))
        self.coll.broadcast(self.params_flat, root=0)  # replicas start identical, as DDP
        self.sim = simulate.attach(self)  # hooks the loop's calls; per-step device time
        self.log(
            f"parameters: {layout.numel:,} ({layout.padded:,} padded); memory per rank: "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.memory.bytes.items())
        )
        self._resume()  # before model_dir is touched: a bad checkpoint must leave it as it was
        self._prepare_model_dir()
        if self.is_main:
            self.open_log()

    def _batch_origin(self) -> str:
        t = self.params.train_input
        return "global given" if t.global_batch_size is not None else "per replica given"

    def _prepare_model_dir(self) -> None:
        error = None
        if self.is_main:
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

    def _choose_shared_buffers(self) -> None:
        """Parameters and gradients (or ZeRO-2's bucket) in shared-memory windows, for the
        "shm" collectives, where the ranks share a node and its shared memory has room."""
        padded = Layout(self.model.parameter_specs(), self.world).padded
        self.shared_buffers = self.coll.can_share(8 * padded)  # collective
        if not self.shared_buffers:
            self.memory.coll = None  # alloc(shared=True) gives plain arrays
        if self.coll.shared and not self.shared_buffers:
            room = window_room_error(8 * padded * self.world)
            if self.params.runconfig.collective_algorithm == "shm":
                raise ConfigError(
                    f"runconfig.collective_algorithm=shm: {room}, or choose auto, ring or rhd"
                )
            self.log(f"shared memory: {room}; the gradients use message-passing collectives")

    def _resume(self) -> None:
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
        if path is None:
            return
        shapes = {s.name: s.shape for s in self.layout.specs}
        step, tensors, attrs = checkpoint.load(path, shapes, self.model.name)
        for name, value in tensors.items():
            self.pviews[name][...] = value
        lo, hi = self.sync.update_range
        if not checkpoint.optimizer_keys(path, attrs):  # weights only (e.g. imported)
            self.log(f"{path} holds no optimizer state: the optimizer starts fresh")
        else:
            for key, buf in self.optimizer.state.items():
                buf[...] = checkpoint.read_optimizer_range(path, attrs, key, lo, hi)
        self.step = step
        origin = f"world size {attrs.get('world_size')}, ZeRO-{attrs.get('zero_opt_level')}"
        self.log(f"resumed from {path} at global_step = {step} (written at {origin})")

    # ----------------------------------------------------------------- per step
    def gradients(self, micro: int) -> GradientViews:
        """Where the model writes micro-batch ``micro``'s gradients."""
        if self.grads is None:
            self.gviews.begin_micro_batch(micro)
        return self.gviews

    def accumulate_gradients(self, micro: int) -> None:
        if self.micro_grads is None:
            return
        if micro == 0:
            np.copyto(self.grads, self.micro_grads)
        else:
            np.add(self.grads, self.micro_grads, out=self.grads)

    def clip(self, grads: np.ndarray, sumsq: float | None = None) -> float | None:
        """Global-norm clipping; ``sumsq``: the global sum of squares if already reduced."""
        max_norm = self.params.optimizer.max_gradient_norm
        if max_norm is None:
            return None
        norm = self.sync.global_norm(grads) if sumsq is None else float(np.sqrt(sumsq))
        coef = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            np.multiply(grads, np.float32(coef), out=grads)
        return norm

    def start_training(self) -> None:
        r = self.params.runconfig
        if self.is_main:
            (self.model_dir / "params.yaml").write_text(dump_yaml(self.params))
            self.events = EventWriter(str(self.model_dir))
        self.comm.Barrier()
        now = time.perf_counter()
        self.timers.programming_time = now - self.timers.started
        self.timers.train_start = now
        self.timers.first_step = self.step
        self._bytes_at_start = self.coll.bytes_sent
        self._summary_t = (now, self.step)
        self._bar = _ProgressBar(r.max_steps, r.progress_bar) if self.is_main else None
        if self.step >= r.max_steps:
            self.log(f"nothing to train: global_step {self.step} >= max_steps {r.max_steps}")

    def after_step(self, loss: float, norm: float | None, stop: bool = False) -> None:
        """``stop``: the ranks agreed to stop here (a signal): summary and checkpoint now."""
        r, step = self.params.runconfig, self.step
        if self._bar:
            self._bar.update(step, loss)
        last = step == r.max_steps or stop
        if step % r.save_summary_steps == 0 or last:
            mean_loss = self.coll.allreduce_scalars(np.array([loss]))[0] / self.world
            self.check_replicas()
            if self.is_main:
                write_summary(self, step, mean_loss, norm)
        if stop or r.save_checkpoints_steps and (step % r.save_checkpoints_steps == 0 or last):
            self.save_checkpoint()

    def check_replicas(self) -> None:
        """Replicas must hold bitwise-identical parameters: compare a hash across ranks."""
        digest = zlib.crc32(self.params_flat.view(np.uint8))
        digests = self.comm.allgather(digest)
        if len(set(digests)) != 1:
            raise RuntimeError(
                f"replicas diverged at global_step {self.step}: parameter CRC32 per rank "
                f"{[hex(d) for d in digests]}"
            )

    def save_checkpoint(self) -> None:
        """ZeRO: every rank writes its optimizer slice, then rank 0 commits the checkpoint."""
        lo, hi = self.sync.update_range
        layout = self.layout.describe()
        shards, full_state = [], None
        if self.sync.level > 0:
            shard = checkpoint.save_optimizer_shard(
                self.model_dir,
                self.step,
                self.rank,
                self.world,
                lo,
                hi,
                layout,
                self.optimizer.state,
            )
            shards = self.comm.gather(shard, root=0)
        elif self.is_main:
            full_state = {
                key: {k: v.copy() for k, v in self.layout.views(buf).items()}
                for key, buf in self.optimizer.state.items()
            }
        if self.is_main:
            attrs = {
                "model": self.model.name,
                "world_size": self.world,
                "zero_opt_level": self.params.runconfig.zero_opt_level,
                "optimizer_type": self.params.optimizer.optimizer_type,
                "layout": layout,
            }
            path = checkpoint.save(
                self.model_dir,
                self.step,
                self.pviews,
                full_state,
                attrs,
                self.params.runconfig.keep_checkpoint_max,
                shards,
            )
            self.log(f"saved checkpoint {path}")
        self.comm.Barrier()

    def finish_training(self) -> None:
        self.comm.Barrier()
        t = self.timers
        t.train_time = time.perf_counter() - t.train_start
        if self._bar:
            self._bar.close()
        steps = self.step - t.first_step
        samples = steps * self.global_batch
        # peak resident memory of the busiest rank (Linux reports ru_maxrss in KiB)
        peak_rss = max(self.comm.allgather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
        sent = self.coll.bytes_sent - self._bytes_at_start
        rate = samples / t.train_time if t.train_time > 0 else 0.0
        self.log(
            f"Training finished with {samples} samples in {t.train_time:.3f} seconds, "
            f"{rate:.2f} samples/second."
        )
        simulated = self.sim.finish(self.model_dir, self.global_batch)  # collective
        if simulated and simulated["est_samples_per_sec"]:
            self.log(
                f"Simulated on {simulated['device_profile']}: "
                f"{simulated['est_samples_per_sec']:.2f} samples/second "
                f"({1e3 * simulated['est_step_time_s']:.3f} ms per step)."
            )
        inputs = input_report(  # collective: how long replicas waited on their input
            self.comm,
            getattr(self.data, "wait_s", 0.0),
            t.train_time,
            self.params.runconfig.input_workers_per_replica,
        )
        if self.is_main:
            perf = {
                "total_samples": samples,
                "total_time": t.train_time,
                "samples_per_sec": rate,
                "compile_time": t.compile_time,
                "programming_time": t.programming_time,
                "steps": steps,
                "global_step": self.step,
                "world_size": self.world,
                "global_batch_size": self.global_batch,
                "micro_batch_size": self.micro_batch,
                "grad_accum_steps": self.params.optimizer.grad_accum_steps,
                "zero_opt_level": self.params.runconfig.zero_opt_level,
                "collective_algorithm": self.params.runconfig.collective_algorithm,
                "gradient_algorithm": self.sync.algorithm,  # what "auto" resolved to
                "nodes": self.placement.num_nodes,
                "parameters": self.layout.numel,
                "parameters_padded": self.layout.padded,
                "memory_bytes": dict(self.memory.bytes),
                "step_time_s": t.train_time / max(steps, 1),
                "peak_rss_bytes": peak_rss * 1024,
                # bytes this rank sent per step, summaries and checkpoint gathers included
                "comm_bytes_sent_per_step": sent / max(steps, 1),
                "host": socket.gethostname(),
                **(simulated or {}),
                **inputs,
            }
            (self.model_dir / "performance.json").write_text(json.dumps(perf, indent=1))

    # ----------------------------------------------------------------- eval
    def evaluate(self) -> dict:
        """Each rank scores a contiguous share of the held-out set; sums are combined."""
        n = self.data.num_eval
        lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
        batch = self.params.eval_input.batch_size
        loss_sum, correct = 0.0, 0
        extra = getattr(self.model, "extra_eval", None)  # {metric: [sum, count]}, fixed keys
        for acc in (extra or {}).values():
            acc[:] = [0.0, 0.0]
        for start in range(lo, hi, batch):
            x, y = self.data.eval_batch(start, min(start + batch, hi))
            l, c = self.model.evaluate(self.pviews, x, y)
            loss_sum, correct = loss_sum + l, correct + c
        totals = self.coll.allreduce_scalars(np.array([loss_sum, correct], np.float64))
        count = n * self.data.targets_per_sample
        result = {
            "global_step": self.step,
            "accuracy": totals[1] / count,
            "loss": totals[0] / count,
            "eval_samples": n,
        }
        for key in sorted(extra or {}):  # the same keys on every rank (the model's)
            num, den = self.coll.allreduce_scalars(np.array(extra[key], np.float64))
            result[key] = num / max(den, 1.0)
        if self.is_main:
            self.log(f"eval: accuracy = {result['accuracy']:.4f}, loss = {result['loss']:.6f}")
            self.model_dir.mkdir(parents=True, exist_ok=True)
            (self.model_dir / "eval.json").write_text(json.dumps(result, indent=1))
        return result

    def close(self) -> None:
        if self.events:
            self.events.close()
        if hasattr(getattr(self, "data", None), "close"):  # input workers: STOP / END
            self.data.close()

    def log(self, message: str) -> None:
        self._log(message)

    def open_log(self) -> None:
        self._log.open()
        self.log(f"model_dir: {self.model_dir}")


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


def write_summary(run, step: int, mean_loss: float, norm: float | None) -> None:
    """Rank 0 of a run (pipelined or streaming): the summary line and TensorBoard scalars,
    with the samples/s since the previous summary."""
    now = time.perf_counter()
    t0, s0 = run._summary_t
    rate = (step - s0) * run.global_batch / max(now - t0, 1e-9)
    run._summary_t = (now, step)
    extra = f", grad_norm = {norm:.4f}" if norm is not None else ""
    run.log(f"global_step = {step}, loss = {mean_loss:.6f}{extra}")
    run.events.scalar("loss", mean_loss, step)
    run.events.scalar("samples_per_sec", rate, step)
    run.events.scalar("learning_rate", run.learning_rate(step - 1), step)  # the step's own rate
    run.events.flush()


class _ProgressBar:
    """A one-line progress bar on rank 0's terminal (off when output is not a terminal)."""

    def __init__(self, total: int, mode):
        self.total = total
        self.on = sys.stderr.isatty() if mode == "auto" else bool(mode)

    def update(self, step: int, loss: float) -> None:
        if self.on:
            width = 30
            done = int(width * step / max(self.total, 1))
            bar = "#" * done + "." * (width - done)
            sys.stderr.write(f"\r[{bar}] {step}/{self.total} loss {loss:.4f}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")


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
    if r.execution_mode == "weight_streaming" or r.input_workers_per_replica:
        from simdist.streaming import setup_roles  # ranks take roles: servers, workers

        return setup_roles(params, comm, started)
    if not r.enable_data_parallel and comm.Get_size() > 1:
        raise ConfigError(
            f"runconfig.enable_data_parallel is false but {comm.Get_size()} ranks were "
            "started; enable data parallelism or run one rank"
        )
    run = Run(params, comm, started)
    run.build()
    run.data = MeasuredInput(run.data)  # times batch preparation (input bottleneck)
    return run
