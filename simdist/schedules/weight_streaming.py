"""Weight streaming (Cerebras MemoryX / SwarmX): weight servers and devices.

The ranks split by role (``simdist.comm.groups``); see ``simdist.streaming`` for the plan,
the communicators, the reduction order that keeps bitwise parity with data parallelism and
the simulated step time. A step:

- every server Ibcasts the pieces it owns of each stage's weights, in the order the
  devices use them (forward, then backward, per micro-batch), receives the reduced
  gradient blocks of its groups and passes the norm's lane sums along the server chain;
- every device streams the weights through its window, runs forward and backward stage by
  stage and sends each finished gradient group out (``streaming_io``);
- all of them (``groups.active``) agree on the sum of squares (from the last server), the
  loss (from the devices) and the stop flag; then each server clips and updates its range.

Rank 0 is server 0: it gathers the servers' parameters for checkpoints (optimizer state is
sharded by server) and writes every artifact, through ``simdist.run.Run``.

Mixed precision (``runconfig.precision``, ``simdist.precision``): the servers keep the fp32
master in the optimizer state and stream its half rounding as 16-bit words; the devices
compute as data parallelism's ranks do (half activations, half GEMM operands), store each
gradient group half before its reduction and send it as half words (float32 with
``fp32_allreduce``). Under loss scaling the devices scale the loss, the servers unscale the
summed gradients before the norm, and an overflow on any server skips the step on every
rank (the agreement's sums carry it); server 0 hands the resumed scaler to the devices.
"""

from __future__ import annotations

import resource
import socket
from typing import Any

import numpy as np

from simdist.arena import Layout
from simdist.comm import Collectives
from simdist.comm import groups as g
from simdist.comm.groups import DEVICE, SERVER, Groups, Roles
from simdist.config import ConfigError
from simdist.data.datasets import build_dataset
from simdist.data.sampler import DistributedSampler
from simdist.device import DeviceMemory, format_bytes, write_chrome_trace
from simdist.device.estimate import est_fields, memory_fields, simulated_line
from simdist.faults import nonfinite_text
from simdist.input_workers import device_input, input_report
from simdist.kernels.blas import BACKEND, half_operands
from simdist.loss_scale import describe_scaling, scaler_for, scaler_report
from simdist.models import build_model
from simdist.optim import Optimizer, clip_coefficient
from simdist.precision import Precision, canonical
from simdist.schedules.base import Schedule, StateShard, StepResult
from simdist.schedules.streaming_io import GradientStream, ServerShard, WeightWindow
from simdist.sim.streaming_step import (
    GRADIENT_SLOTS,
    StepTime,
    device_compute,
    device_step,
    stage_traffic,
    step_events,
)
from simdist.streaming import StreamingOptions, StreamPlan, warm_kernels

F32 = np.float32


