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
from simdist.device import DeviceMemory, format_bytes
from simdist.faults import nonfinite_text
from simdist.input_workers import device_input, input_report
from simdist.models import build_model
from simdist.optim import Optimizer
from simdist.schedules.base import Schedule, StateShard, StepResult
from simdist.schedules.streaming_io import GradientStream, ServerShard, WeightWindow
from simdist.sim.streaming_step import (
    GRADIENT_SLOTS,
    StepTime,
    device_compute,
    device_step,
    stage_traffic,
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
                "use runconfig.execution_mode=pipelined (weight streaming: gpt2, fc_mnist)"
            )
        self.profile = run.profile
        self.layout = Layout(self.model.parameter_specs(), R)
        self.plan = StreamPlan(self.layout, self.model.stages(), self.model.gradient_groups(), W)
        workers = R * self.roles.workers_per_replica
        run.log(
            f"simdist: weight streaming, {W} weight server(s) + {R} device(s)"
            + (f" + {workers} input worker(s)" if workers else "")
            + f", model {self.model.name}, micro-batch {self.micro_batch} x {self.accum} "
            f"accumulation, global batch {run.global_batch}, prefetch depth "
            f"{self.opts.prefetch_depth}, device profile {self.profile.name}"
        )

    def warm(self) -> None:
        warm_kernels()

    def allocate(self, run) -> None:
        if self.role == SERVER:
            self._allocate_server()
        else:
            self._allocate_device(run)
        run.log(
            f"parameters: {self.layout.numel:,} ({format_bytes(4 * self.layout.numel)}); "
            f"{self.plan.describe()}; largest stage {self.plan.slot_size:,} parameters"
        )

    def _allocate_server(self) -> None:
        p, r = self.params, self.params.runconfig
        prof = self.profile
        cap = prof.streaming.capacity_bytes if prof.streaming else 1 << 62
        self.memory = DeviceMemory(cap, f"{prof.name} weight store")
        self.shard = sh = ServerShard(
            self.plan, self.groups.index, self.groups, self.accum, self.memory
        )

        def alloc(category: str, name: str, n: int) -> np.ndarray:
            return self.memory.allocate(category, f"server.{name}", (n,), F32)

        self.optimizer = Optimizer(p.optimizer, self.layout, sh.lo, sh.hi, alloc)
        # every server draws the whole initialisation (one rng stream, as DP) and keeps its
        # range: the parameters then equal DP's bit for bit
        full = np.zeros(self.layout.padded, F32)
        self.model.init_parameters(self.layout.views(full), np.random.default_rng(r.seed))
        sh.params[...] = full[sh.lo : sh.hi]
        del full
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
            f"largest stage ({format_bytes(4 * self.plan.slot_size)} each), "
            f"{GRADIENT_SLOTS} gradient slots and the activations on the device: lower "
            "runconfig.prefetch_depth or train_input.batch_size"
        )
        self.memory = DeviceMemory.from_profile(self.profile, hint=hint)
        self.dcoll = Collectives(self.groups.devices, r.collective_algorithm, r.check_collectives)
        algorithm = r.collective_algorithm
        if algorithm == "auto":  # as GradientSync: by the whole padded buffer
            algorithm = self.dcoll.choose("reduce_scatter", 4 * self.layout.padded)
        self.window = WeightWindow(
            self.plan, self.groups.stream, self.opts.prefetch_depth, self.memory
        )
        self.sink = GradientStream(self.plan, self.dcoll, self.groups.grads, algorithm, self.memory)
        self.memory.reserve(
            "activations", "model.arena", self.model.activation_bytes(self.micro_batch)
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
            self.model, self.plan.stages, self.profile, self.micro_batch
        )

    def feed(self, run) -> None:
        if self.role == DEVICE:
            self.data = device_input(
                self.data, self.groups, self.micro_batch, run.step, self.params
            )

    def start(self, run) -> None:
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
        sumsq, total_loss, stop = guard.check(n, own_sumsq, loss, lambda: nonfinite_text(n))
        guard.enter("update", n)
        norm = self._update(sumsq, n, run.learning_rate(step))
        return StepResult(loss, norm, stop, mean_loss=total_loss / self.replicas)

    def _server_step(self) -> float:
        sh = self.shard
        reqs = sh.post_stream(self.plan.train_items(self.accum))
        for micro in range(self.accum):
            sh.receive(micro)
        g.wait_all(reqs)
        return sh.sum_of_squares(self.groups.servers)

    def _device_step(self, step: int) -> float:
        model, window, sink, plan = self.model, self.window, self.sink, self.plan
        stages = plan.stages
        dloss = 1.0 / (self.micro_batch * self.accum)  # as the data-parallel step
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

    def _simulate(self) -> StepTime:
        return device_step(
            self.traffic, self.fwd_s, self.bwd_s, self.accum, self.profile, self.opts.prefetch_depth
        )

    def _update(self, sumsq: float, n: int, rate: float) -> float | None:
        """Servers: clip as data parallelism does and apply the optimizer to their range."""
        o = self.params.optimizer
        norm = float(np.sqrt(sumsq)) if o.max_gradient_norm is not None else None
        if self.role != SERVER:
            return norm
        sh = self.shard
        if norm is not None:
            coef = o.max_gradient_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            if coef < 1.0:
                np.multiply(sh.grads, np.float32(coef), out=sh.grads)
        self.optimizer.step(sh.params, sh.grads, n, rate)
        return norm

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
        return {"execution_mode": "weight_streaming", "weight_servers": self.roles.servers}

    def eval_sums(self, run) -> np.ndarray:
        """Each device scores a contiguous share of the held-out set (as data parallelism
        does), in chunks of the micro-batch, the weights streamed for each chunk."""
        R = self.replicas
        chunks: list[tuple[int, int, bool]] = []  # (lo, hi, last chunk of an eval batch)
        meta = (0, 0)
        if self.role == DEVICE:
            n = self.data.num_eval
            d = self.groups.index
            lo, hi = n * d // R, n * (d + 1) // R
            batch = self.params.eval_input.batch_size
            for start in range(lo, hi, batch):
                stop = min(start + batch, hi)
                for c in range(start, stop, self.micro_batch):
                    chunks.append(
                        (c, min(c + self.micro_batch, stop), c + self.micro_batch >= stop)
                    )
            if d == 0:
                meta = (n, self.data.targets_per_sample)
        rounds = max(self.comm.allgather(len(chunks)))
        items = self.plan.forward_items * rounds
        loss_sum, correct = 0.0, 0
        if self.role == SERVER:
            g.wait_all(self.shard.post_stream(items))
        else:
            self.window.start(items)
            nst = len(self.plan.stages)
            batch_loss, batch_correct = 0.0, 0
            for rnd in range(rounds):
                work = rnd < len(chunks)
                if work:
                    c_lo, c_hi, closes = chunks[rnd]
                    x, y = self.data.eval_batch(c_lo, c_hi)
                    self.model.begin(x, y)
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
        return np.array([loss_sum, correct, *meta], np.float64)

    def performance(self, run, common: dict[str, Any]) -> dict[str, Any] | None:
        t, steps = run.timers, common["steps"]
        dev = {}
        if self.role == DEVICE:
            sim = self.device_times[-steps:] if steps else []
            dev = {
                "memory": self.memory.summary(),
                "weights_in_bytes": self.window.bytes_in,
                "gradients_to_servers_bytes": self.sink.bytes_to_servers,
                "gradients_reduce_scatter_bytes": self.dcoll.bytes_sent - self._rs_bytes0,
                "weight_wait_s": self.window.wait_s,
                "sim_total_s": sum(s.total_s for s in sim),
                "sim_compute_s": sum(s.compute_s for s in sim),
                "sim_weight_wait_s": sum(s.weight_wait_s for s in sim),
                "sim_gradient_wait_s": sum(s.gradient_wait_s for s in sim),
                "sim_drain_s": sum(s.drain_s for s in sim),
                "note": self.note,
            }
            inputs = input_report(
                self.groups.devices, self.data.wait_s, t.train_time, self.roles.workers_per_replica
            )
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        gathered = self.comm.gather((self.role, dev, peak_rss), root=0)
        if self.role == DEVICE and self.groups.index == 0:
            self.comm.send(inputs, dest=0, tag=11)
        if not run.is_main:
            return None
        inputs = self.comm.recv(source=self.roles.servers, tag=11)
        devices = [d for role, d, _ in gathered if role == DEVICE]
        per = max(steps, 1)
        analysis = {k: 4 * v for k, v in self.plan.streamed_elements(self.accum).items()}
        d0 = devices[0]
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
            "parameters": self.layout.numel,
            "parameter_bytes": 4 * self.layout.numel,
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
            "server_memory_bytes": self.memory.summary()["peak_bytes"]["total"],
            "peak_rss_bytes": max(rss for _, _, rss in gathered),
            **inputs,
            "host": socket.gethostname(),
        }
