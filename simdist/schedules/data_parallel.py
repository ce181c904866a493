"""Synchronous data parallelism with ZeRO 0-3: every rank a replica.

Every rank holds the whole model's parameters (in shared memory where the ranks share a
node; ZeRO-3: only its slice, in private memory, plus two gather windows,
``simdist.parallel.PartitionedParameters``), its gradients (ZeRO-2/3: only its slice and a
bucket) and the optimizer state of its update range (``simdist.parallel.GradientSync``).
A step: each micro-batch forward and backward on this rank's samples, the gradient sync,
the per-step agreement (non-finite check, stop flag; ``simdist.faults.StepGuard``),
clipping, the update of this rank's range and the parameter gather (ZeRO-3: none; each
stage gathers its own). In mixed precision (``simdist.precision``) the update runs on the
optimizer's fp32 master copy, the weights are its half-precision rounding, gradients are
reduced in the half format, and under loss scaling an overflow on any rank skips the step.
The simulated accelerator (``simdist.simulate``) hooks this object's calls, so it carries
the attributes ``simulate.attach`` and ``memplan`` read.
"""

from __future__ import annotations

import resource
import socket
import zlib
from typing import Any

import numpy as np

from simdist import simulate
from simdist.arena import Layout
from simdist.comm import Collectives
from simdist.comm.shm import window_room_error
from simdist.comm.topology import Placement, placement
from simdist.config import ConfigError
from simdist.data.datasets import build_dataset
from simdist.data.sampler import DistributedSampler
from simdist.device.estimate import simulated_line
from simdist.faults import describe_nonfinite
from simdist.input_workers import device_input, input_report
from simdist.kernels.blas import half_operands
from simdist.kernels.optim import sum_of_squares
from simdist.loss_scale import describe_scaling, scaler_for, scaler_report
from simdist.memplan import DeviceAllocator, bucket_elements, check_device_memory
from simdist.models import build_model
from simdist.models.base import GradientViews
from simdist.optim import Optimizer, clip_coefficient
from simdist.packed_params import PackedParameters
from simdist.packed_params import chosen as packing_chosen
from simdist.parallel import GradientSync, PartitionedParameters
from simdist.param_gather import GatherPlan
from simdist.precision import Precision, canonical
from simdist.schedules.base import Schedule, StateShard, StepResult
from simdist.streaming import weight_streaming_tip


def tensor_parallel_groups(place: Placement, tp: int) -> list[tuple[int, ...]]:
    """SambaFlow's tensor-parallel groups: ``tp`` consecutive ranks each, every group inside
    one node (TP traffic never leaves a node), so ``tp`` divides the ranks and fits a node."""
    world = place.world
    if world % tp:
        raise ConfigError(
            f"runconfig.tensor_parallel={tp} must divide the {world} ranks (groups of {tp} "
            "consecutive ranks); start a multiple of it",
            "runconfig.tensor_parallel",
        )
    groups = [tuple(range(a, a + tp)) for a in range(0, world, tp)]
    for g in groups:
        nodes = sorted({place.node_of[k] for k in g})
        if len(nodes) > 1:
            raise ConfigError(
                f"runconfig.tensor_parallel={tp}: ranks {list(g)} span nodes {nodes}, but a "
                "tensor-parallel group must sit on one node (at most its ranks per node, "
                f"{list(place.ranks_per_node)} here); lower it or place the ranks by node",
                "runconfig.tensor_parallel",
            )
    return groups


def host_activation_bytes(model, micro_batch: int) -> int:
    """The model's activations as the host holds them (``GPT2.host_activation_bytes``:
    16-bit words in mixed precision); other models hold the device's layout in float32."""
    host = getattr(model, "host_activation_bytes", None)
    return host(micro_batch) if host else model.activation_bytes(micro_batch)