class WeightStreaming(Schedule):
    """A server or device rank of a weight-streaming job."""

    name = "weight_streaming"

    def __init__(self, groups: Groups, opts: StreamingOptions):
        roles: Roles = groups.roles
        super().__init__(groups.active, roles.replicas, roles.world)
        self.groups, self.opts, self.roles, self.role = groups, opts, roles, groups.role
        self.coll = Collectives(groups.active)  # the agreement, summaries and eval sums
        self.device_times: list[StepTime] = []
        self.note = ""
        self.gemm = f"fp32 {BACKEND} sgemm"  # as half_operands(None) says it

    # ----------------------------------------------------------------- set-up
    def prepare(self, run) -> None:
        p = run.params
        R, W = self.roles.replicas, self.roles.servers
        self.params, self.micro_batch = p, run.micro_batch
        self.accum = p.optimizer.grad_accum_steps
        self.model = build_model(p.model)
        if not hasattr(self.model, "stages"):
            raise ConfigError(
                f"model {self.model.name!r} has no stages, so it cannot stream its weights; "
                "use runconfig.execution_mode=pipelined (every other model streams)"
            )
        if hasattr(self.model, "bind_step"):  # dropout masks hash (seed, global step, sample)
            self.model.bind_step(p.runconfig.seed, lambda: run.step)
        self.profile = run.profile
        self.precision = Precision(canonical(p.runconfig.precision) or "fp32")
        self.scaler = scaler_for(p.runconfig, self.precision.name)
        self.skipped_steps_at_start = 0
        half = self.precision.half is not None
        self.fmt = self.precision.fmt if half else 0  # weights streamed as half words
        self.grad_wire = self.fmt if not p.runconfig.fp32_allreduce else 0
        self.word = self.precision.weight_bytes  # bytes per streamed weight element
        if half and self.role == DEVICE:
            self.model.set_precision(self.precision)
            self.gemm = half_operands(self.fmt)  # every product from here on: half operands
        self.layout = Layout(self.model.parameter_specs(), R)
        self.plan = StreamPlan(self.layout, self.model.stages(), self.model.gradient_groups(), W)
        workers = R * self.roles.workers_per_replica
        run.log(
            f"simdist: weight streaming, {W} weight server(s) + {R} device(s)"
            + (f" + {workers} input worker(s)" if workers else "")
            + f", model {self.model.name}, micro-batch {self.micro_batch} x {self.accum} "
            f"accumulation, global batch {run.global_batch}, prefetch depth "
            f"{self.opts.prefetch_depth}, device profile {self.profile.name}, precision "
            f"{self.precision.name}{self._precision_note()}"
        )

    def _precision_note(self) -> str:
        if self.precision.half is None:
            return ""
        grads = self.precision.half if self.grad_wire else "fp32"
        return (
            f" (fp32 master on the servers, weights streamed in {self.precision.half}, "
            f"gradients reduced and sent in {grads}, {describe_scaling(self.scaler)})"
        )

    def warm(self) -> None:
        warm_kernels()

    def allocate(self, run) -> None:
        if self.role == SERVER:
            self._allocate_server()
        else:
            self._allocate_device(run)
        run.log(
            f"parameters: {self.layout.numel:,} ({format_bytes(4 * self.layout.numel)} in fp32); "
            f"{self.plan.describe()}; largest stage {self.plan.slot_size:,} parameters"
        )

    def _allocate_server(self) -> None:
        p, r = self.params, self.params.runconfig
        prof = self.profile
        cap = prof.streaming.capacity_bytes if prof.streaming else 1 << 62
        self.memory = DeviceMemory(cap, f"{prof.name} weight store")
        self.shard = sh = ServerShard(
            self.plan, self.groups.index, self.groups, self.accum, self.memory,
            self.fmt, self.grad_wire,
        )  # fmt: skip

        def alloc(category: str, name: str, n: int) -> np.ndarray:
            return self.memory.allocate(category, f"server.{name}", (n,), F32)

        half = self.precision.half is not None
        self.optimizer = Optimizer(p.optimizer, self.layout, sh.lo, sh.hi, alloc, master=half)
        # every server draws the whole initialisation (one rng stream, as DP) and keeps its
        # range: the parameters then equal DP's bit for bit
        full = np.zeros(self.layout.padded, F32)
        self.model.init_parameters(self.layout.views(full), np.random.default_rng(r.seed))
        sh.params[...] = full[sh.lo : sh.hi]
        del full
        self._master_from_weights()
        self.state_shard = StateShard(
            self.groups.servers,
            self.groups.index,
            self.roles.servers,
            sh.lo,
            sh.hi,
            self.optimizer.state,
            sharded=True,
            params=sh.params,
            params_lo=sh.lo,
        )

    def _allocate_device(self, run) -> None:
        p, r = self.params, self.params.runconfig
        hint = (
            f"weight streaming keeps {self.opts.prefetch_depth + 1} weight slot(s) of the "
            f"largest stage ({format_bytes(self.word * self.plan.slot_size)} each), "
            f"{GRADIENT_SLOTS} gradient slots and the activations on the device: lower "
            "runconfig.prefetch_depth or train_input.batch_size"
        )
        self.memory = DeviceMemory.from_profile(self.profile, hint=hint)
        self.dcoll = Collectives(self.groups.devices, r.collective_algorithm, r.check_collectives)
        algorithm = r.collective_algorithm
        if algorithm == "auto":  # as GradientSync: by the whole padded buffer
            algorithm = self.dcoll.choose("reduce_scatter", 4 * self.layout.padded)
        self.window = WeightWindow(
            self.plan, self.groups.stream, self.opts.prefetch_depth, self.memory, self.fmt
        )
        self.sink = GradientStream(
            self.plan, self.dcoll, self.groups.grads, algorithm, self.memory,
            self.precision, self.grad_wire,
        )  # fmt: skip
        self.memory.reserve(
            "activations",
            "model.arena",
            self.model.activation_bytes(self.micro_batch) * self.word // 4,
        )
        self.model.allocate(self.micro_batch)
        if self.replicas > 1:
            from simdist.comm.p2p import DEPTH, SEGMENT

            scratch = self.dcoll.reserve_scratch(4 * DEPTH * SEGMENT)
            self.memory.reserve("workspace", "collectives.scratch", scratch)
        self.data = build_dataset(p, self.micro_batch)
        self.sampler = DistributedSampler(
            self.data.num_train,
            run.global_batch,
            self.replicas,
            self.groups.index,
            r.seed,
            p.train_input.shuffle,
            self.accum,
        )
        numel = {sp.name: sp.numel for sp in self.layout.specs}
        self.traffic = stage_traffic(self.plan.stages, self.model.gradient_groups(), numel)
        self.fwd_s, self.bwd_s, self.note = device_compute(
            self.model, self.plan.stages, self.profile, self.micro_batch, self.precision.half
        )

    def feed(self, run) -> None:
        if self.role == DEVICE:
            self.data = device_input(
                self.data, self.groups, self.micro_batch, run.step, self.params
            )

    def start(self, run) -> None:
        if self.scaler is not None:  # the servers resumed it; the devices scale with it too
            self.scaler.load(self.comm.bcast(self.scaler.state(), root=0))
            self.skipped_steps_at_start = self.scaler.skipped_steps
        if self.role == DEVICE:
            self.window.bytes_in = 0
            self.sink.bytes_to_servers = 0
            self._rs_bytes0 = self.dcoll.bytes_sent
            self.memory.reset_peak()

    # ----------------------------------------------------------------- the step
    def step(self, run, step: int, guard) -> StepResult:
        n = step + 1
        guard.enter("forward_backward", n)
        if self.role == SERVER:
            own_sumsq, loss = self._server_step(), 0.0
        else:
            own_sumsq, loss = 0.0, self._device_step(step)
        if self.scaler is None:
            sumsq, total_loss, stop = guard.check(n, own_sumsq, loss, lambda: nonfinite_text(n))
        else:
            sumsq, total_loss, stop, overflow = guard.check_overflow(n, own_sumsq, loss)
            scale = self.scaler.scale
            if not self.scaler.update(overflow):
                run.log(
                    f"global_step {n}: gradients overflowed at loss scale {scale:g}: step "
                    f"skipped, scale now {self.scaler.scale:g} "
                    f"({self.scaler.skipped_steps} skipped so far)"
                )
                return StepResult(loss, None, stop, mean_loss=total_loss / self.replicas)
        guard.enter("update", n)
        # the optimizer's own step count: skipped steps never reached it (GradScaler)
        applied = n - (self.scaler.skipped_steps if self.scaler is not None else 0)
        norm = self._update(sumsq, applied, run.learning_rate(step))
        return StepResult(loss, norm, stop, mean_loss=total_loss / self.replicas)

    def _server_step(self) -> float:
        sh = self.shard
        reqs = sh.post_stream(self.plan.train_items(self.accum))
        for micro in range(self.accum):
            sh.receive(micro)
        g.wait_all(reqs)
        if self.scaler is not None and self.scaler.scale != 1.0:  # unscaled before the norm
            np.multiply(sh.grads, np.float32(1.0 / self.scaler.scale), out=sh.grads)
        return sh.sum_of_squares(self.groups.servers)

    def _device_step(self, step: int) -> float:
        model, window, sink, plan = self.model, self.window, self.sink, self.plan
        stages = plan.stages
        scale = self.scaler.scale if self.scaler is not None else 1.0
        dloss = scale / (self.micro_batch * self.accum)  # as the data-parallel step
        window.start(plan.train_items(self.accum))
        loss, j = 0.0, 0
        for indices in self.sampler.indices(step):
            x, y = self.data.train_batch(indices)
            model.begin(x, y)
            for k in range(len(stages)):
                out = model.forward_stage(k, window.get(j))
                window.release(j)
                j += 1
            loss += out / self.accum
            for k in range(len(stages) - 1, -1, -1):
                sink.prepare(stages[k].forward_params)
                if stages[k].backward_params:
                    model.backward_stage(k, window.get(j), sink, dloss)
                    window.release(j)
                    j += 1
                else:
                    model.backward_stage(k, {}, sink, dloss)
        sink.flush()
        self.device_times.append(self._simulate())
        return loss

    def _simulate(self, spans: list | None = None) -> StepTime:
        return device_step(
            self.traffic, self.fwd_s, self.bwd_s, self.accum, self.profile,
            self.opts.prefetch_depth, self.word, spans,
        )  # fmt: skip

    def _trace_events(self, steps: int) -> list[dict]:
        """A device's first ``steps`` simulated steps as trace events (every step replays
        the same stage list: the same spans, shifted)."""
        spans: list = []
        step = self._simulate(spans)
        return step_events(spans, self.plan.stages, step.total_s, steps)

    def _write_timeline(self, run, events: list[dict], steps: int, devices: int) -> None:
        """Rank 0 (a server): ``model_dir/timeline.json`` from device 0's events, one
        process per device (every device replays the same steps)."""
        write_chrome_trace(
            run.model_dir / "timeline.json",
            [events] * devices,
            rank_labels=[f"device {d} ({self.profile.name})" for d in range(devices)],
            metadata={
                "profile": self.profile.name,
                "profile_sha256": self.profile.sha256,
                "steps_traced": steps,
                "note": "simulated weight-streaming steps (simdist.sim.streaming_step): "
                "stages on the compute track, weights in and gradients out on the "
                "communication track; every device replays the same steps",
            },
        )

    def _update(self, sumsq: float, n: int, rate: float) -> float | None:
        """Servers: clip as data parallelism does and apply the optimizer to their range."""
        o = self.params.optimizer
        norm = float(np.sqrt(sumsq)) if o.max_gradient_norm is not None else None
        if self.role != SERVER:
            return norm
        sh = self.shard
        coef = clip_coefficient(o.max_gradient_norm, norm)  # applied in the update's pass
        if self.precision.half is None:
            self.optimizer.step(sh.params, sh.grads, n, rate, coef)
        else:
            master = self.optimizer.state["master"]
            self.optimizer.step(master, sh.grads, n, rate, coef)
            self.precision.store_into(sh.params, master)
            sh.pack()
        return norm

    def _master_from_weights(self) -> None:
        """Mixed precision, servers: the fp32 weights of the range become the master, the
        weights its half rounding (and their words)."""
        if self.precision.half is None:
            return
        sh = self.shard
        np.copyto(self.optimizer.state["master"], sh.params)
        self.precision.store(sh.params)
        sh.pack()

    # ----------------------------------------------------------------- around the steps
    def checkpoint_parameters(self, run) -> dict[str, np.ndarray] | None:
        """Servers send rank 0 their parameter ranges (the devices hold none)."""
        if self.role != SERVER:
            return None
        parts = self.groups.servers.gather(self.shard.params, root=0)
        if parts is None:
            return None
        full = np.zeros(self.layout.padded, F32)
        for s, part in enumerate(parts):
            lo, hi = self.plan.ranges[s]
            full[lo:hi] = part
        return self.layout.views(full)

    def checkpoint_attrs(self) -> dict[str, Any]:
        attrs = {
            "execution_mode": "weight_streaming",
            "weight_servers": self.roles.servers,
            "precision": self.precision.name,
        }
        if self.scaler is not None:
            attrs.update({f"loss_scaler.{k}": v for k, v in self.scaler.state().items()})
        return attrs

    def restore(self, run, path, attrs: dict[str, Any], loaded: set[str]) -> None:
        """Servers, after ``Run`` read their range: the loss scaler (handed to the devices
        in ``start``), and the master from the parameters of a checkpoint without one."""
        if self.scaler is not None and "loss_scaler.scale" in attrs:
            self.scaler.load({k: attrs[f"loss_scaler.{k}"] for k in self.scaler.state()})
        if self.precision.half is not None and "master" not in loaded:
            self._master_from_weights()
            if self.groups.index == 0:
                run.log(
                    f"{path} was written in {attrs.get('precision', 'fp32')}: its parameters "
                    f"become the fp32 master weights of this {self.precision.name} run"
                )
        elif self.precision.half is not None:  # the weights streamed are the master's
            self.precision.store_into(self.shard.params, self.optimizer.state["master"])
            self.shard.pack()

    def summary_scalars(self) -> dict[str, float]:
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped_steps}

    def eval_sums(self, run) -> np.ndarray:
        """Each device scores a contiguous share of the held-out set (as data parallelism
        does), in chunks of the micro-batch, the weights streamed for each chunk; then, for
        a model that decodes (the Transformer's greedy exact match), the weights streamed
        again for each decoding pass. The servers stream one sequence to all devices, so
        every device takes as many rounds as the busiest one."""
        R = self.replicas
        to_decode: list[tuple[np.ndarray, np.ndarray]] = []  # eval batches, when decoding
        chunks: list[tuple[int, int, bool]] = []  # (lo, hi, last chunk of an eval batch)
        meta, passes = (0, 0), 0
        decodes = self.role == DEVICE and hasattr(self.model, "score_decoding")
        if self.role == DEVICE:
            n = self.num_eval()
            d = self.groups.index
            lo, hi = n * d // R, n * (d + 1) // R
            batch = self.params.eval_input.batch_size
            for start in range(lo, hi, batch):
                stop = min(start + batch, hi)
                for c in range(start, stop, self.micro_batch):
                    chunks.append(
                        (c, min(c + self.micro_batch, stop), c + self.micro_batch >= stop)
                    )
                if decodes:
                    to_decode.append(self.data.eval_batch(start, stop))
                    passes += self.model.decode_passes(to_decode[-1][0])
            if d == 0:
                meta = self.eval_meta(n)
        counts = self.comm.allgather((len(chunks), passes))
        rounds, passes = (max(c[i] for c in counts) for i in (0, 1))
        nst = len(self.plan.stages)
        if self.role == SERVER:
            g.wait_all(self.shard.post_stream(self.plan.forward_items * (rounds + passes)))
            return np.array([0.0, 0, *meta], np.float64)
        self.window.start(self.plan.forward_items * (rounds + passes))
        loss_sum, correct = 0.0, 0
        batch_loss, batch_correct = 0.0, 0
        for rnd in range(rounds):
            work = rnd < len(chunks)
            if work:
                c_lo, c_hi, closes = chunks[rnd]
                x, y = self.data.eval_batch(c_lo, c_hi)
                self.model.begin(x, y, training=False)  # no dropout
            for k in range(nst):
                j = rnd * nst + k
                params = self.window.get(j)
                if work:
                    self.model.forward_stage(k, params)
                self.window.release(j)
            if work:
                # sums in the order the data-parallel eval and GPT2.evaluate add them
                l, c = self.model.eval_stats()
                batch_loss, batch_correct = batch_loss + l, batch_correct + c
                if closes:
                    loss_sum, correct = loss_sum + batch_loss, correct + batch_correct
                    batch_loss, batch_correct = 0.0, 0
        j = rounds * nst

        def streamed_forward() -> None:  # one evaluation forward on the next items
            nonlocal j
            for k in range(nst):
                self.model.forward_stage(k, self.window.get(j))
                self.window.release(j)
                j += 1

        for inputs, targets in to_decode:
            self.model.score_decoding(inputs, targets, streamed_forward)
        while j < (rounds + passes) * nst:  # the passes of busier devices, or rows that ended
            self.window.get(j)
            self.window.release(j)
            j += 1
        return np.array([loss_sum, correct, *meta], np.float64)

    def _estimate(self, run, devices: list[dict[str, Any]], per: int) -> dict[str, Any]:
        """performance.json's simulated-device fields (``simdist.device.estimate``), from
        the devices' simulated steps (``device_times``): the step is the slowest device's
        (all replay the same stage list, so it is ``simulated_step_time_s``), split into
        compute and exposed streaming (weights in, gradients out: the mode's
        communication). No ``other``: the streaming replay simulates the device alone and
        this mode measures no host time the device would wait for, so the estimate holds
        no measured part (data parallelism and pipelines add theirs)."""
        slow = max(devices, key=lambda d: d["sim_total_s"])
        total, compute = slow["sim_total_s"] / per, slow["sim_compute_s"] / per
        out = est_fields(
            self.profile,
            run.global_batch,
            total,
            {"compute": compute, "exposed_comm": total - compute},
        )
        mem = memory_fields([d["memory"] for d in devices], devices[0]["memory"]["capacity_bytes"])
        del mem["device_memory_rank0"]  # rank 0 is a weight server: device_memory has each device's
        return {**out, **mem}

    def performance(self, run, common: dict[str, Any]) -> dict[str, Any] | None:
        t, steps = run.timers, common["steps"]
        dev = {}
        if self.role == DEVICE:
            sim = self.device_times[-steps:] if steps else []
            dev = {
                "memory": self.memory.summary(),
                "weights_in_bytes": self.window.bytes_in,
                "host_window_bytes": self.window.host_bytes,
                "gradients_to_servers_bytes": self.sink.bytes_to_servers,
                "gradients_reduce_scatter_bytes": self.dcoll.bytes_sent - self._rs_bytes0,
                "weight_wait_s": self.window.wait_s,
                "sim_total_s": sum(s.total_s for s in sim),
                "sim_compute_s": sum(s.compute_s for s in sim),
                "sim_weight_wait_s": sum(s.weight_wait_s for s in sim),
                "sim_gradient_wait_s": sum(s.gradient_wait_s for s in sim),
                "sim_drain_s": sum(s.drain_s for s in sim),
                "note": self.note,
                "gemm": self.gemm,
            }
            inputs = input_report(
                self.groups.devices, self.data.wait_s, t.train_time, self.roles.workers_per_replica
            )
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        gathered = self.comm.gather((self.role, dev, peak_rss), root=0)
        traced = min(self.params.runconfig.trace_steps, steps)
        if self.role == DEVICE and self.groups.index == 0:
            events = self._trace_events(traced) if traced else []
            self.comm.send((inputs, events), dest=0, tag=11)
        if not run.is_main:
            return None
        inputs, events = self.comm.recv(source=self.roles.servers, tag=11)
        devices = [d for role, d, _ in gathered if role == DEVICE]
        per = max(steps, 1)
        analysis = {k: self.word * v for k, v in self.plan.streamed_elements(self.accum).items()}
        d0 = devices[0]
        simulated = self._estimate(run, devices, per) if steps else {}
        if traced:
            self._write_timeline(run, events, traced, len(devices))
        line = simulated_line(simulated)
        if line:
            run.log(line)
        return {
            "execution_mode": "weight_streaming",
            "weight_servers": self.roles.servers,
            "replicas": self.roles.replicas,
            "prefetch_depth": self.opts.prefetch_depth,
            "device_profile": self.profile.name,
            **common,
            "world_size": self.roles.world,
            "global_batch_size": run.global_batch,
            "micro_batch_size": self.micro_batch,
            "grad_accum_steps": self.accum,
            "precision": self.precision.name,
            "gemm": d0["gemm"],  # how the devices' matrix products ran (kernels.blas)
            **scaler_report(self.scaler, self.skipped_steps_at_start),
            "parameters": self.layout.numel,
            "parameter_bytes": 4 * self.layout.numel,
            "streamed_bytes_per_element": self.word,
            "step_time_s": t.train_time / per,
            "simulated_step_time_s": d0["sim_total_s"] / per,
            "simulated_compute_s_per_step": d0["sim_compute_s"] / per,
            "exposed_streaming_time_s": (d0["sim_total_s"] - d0["sim_compute_s"]) / per,
            "exposed_weight_wait_s": d0["sim_weight_wait_s"] / per,
            "exposed_gradient_wait_s": d0["sim_gradient_wait_s"] / per,
            "exposed_gradient_drain_s": d0["sim_drain_s"] / per,
            "measured_weight_wait_s_per_step": max(d["weight_wait_s"] for d in devices) / per,
            "streamed_bytes_per_step": {
                "weights_in": d0["weights_in_bytes"] / per,
                "gradients_out": (
                    d0["gradients_to_servers_bytes"] + d0["gradients_reduce_scatter_bytes"]
                )
                / per,
                "gradients_to_servers": d0["gradients_to_servers_bytes"] / per,
                "gradients_among_devices": d0["gradients_reduce_scatter_bytes"] / per,
            },
            "streamed_bytes_analysis": analysis,
            "streaming_bandwidth_bytes_per_s": (
                self.profile.streaming.bandwidth if self.profile.streaming else None
            ),
            "compute_model": d0["note"],
            "not_modelled": "server-side optimizer time; link latency (none published)",
            "device_capacity_bytes": d0["memory"]["capacity_bytes"],
            "device_peak_bytes": max(d["memory"]["peak_bytes"]["total"] for d in devices),
            "device_memory": [d["memory"] for d in devices],
            # a device's weight slots on this host (16-bit words: and one float32 copy)
            "host_window_bytes": d0["host_window_bytes"],
            "server_memory_bytes": self.memory.summary()["peak_bytes"]["total"],
            **simulated,
            "peak_rss_bytes": max(rss for _, _, rss in gathered),
            **inputs,
            "host": socket.gethostname(),
        }