class DataParallel(Schedule):
    name = "pipelined"
    # mixed precision at ZeRO 0-2: the weights as 16-bit words where the model has stages
    # and that saves host memory (``simdist.packed_params``)
    packs_weights = True

    def __init__(self, comm, groups=None):
        """``comm``: the replicas (every rank, or the devices when input workers feed
        them: ``groups``)."""
        super().__init__(comm, comm.Get_size(), comm.Get_size())
        self.groups = groups
        self.rank, self.world = comm.Get_rank(), comm.Get_size()

    # ----------------------------------------------------------------- set-up
    def prepare(self, run) -> None:
        self.params, r = run.params, run.params.runconfig
        # read once here: the sync, the memory plan, the simulated device, checkpoints and
        # performance.json all take the level from this schedule
        self.zero_level = r.zero_opt_level
        self.micro_batch = run.micro_batch
        comm = self.comm
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
        self.tensor_parallel = r.tensor_parallel
        self.tp_groups = tensor_parallel_groups(self.placement, r.tensor_parallel)
        self.coll = Collectives(
            comm, r.collective_algorithm, r.check_collectives, placement=self.placement
        )
        self.precision = Precision(canonical(r.precision) or "fp32")
        self.scaler = scaler_for(r, self.precision.name)
        self.skipped_steps_at_start = 0
        half = self.precision.half is not None
        # the wire of the gradient reduction (0: float32) and of the parameter gather
        self.grad_wire = self.precision.fmt if half and not r.fp32_allreduce else 0
        self.param_wire = self.precision.fmt if half else 0
        # the simulated accelerator (simdist.simulate); its accounted memory backs .memory
        self.device = simulate.create_device(run.profile, comm, self.placement, self.precision.half)
        self.memory = DeviceAllocator(self.device.memory, self.coll)
        self.model = build_model(self.params.model)
        if hasattr(self.model, "set_precision"):
            self.model.set_precision(self.precision)
        # every matrix product from here on takes half operands (until close)
        self.gemm = half_operands(self.precision.fmt if half else None)
        if self.zero_level == 3 and not hasattr(self.model, "stages"):
            raise ConfigError(
                f"runconfig.zero_opt_level=3 gathers each stage's parameters before it runs, "
                f"and model {self.model.name!r} has no stages; use zero_opt_level 0-2 "
                "(ZeRO-3 supports fc_mnist, gpt2, bert and t5)",
                "runconfig.zero_opt_level",
            )
        if hasattr(self.model, "bind_step"):  # dropout masks hash (seed, global step, sample)
            self.model.bind_step(r.seed, lambda: run.step)
        self.data = build_dataset(self.params, self.micro_batch)
        self._choose_shared_buffers(run)
        p, m, world = self.params, self.model, self.world

        def tip(capacity: int) -> str:  # the weights need not be resident: would streaming fit?
            return weight_streaming_tip(m, p, self.micro_batch, world, capacity)

        check_device_memory(self, tip)  # simulated OOM now, before any buffer exists
        t = self.params.train_input
        origin = "global given" if t.global_batch_size is not None else "per replica given"
        if self.tensor_parallel > 1:
            groups = " ".join(f"{list(g)}" for g in self.tp_groups)
            run.log(
                f"simdist: tensor parallel (batch mode), {len(self.tp_groups)} group(s) of "
                f"{self.tensor_parallel} ranks, each on one node: {groups}; the group's batch "
                f"of {self.micro_batch * self.tensor_parallel} is divided among its ranks"
            )
        run.log(
            f"simdist: {self.world} replica(s), model {self.model.name}, micro-batch "
            f"{self.micro_batch} x {self.params.optimizer.grad_accum_steps} accumulation, "
            f"global batch {run.global_batch} ({origin}), ZeRO-{self.zero_level}, "
            f"collectives {r.collective_algorithm}, precision {self.precision.name}"
            f"{self._precision_note()}; data: {self.data.source}"
        )

    def _precision_note(self) -> str:
        if self.precision.half is None:
            return ""
        wire = self.precision.half if self.grad_wire else "fp32"
        scale = describe_scaling(self.scaler)
        return f" (fp32 master weights, gradients reduced in {wire}, {scale}; GEMMs {self.gemm})"

    def checkpoint_attrs(self) -> dict[str, Any]:
        attrs = {
            "tensor_parallel": self.tensor_parallel,
            "tensor_parallel_mode": "batch",
            "precision": self.precision.name,
        }
        if self.scaler is not None:
            attrs.update({f"loss_scaler.{k}": v for k, v in self.scaler.state().items()})
        return attrs

    def restore(self, run, path, attrs: dict[str, Any], loaded: set[str]) -> None:
        """After ``Run`` read a checkpoint: the loss scaler's state, and the master weights
        of a checkpoint written in fp32 (its parameters are the fp32 values)."""
        if self.scaler is not None and "loss_scaler.scale" in attrs:
            self.scaler.load({k: attrs[f"loss_scaler.{k}"] for k in self.scaler.state()})
            self.skipped_steps_at_start = self.scaler.skipped_steps
        if self.precision.half is None:
            return
        if "master" not in loaded:
            self._master_from_weights()
            run.log(
                f"{path} was written in {attrs.get('precision', 'fp32')}: its parameters "
                f"become the fp32 master weights of this {self.precision.name} run"
            )

    def _choose_shared_buffers(self, run) -> None:
        """Parameters and gradients (or ZeRO-2's bucket) in shared-memory windows, for the
        "shm" collectives, where the ranks share a node and its shared memory has room."""
        layout = Layout(self.model.parameter_specs(), self.world)
        padded = layout.padded
        need = 8 * padded  # parameters and gradients
        if self.zero_level == 3:  # two gather windows and the gradient bucket
            plan = GatherPlan(layout, self.model.stages(), self.model.gradient_groups())
            groups = [(g.names, g.held) for g in self.model.gradient_groups()]
            need = 4 * (2 * plan.window + bucket_elements(layout, groups))
        self.shared_buffers = self.coll.can_share(need)  # collective
        if not self.shared_buffers:
            self.memory.coll = None  # alloc(shared=True) gives plain arrays
        if self.coll.shared and not self.shared_buffers:
            room = window_room_error(need * self.world)
            if self.params.runconfig.collective_algorithm == "shm":
                raise ConfigError(
                    f"runconfig.collective_algorithm=shm: {room}, or choose auto, ring or rhd"
                )
            run.log(f"shared memory: {room}; the gradients use message-passing collectives")

    def allocate(self, run) -> None:
        p, r = self.params, self.params.runconfig
        half = self.precision.half is not None
        wbytes = self.precision.weight_bytes  # device bytes of weights, gradients, activations

        def half_alloc(category: str, name: str, n: int, shared: bool = False) -> np.ndarray:
            return self.memory.alloc(category, name, n, shared, elem=wbytes)

        self.layout = layout = Layout(self.model.parameter_specs(), self.world)
        accum = p.optimizer.grad_accum_steps
        self.sync = GradientSync(
            self.coll, layout, self.zero_level, r.collective_algorithm, self.shared_buffers
        )
        # buffers of the training collectives: shared memory where the ranks share a node
        self.partitioned = self.packed = None
        if self.zero_level == 3:  # this rank's slice; stages gather into windows
            words = None
            if half:  # the slice as 16-bit words, two per float32 element of device memory
                n = self.sync.partition[1] - self.sync.partition[0]
                words = self.memory.alloc("parameters", "param_slice", n // 2).view(np.uint16)
            self.partitioned = PartitionedParameters(
                self.sync, self.model, half_alloc, words, self.precision.fmt
            )
            self.partitioned.wire = self.param_wire  # gathers move 16-bit words in half
            self.params_flat = None
            self.pviews = self.partitioned
        elif half and self.packs_weights and packing_chosen(layout, self.model):
            # 16-bit words, two per float32 element of the buffer the collectives move
            self.params_flat = self.memory.alloc("parameters", "params", layout.padded // 2, True)
            words = self.params_flat.view(np.uint16)
            self.packed = PackedParameters(layout, self.model, words, self.precision.fmt)
            self.pviews = self.packed
        else:
            self.params_flat = half_alloc("parameters", "params", layout.padded, shared=True)
            self.pviews = layout.views(self.params_flat)
        place = self.placement
        run.log(
            f"placement: {place.num_nodes} node(s), ranks per node "
            f"{list(dict.fromkeys(place.ranks_per_node))}"
            f"{' (virtual: runconfig.ranks_per_node)' if r.ranks_per_node else ''}; "
            f"gradient collectives: {self.sync.algorithm}"
        )
        self.micro_grads = None
        if self.zero_level >= 2:
            # gradients exist only as this rank's slice plus a bucket (see parallel.py)
            self.grads = None
            self.gviews = self.sync.make_sharded(self.model.gradient_groups(), half_alloc)
            if half:  # each group's gradients are stored half before their reduce-scatter
                self.gviews.before_reduce = self.precision.store
        else:
            self.grads = half_alloc("gradients", "grads", layout.padded, shared=True)
            if accum > 1:  # the model writes each micro-batch into scratch, summed into grads
                self.micro_grads = half_alloc("gradients", "micro_grads", layout.padded)
            self.gviews = GradientViews(layout.views(self.micro_grads if accum > 1 else self.grads))
        nbytes = self.model.activation_bytes(self.micro_batch) * wbytes // 4
        self.memory.reserve("activations", "model.arena", nbytes)  # accounted, then allocated
        self.model.allocate(self.micro_batch)

        lo, hi = self.sync.update_range
        self.optimizer = Optimizer(p.optimizer, layout, lo, hi, self.memory.alloc, master=half)
        self.sampler = DistributedSampler(
            self.data.num_train,
            run.global_batch,
            self.world,
            self.rank,
            r.seed,
            p.train_input.shuffle,
            accum,
        )
        rng = np.random.default_rng(r.seed)
        if self.partitioned is not None:  # every rank draws the same: no broadcast needed
            if half:  # what the slice's words are the rounding of
                self.partitioned.master = self.optimizer.state["master"]
            self.partitioned.initialize(self.model.init_parameters, rng)
        elif self.packed is not None:  # the master of [lo, hi) too; words broadcast as DDP
            master = self.optimizer.state["master"]
            self.packed.initialize(self.model.init_parameters, rng, master, lo)
            self.coll.broadcast(self.params_flat, root=0)
        else:
            self.model.init_parameters(self.pviews, rng)
            self.coll.broadcast(self.params_flat, root=0)  # replicas start identical, as DDP
        if half and not self._weights_as_words:  # fp32 master of [lo, hi); weights rounded
            self._master_from_weights()
        self.sim = simulate.attach(self)  # hooks the step's calls; per-step device time
        self.state_shard = StateShard(
            self.comm,
            self.rank,
            self.world,
            lo,
            hi,
            self.optimizer.state,
            sharded=self.sync.level > 0,
            # every replica holds (and resumes) all parameters; ZeRO-3 its slice
            params=self.params_flat if self.partitioned is None else self.partitioned.slice,
            params_lo=0 if self.partitioned is None else lo,
        )
        if self.packed is not None:  # the checkpoint reader packs what it reads
            self.state_shard.params, self.state_shard.write = self.packed.words, self._write_packed
        elif self._weights_as_words:
            self.state_shard.write = self.partitioned.write
        plo, phi = self.sync.partition
        self._own = slice(plo - lo, phi - lo)  # this rank's partition in the reduced grads
        host = host_activation_bytes(self.model, self.micro_batch)
        notes = [f"activations {host / 2**20:.1f} MiB"] if host != nbytes else []
        if self.packed is not None:
            notes.append(
                f"weights {self.packed.words.nbytes / 2**20:.1f} MiB as 16-bit words "
                f"+ {(self.packed.host_bytes - self.packed.words.nbytes) / 2**20:.1f} MiB "
                "float32 stage window"
            )
        run.log(
            f"parameters: {layout.numel:,} ({layout.padded:,} padded); memory per rank: "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.memory.bytes.items())
            + (f" (on this host: {', '.join(notes)})" if notes else "")
        )

    def feed(self, run) -> None:
        self.data = device_input(self.data, self.groups, self.micro_batch, run.step, self.params)

    def start(self, run) -> None:
        self._bytes_at_start = self.coll.bytes_sent

    # ----------------------------------------------------------------- the step
    def step(self, run, step: int, guard) -> StepResult:
        n = step + 1
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss = self._forward_backward(step, guard, scale)
        with self.coll.half_wire(self.grad_wire):
            grads, own_sumsq = self.sync.reduce_gradients(self.grads)  # averaged, for [lo, hi)
        if scale != 1.0:  # unscaled before the norm, clipping and the update (GradScaler)
            np.multiply(grads, np.float32(1.0 / scale), out=grads)
            own_sumsq = None
        if own_sumsq is None:  # this rank's share of the global norm
            own_sumsq = sum_of_squares(grads[self._own])
        explain = lambda: self._nonfinite(n, grads, loss)  # noqa: E731
        return self._finish_step(run, step, grads, own_sumsq, loss, guard, explain)

    def _finish_step(self, run, step: int, grads, own_sumsq: float, loss: float, guard, explain):
        """The step once the gradients are reduced and unscaled (data parallelism's, and
        tensor-parallel weight mode's on its shard): the agreement (fp16: an overflow on
        any rank skips the step on all), clipping, the update (the fp32 master in mixed
        precision) and the parameter gather, which ends every step, skipped or not."""
        n = step + 1
        if self.scaler is None:
            sumsq, _, stop = guard.check(n, own_sumsq, loss, explain)
        else:
            scale = self.scaler.scale  # before this step's update
            sumsq, _, stop, overflow = guard.check_overflow(n, own_sumsq, loss)
            if not self.scaler.update(overflow):
                run.log(
                    f"global_step {n}: gradients overflowed at loss scale {scale:g}: step "
                    f"skipped, scale now {self.scaler.scale:g} "
                    f"({self.scaler.skipped_steps} skipped so far)"
                )
                # the step still ends with the gather (unchanged weights), as every step
                # does for the simulated device and ZeRO-3's windows
                self._gather_parameters()
                return StepResult(loss, None, stop)
        norm = self.gradient_norm(grads, sumsq)
        coef = clip_coefficient(self.params.optimizer.max_gradient_norm, norm)  # in the update
        guard.enter("update", n)
        # the optimizer's own step count: skipped steps never reached it (GradScaler)
        applied = n - (self.scaler.skipped_steps if self.scaler is not None else 0)
        if self.precision.half is None:
            self.optimizer.step(
                self.owned_parameters(), grads, applied, run.learning_rate(step), coef
            )
        else:  # the fp32 master updated; the weights its half rounding
            master = self.optimizer.state["master"]
            self.optimizer.step(master, grads, applied, run.learning_rate(step), coef)
            if self.packed is not None:
                self.packed.store(self.sync.update_range[0], master)
            elif self._weights_as_words:
                self.partitioned.store(master)
            else:
                self.precision.store_into(self.owned_parameters(), master)
        guard.enter("gather_parameters", n)
        self._gather_parameters()
        return StepResult(loss, norm, stop)

    def _gather_parameters(self) -> None:
        """ZeRO-1/2: every rank's updated range to every rank (ends every step)."""
        if self.packed is not None:  # 16-bit words moved as they are
            with self.coll.half_wire(0):
                self.sync.gather_parameters(self.params_flat, words=True)
        else:
            with self.coll.half_wire(self.param_wire):  # half values: exact in half words
                self.sync.gather_parameters(self.params_flat)

    def _forward_backward(self, step: int, guard, scale: float) -> float:
        """The step's micro-batches: forward, then backward into the gradients (ZeRO-2
        reducing as it goes), accumulated; returns the mean loss. The loss gradient is the
        mean over this replica's samples, times the loss scale."""
        n, model, accum = step + 1, self.model, self.params.optimizer.grad_accum_steps
        dloss = scale / (self.micro_batch * accum)
        hook = guard.hook  # test-only fault injection (SIMDIST_FAULT); None in real runs
        guard.enter("forward_backward", n)
        loss = 0.0
        if self.partitioned is not None:  # gathers start from empty windows every step
            self.partitioned.cache.invalidate()
        for micro, indices in enumerate(self.sampler.indices(step)):
            x, y = self.data.train_batch(indices)
            if hook:
                hook.at_batch(n, micro, x)
            loss += model.forward(self.pviews, x, y) / accum
            with self.coll.half_wire(self.grad_wire):  # ZeRO-2 reduces during backward
                model.backward(self.pviews, self.gradients(micro), dloss)
            self.accumulate_gradients(micro)
        guard.enter("reduce_gradients", n)
        if self.grads is not None:  # mixed precision: stored half (ZeRO-2: per group)
            self.precision.store(self.grads)
        return loss

    def _nonfinite(self, n: int, grads: np.ndarray, loss: float) -> str:
        lo, hi = self.sync.partition
        if self.partitioned is not None:
            own = self.partitioned.values(lo, hi)
        elif self.packed is not None:
            own = self.packed.unpack(lo, hi)
        else:
            own = self.params_flat[lo:hi]
        return describe_nonfinite(
            self.comm,
            n,
            loss,
            grads[self._own],
            own,
            lo,
            self.layout,
            self.params.runconfig.model_dir,
        )

    def _write_packed(self, a: int, values: np.ndarray) -> None:
        """The checkpoint reader's parameters: into the 16-bit words, and as they are into
        the master where this rank updates them (a saved master overwrites them after)."""
        lo = self.sync.update_range[0]
        values = np.ascontiguousarray(values, np.float32)
        self.packed.write(a, values, self.optimizer.state["master"], lo)

    def _master_from_weights(self) -> None:
        """Mixed precision: the fp32 weights become the master of this rank's range, and
        every weight this rank holds its half rounding (all ranks round the same values).
        16-bit weights: the checkpoint reader already wrote both (``_write_packed``)."""
        if self._weights_as_words:
            return
        np.copyto(self.optimizer.state["master"], self.owned_parameters())
        self.precision.store(
            self.params_flat if self.partitioned is None else self.partitioned.slice
        )

    @property
    def _weights_as_words(self) -> bool:
        """Mixed precision's weights held as 16-bit words: packed (ZeRO 0-2) or ZeRO-3's
        slice (then the fp32 master is written with them, never copied from them)."""
        return self.packed is not None or bool(self.partitioned and self.partitioned.fmt)

    def host_parameter_bytes(self) -> int:
        if self.packed is not None:
            return self.packed.host_bytes
        if self.partitioned is not None:
            p = self.partitioned
            return p.slice.nbytes + sum(w.nbytes for w in p.windows)
        return self.params_flat.nbytes

    def owned_parameters(self) -> np.ndarray:
        """The parameters this rank updates: its range of the flat buffer (ZeRO-3: its
        slice, the only parameters it holds between stages)."""
        if self.partitioned is not None:
            return self.partitioned.slice
        lo, hi = self.sync.update_range
        return self.params_flat[lo:hi]

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

    def gradient_norm(self, grads: np.ndarray, sumsq: float | None = None) -> float | None:
        """The global gradient norm clipping needs (None without clipping); ``sumsq``: the
        global sum of squares if already reduced."""
        if self.params.optimizer.max_gradient_norm is None:
            return None
        return self.sync.global_norm(grads) if sumsq is None else float(np.sqrt(sumsq))

    def mean_loss(self, run, result: StepResult) -> float:
        mean = self.coll.allreduce_scalars(np.array([result.loss]))[0] / self.world
        self.check_replicas(run.step)
        return mean

    def check_replicas(self, step: int) -> None:
        """Replicas must hold bitwise-identical parameters: compare a hash across ranks
        (ZeRO-3 holds disjoint slices: nothing replicated to compare)."""
        if self.partitioned is not None:
            return
        digest = zlib.crc32(self.params_flat.view(np.uint8))
        digests = self.comm.allgather(digest)
        if len(set(digests)) != 1:
            raise RuntimeError(
                f"replicas diverged at global_step {step}: parameter CRC32 per rank "
                f"{[hex(d) for d in digests]}"
            )

    def summary_scalars(self) -> dict[str, float]:
        """Extra TensorBoard scalars at a summary step."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped_steps}

    # ----------------------------------------------------------------- around the steps
    def checkpoint_parameters(self, run) -> dict[str, np.ndarray] | None:
        if self.partitioned is not None:  # the slices, gathered on rank 0
            return self.partitioned.gather_to_root(self.comm)
        if self.packed is not None:
            return self.packed.tensors()
        return self.pviews

    def eval_sums(self, run) -> np.ndarray:
        """Each rank scores a contiguous share of the held-out set."""
        n = self.num_eval()
        lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
        batch = self.params.eval_input.batch_size
        loss_sum, correct = 0.0, 0
        windows = self.partitioned or self.packed
        if windows is not None:
            windows.evaluating(True)
        for start in range(lo, hi, batch):
            x, y = self.data.eval_batch(start, min(start + batch, hi))
            l, c = self.model.evaluate(self.pviews, x, y)
            loss_sum, correct = loss_sum + l, correct + c
        if self.partitioned is not None:  # ranks with fewer batches join others' gathers
            self.partitioned.join()
        if windows is not None:
            windows.evaluating(False)
        meta = self.eval_meta(n) if self.rank == 0 else (0, 0)
        return np.array([loss_sum, correct, *meta], np.float64)

    def close(self) -> None:
        half_operands(None)  # the process's products are plain float32 again
        super().close()

    def performance(self, run, common: dict[str, Any]) -> dict[str, Any] | None:
        r, t, steps = self.params.runconfig, run.timers, common["steps"]
        # peak resident memory of the busiest rank (Linux reports ru_maxrss in KiB)
        peak_rss = max(self.comm.allgather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
        sent = self.coll.bytes_sent - self._bytes_at_start
        simulated = self.sim.finish(run.model_dir, run.global_batch)  # collective
        line = simulated_line(simulated)
        if line:
            run.log(line)
        inputs = input_report(  # collective: how long replicas waited on their input
            self.comm,
            getattr(self.data, "wait_s", 0.0),
            t.train_time,
            r.input_workers_per_replica,
        )
        return {
            **common,
            "world_size": self.world,
            "global_batch_size": run.global_batch,
            "micro_batch_size": self.micro_batch,
            "grad_accum_steps": self.params.optimizer.grad_accum_steps,
            "zero_opt_level": self.zero_level,
            "precision": self.precision.name,
            "gemm": self.gemm,  # how the matrix products ran (kernels.blas.half_operands)
            **scaler_report(self.scaler, self.skipped_steps_at_start),
            "collective_algorithm": r.collective_algorithm,
            "gradient_algorithm": self.sync.algorithm,  # what "auto" resolved to
            "nodes": self.placement.num_nodes,
            "parameters": self.layout.numel,
            "parameters_padded": self.layout.padded,
            "memory_bytes": dict(self.memory.bytes),
            "step_time_s": t.train_time / max(steps, 1),
            "peak_rss_bytes": peak_rss * 1024,
            # the model's activations as this host holds them (mixed precision: GPT-2's
            # saved activations as 16-bit words); memory_bytes has the device's
            "host_activation_bytes": host_activation_bytes(self.model, self.micro_batch),
            # the weights as this host holds them (mixed precision: 16-bit words and one
            # float32 stage window where that takes less memory, packed_params; ZeRO-3: the
            # slice and its gather windows)
            "host_parameter_bytes": self.host_parameter_bytes(),
            # bytes this rank sent per step, summaries and checkpoint gathers included
            "comm_bytes_sent_per_step": sent / max(steps, 1),
            "host": socket.gethostname(),
            **(simulated or {}),
            **inputs,
        }
