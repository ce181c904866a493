"""Pipeline parallelism (``runconfig.pipeline_parallel: P``): the model's stages split over
P ranks, activations and their gradients sent point to point, micro-batches from
``optimizer.grad_accum_steps``, 1F1B (default) or GPipe (``runconfig.pipeline_schedule``).

Placement. World = D x P x T in issue #19's order: tensor-parallel ranks innermost (on one
node), then pipeline, then data parallel, so rank (d P + s) T + t is stage s of replica
d T + t (T = 1: stage ``r % P`` of replica ``r // P``). Tensor parallelism
(``runconfig.tensor_parallel``) is SambaFlow's batch mode by default: a group's T ranks
divide its batch, i.e. they are replicas for the gradient sync. Each replica's P ranks
talk over one sub-communicator (sends and receives), each stage's D T replicas over another
(simdist's collectives: the gradient sync of that stage's parameters only).

Weight mode (``tensor_parallel_mode: weight``, gpt2): rank (d P + s) T + t is shard t of
stage s of replica d, running ``GPT2TP``'s stage functions with the group's collectives
over a third sub-communicator (the stage's T ranks of replica d). The pipe joins shard t
of the replica's stages (the boundary tensors are the residual stream, the same on every
shard; with sequence parallelism each shard's rows); the stage group is the D ranks of
(s, t), over the shard's flat layout. The norm is ``tensor_parallel``'s share relayed
(``norm_share``: part by part in flat order, so the last stage holds one weight-mode
rank's float64 sum; the agreement adds shards and replicas), the loss is counted on shard
0, the sequence-parallel row shares are summed over the group per stage, and checkpoints
are whole tensors assembled on rank 0 as ``tensor_parallel`` writes them.

The split. The model's stages (``simdist.models.stages``: gpt2's embedding, blocks and
head; fc_mnist's layers) are cut into P contiguous ranges balancing their FLOPs (the
model's ``stage_flops``; else their parameter counts); a rank owns the parameters its
range reads first, one contiguous range of the model's flat layout, so the optimizer,
ZeRO-1/2 slices on the DP axis and checkpoint shards are flat ranges as in
``data_parallel``. A parameter read again by a later stage (gpt2's
tied ``wte``, read by the LM head) is *tied*: that rank keeps a copy.

A step on stage s: the micro-batches' forward and backward in the schedule's order
(``schedule_ops``), each in-flight micro-batch in its own copy of the model's activation
arena (a *slot*: P - s of them for 1F1B, m for GPipe); receives block (the bubble is the
time spent there), sends are non-blocking and finished before their slot is reused. Then
the stage's DP group reduce-scatters (and, ZeRO-0, all-gathers) the stage's gradients over
the flat layout's slice boundaries at D ranks (ZeRO-2: each micro-batch's, right after its
backward, into the rank's slice), the ranks agree on the norm and loss, clip, update their
range (ZeRO-1/2: their slice, then all-gather the stage's parameters), and the owner of a
tied parameter sends its new value to the copies. ZeRO-3 reduces as ZeRO-2 and keeps only
the rank's slice of its range between stages: each model stage's forward and backward first
all-gathers the gradient groups it reads over the stage group into one of two windows
(``simdist.param_gather`` on the rank's model stages; ``_allocate_gathers`` says what the
tied parameter does), and nothing is gathered after the update. In mixed precision
(``simdist.precision``) the update runs on the optimizer's fp32 master, the weights are its
half rounding, held as 16-bit words (ZeRO-3's slices, unpacked into the window before each
gather; at ZeRO 0-2 where that saves host memory, each model stage reading its groups
unpacked into one float32 window: ``_packs_weights``; weight mode too), and the
gradients are stored half before their reduction, as in ``data_parallel``. Under loss
scaling (fp16; ``simdist.loss_scale``) the last stage's backward starts from the loss
times the scale, so the activation gradients sent between stages carry scaled values, as
on a real pipeline; each rank unscales its reduced gradients before the norm, and an
overflow on any stage of any replica reaches every rank through the norm relay and the
agreement (an Inf or NaN in a sum stays one), so all skip the same steps and keep the
same scale.

The simulated step (``simdist.sim.pp_schedule``, also plan mode's) is written by rank 0 to
performance.json and, as a Chrome trace, to ``model_dir/timeline.json``.

Bitwise equality with one rank accumulating the same micro-batches (and with data
parallelism at D ranks; D > 2 where both pick the same collective algorithm):
- each stage runs the model's own stage functions on the same bits, micro-batch gradients
  go into scratch and are added to the step's gradients in micro-batch order;
- a tied parameter's gradient: the later stage's backward writes its part of micro-batch
  j first (as in one rank, where the head runs before the embedding), sends it, and the
  owner puts it into its micro-batch gradient before its own backward adds to it;
- the clipping norm: the float64 lane sums of ``sum_of_squares`` over each DP slice are
  passed along the pipeline in flat order (``lane_sum_of_squares``), so the last stage
  holds exactly the sum one rank computes; the loss comes from the last stage alone.
"""

from __future__ import annotations

import resource
import socket
import time
from typing import Any

import numpy as np

from simdist.arena import Layout
from simdist.comm import Collectives
from simdist.comm.topology import Placement
from simdist.config import ConfigError
from simdist.data.datasets import build_dataset
from simdist.data.sampler import DistributedSampler
from simdist.device import DeviceMemory, SimulatedOutOfMemoryError
from simdist.device.estimate import busy_split, est_fields, memory_fields, simulated_line
from simdist.faults import nonfinite_text
from simdist.input_workers import MeasuredInput, input_report
from simdist.kernels.blas import half_operands
from simdist.kernels.half import pack_half, unpack_half
from simdist.kernels.optim import LANES, combine_lanes, lane_sum_of_squares
from simdist.loss_scale import describe_scaling, scaler_for, scaler_report
from simdist.memplan import DeviceAllocator
from simdist.models import build_model
from simdist.models.base import GradientViews
from simdist.models.gpt2 import build_gpt2
from simdist.models.gpt2 import parameter_specs as gpt2_specs
from simdist.models.gpt2_tp import GPT2TP
from simdist.optim import Optimizer, clip_coefficient
from simdist.packed_params import packing_mode
from simdist.param_gather import BACKWARD, FORWARD, Gather, GatherPlan, WindowCache, stage_gathers
from simdist.precision import Precision, canonical, read_words, write_words
from simdist.schedules.base import Schedule, StateShard, StepResult
from simdist.schedules.data_parallel import tensor_parallel_groups
from simdist.schedules.tensor_parallel import (
    WholeTensorCheckpoint,
    norm_share,
    shard_of_whole,
    shards_agree,
    sub_placement,
    sum_row_shares,
)
from simdist.sim.pp_schedule import (
    StagePlan,
    pipeline_trace,
    schedule_ops,
    simulate_pipeline,
    slots_needed,
    split_stages,
)
from simdist.sim.tp_schedule import TP_ALGORITHMS, stage_group_calls
from simdist.streaming import warm_kernels

F32 = np.float32
# point-to-point tags on a pipeline's communicator (MPI keeps each (source, tag) in order)
TAG_ACT, TAG_GRAD, TAG_TIED_GRAD, TAG_TIED, TAG_SUMSQ, TAG_GATHER = 11, 12, 13, 14, 15, 16
TIMELINE = "timeline.json"


def predicted_bubble(stages: int, micro: int) -> float:
    """The idle share of a synchronous pipeline with equal stages: (P - 1) / (m + P - 1)."""
    return (stages - 1) / (micro + stages - 1)


def measured_bubble(ranks: list[dict[str, Any]], P: int) -> dict[str, Any]:
    """The bubble as the schedule defines it: the share of the pipeline's forward/backward
    span a stage is not computing. Per step and replica the span is the longest stage's
    forward/backward phase (all start together, after the previous step's agreement); a
    rank computes for its phase minus its blocked receives. Averaged over ranks and steps
    (each step weighted by its span); also per stage, and the receive waits alone."""
    spans: dict[int, np.ndarray] = {}
    for x in ranks:
        f = np.array([a for a, _ in x["fb_steps"]])
        spans[x["replica"]] = np.maximum(spans.get(x["replica"], f), f)
    idle = []
    for x in ranks:
        span = spans[x["replica"]]
        busy = np.array([a - w for a, w in x["fb_steps"]])
        idle.append(float((span - busy).sum() / span.sum()) if span.sum() > 0 else 0.0)
    return {
        "bubble_fraction": float(np.mean(idle)),
        "bubble_fraction_per_stage": [
            float(np.mean([b for b, x in zip(idle, ranks, strict=True) if x["stage"] == s]))
            for s in range(P)
        ],
        "receive_wait_fraction_per_stage": [
            float(np.mean([x["receive_wait_fraction"] for x in ranks if x["stage"] == s]))
            for s in range(P)
        ],
    }


def measured_steps(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Each step's wall time from its first input fetch to the tied parameters' send (the
    slowest rank's; summaries and checkpoints, which step_time_s includes, left out), as
    data parallelism's ``measured_step_time_*`` fields."""
    walls = np.max([x["walls"] for x in ranks], axis=0) if ranks[0]["walls"] else np.zeros(1)
    return {
        "measured_step_time_s": float(walls.mean()),
        "measured_step_time_median_s": float(np.median(walls)),
        "measured_step_time_min_s": float(walls.min()),
    }


class Pipeline(WholeTensorCheckpoint, Schedule):
    name = "pipelined"

    def __init__(self, comm, stages: int, tp: int = 1, weight: bool = False):
        """``tp``: tensor parallelism innermost; SambaFlow's batch mode (its T ranks of one
        stage divide the micro-batch: data-parallel replicas for the gradient sync), or
        ``weight`` mode (each stage's layers split over its T ranks, ``gpt2_tp``)."""
        world, P, T = comm.Get_size(), stages, tp
        if world % (P * T):
            what = f"runconfig.pipeline_parallel={P}" + (
                f" x runconfig.tensor_parallel={T}" if T > 1 else ""
            )
            raise ConfigError(
                f"{what} must divide the {world} ranks (replicas of {P * T} consecutive "
                f"ranks); start a multiple of {P * T}",
                "runconfig.pipeline_parallel",
            )
        self.weight = weight and T > 1
        super().__init__(comm, world // (P * T) if self.weight else world // P, world)
        self.P, self.T = P, T
        self.rank = r = comm.Get_rank()
        # rank = (d P + s) T + t: tensor-parallel innermost, then pipeline, then data
        self.stage, self.shard, d = (r // T) % P, r % T, r // (P * T)
        # batch mode: index among the D x T replicas; weight mode: among the D
        self.replica = d if self.weight else d * T + self.shard
        self.pipe = comm.Split(d * T + self.shard, self.stage)  # this chain's P stages
        # the stage's replicas, in order (weight mode: those holding shard t)
        color = self.stage * T + self.shard if self.weight else self.stage
        self.dp = comm.Split(color, self.replica)
        # weight mode: the T shards of this stage of replica d (the model's collectives)
        self.group = comm.Split(d * P + self.stage, self.shard) if self.weight else None

    # ----------------------------------------------------------------- set-up
    def prepare(self, run) -> None:
        p, r = run.params, run.params.runconfig
        self.params, self.micro_batch = p, run.micro_batch
        self.zero_level = r.zero_opt_level
        self.kind = r.pipeline_schedule
        self.m = p.optimizer.grad_accum_steps
        place = None
        if r.ranks_per_node is not None:  # virtual nodes, as data parallelism reads them
            place = Placement.blocks(self.rank, self.ranks, r.ranks_per_node)
        self.coll = Collectives(
            self.comm, r.collective_algorithm, r.check_collectives, placement=place
        )
        if self.weight:  # the group's collectives: as tensor_parallel's (same bits everywhere)
            members = [self.rank - self.shard + t for t in range(self.T)]
            self.tcoll = Collectives(
                self.group,
                r.collective_algorithm if r.collective_algorithm in TP_ALGORITHMS else "auto",
                r.check_collectives,
                placement=sub_placement(self.coll.placement, members, self.shard),
            )
        self.model = self._new_model()
        if not hasattr(self.model, "stage_input"):
            raise ConfigError(
                f"model {self.model.name!r} cannot be pipelined (no stage boundaries); "
                "runconfig.pipeline_parallel supports fc_mnist, gpt2 and bert",
                "runconfig.pipeline_parallel",
            )
        self.layout = Layout(self.model.parameter_specs(), self.replicas)
        self.plan = StagePlan(self.model, self.layout, self.P)
        if r.collective_algorithm in ("shm", "hierarchical") and self.replicas > 1:
            raise ConfigError(
                f"runconfig.collective_algorithm={r.collective_algorithm} with "
                f"runconfig.pipeline_parallel={self.P}: the stage groups sync their gradients "
                "with auto, ring, rhd or native",
                "runconfig.collective_algorithm",
            )
        if self.T > 1:  # its groups must sit on one node (SambaFlow's rule)
            groups = tensor_parallel_groups(self.coll.placement, self.T)
            run.log(
                f"simdist: tensor parallel ({'weight' if self.weight else 'batch'} mode) "
                f"innermost, groups of {self.T} ranks on one node: "
                f"{' '.join(str(list(g)) for g in groups)}" + self._split_note()
            )
        self.dcoll = Collectives(self.dp, r.collective_algorithm, r.check_collectives)
        # one algorithm for the stage's gradient collectives: the one data parallelism at D
        # ranks picks for the whole buffer (its summation order is what D > 2 depends on)
        algorithm = r.collective_algorithm
        if algorithm == "auto":
            algorithm = self.dcoll.choose("reduce_scatter", 4 * self.layout.padded)
        self.algorithm = algorithm
        self.data = build_dataset(p, self.micro_batch)
        self.memory = DeviceAllocator(DeviceMemory.from_profile(run.profile))
        # mixed precision, as data parallelism runs it: fp32 master weights in the optimizer
        # state, half weights, activations and gradients, gradients reduced in half; fp16
        # scales the loss (the same scaler on every rank: they agree on every overflow)
        self.precision = Precision(canonical(r.precision) or "fp32")
        self.scaler = scaler_for(r, self.precision.name)
        self.skipped_steps_at_start = 0
        half = self.precision.half is not None
        self.grad_wire = self.precision.fmt if half and not r.fp32_allreduce else 0
        self.param_wire = self.precision.fmt if half else 0
        if hasattr(self.model, "set_precision"):
            self.model.set_precision(self.precision)
        # every matrix product takes half operands until close (kernels.blas), as in DP
        self.gemm = half_operands(self.precision.fmt if half else None)
        run.log(
            f"simdist: pipeline parallel, {self.replicas} replica(s) x {self.P} stages "
            f"({self.where()}), schedule {self.kind}, "
            f"model {self.model.name}, {self.m} micro-batch(es) of {self.micro_batch}, "
            f"global batch {run.global_batch}, ZeRO-{self.zero_level} on the data-parallel "
            f"axis, precision {self.precision.name}{self._scale_note()}; "
            f"predicted bubble {predicted_bubble(self.P, self.m):.3f}"
        )
        run.log(f"pipeline split: {self.plan.describe()}")
        if self.kind == "1f1b" and self.m < self.P:
            run.log(
                f"note: {self.m} micro-batch(es) < {self.P} stages: the pipeline never fills "
                "(raise optimizer.grad_accum_steps)"
            )

    def _new_model(self):
        """One copy of this rank's model (an activation slot): the whole model, or in
        weight mode its shard bound to the group's collectives."""
        if not self.weight:
            return build_model(self.params.model)
        whole = build_gpt2(self.params.model).config
        model = GPT2TP(whole, self.T, self.shard, self.params.runconfig.sequence_parallel)
        model.bind(self.tcoll)
        return model

    def _split_note(self) -> str:
        if not self.weight:
            return ""
        c = self.model.config
        C, H, V = c.n_embd, c.n_head, c.vocab_size
        sp = self.params.runconfig.sequence_parallel
        return (
            f"; each shard holds {H // self.T} of {H} heads, {4 * C // self.T} of {4 * C} MLP "
            f"columns, {V // self.T} of {V} vocabulary rows"
            + (f"; sequence parallel: 1/{self.T} of the token rows between them" if sp else "")
        )

    def _scale_note(self) -> str:
        if self.scaler is None:
            return ""
        return f" ({describe_scaling(self.scaler)})"

    def where(self) -> str:
        P, T = self.P, self.T
        if T == 1:
            return f"rank r: stage r % {P}, replica r // {P}"
        if self.weight:
            return f"rank r: stage (r // {T}) % {P}, shard r % {T}, replica r // {P * T}"
        return f"rank r: stage (r // {T}) % {P}, replica (r // {P * T}) x {T} + r % {T}"

    def warm(self) -> None:
        warm_kernels()

    def allocate(self, run) -> None:
        try:
            self._allocate(run)
        except SimulatedOutOfMemoryError as e:  # bad input (exit 2), as data parallelism's
            raise ConfigError(
                f"{e}\n  pipeline: stage {self.stage} of {self.P} holds its parameter range "
                "and one activation arena per micro-batch in flight (1f1b: P - stage, gpipe: "
                "all); more stages, 1f1b or a smaller train_input.batch_size fit better",
                "runconfig.pipeline_parallel",
            ) from None

    def _allocate(self, run) -> None:
        p, r = self.params, self.params.runconfig
        s, P, layout, plan = self.stage, self.P, self.layout, self.plan
        half = self.precision.half is not None
        wbytes = self.precision.weight_bytes  # device bytes of weights, gradients, activations

        def alloc(category: str, name: str, n: int) -> np.ndarray:
            return self.memory.alloc(category, name, n, elem=wbytes)

        a, b = plan.flat[s]
        self.lo, self.hi = a, b
        # the stage's slice boundaries at D ranks, relative to its range
        self.bounds = np.clip(layout.bounds - a, 0, b - a)
        d = self.replica
        plo, phi = a + int(self.bounds[d]), a + int(self.bounds[d + 1])
        self.own = (plo, phi)  # the reduced gradients this rank counts in the norm
        self.update = (plo, phi) if self.zero_level >= 1 else (a, b)
        zero3 = self.zero_level == 3
        # mixed precision: the weights as 16-bit words, ZeRO-3's slice always, the range at
        # ZeRO 0-2 where ``_packs_weights`` says so
        self.packed = half and not zero3 and self._packs_weights()
        self.as_words = self.packed or (half and zero3)
        if self.packed:
            # from an even flat index, so ZeRO-1/2's all-gather moves two words per float32
            # element; the device holds 2 bytes a weight, as without words
            self.poff = a - a % 2
            self.memory.reserve("parameters", "params", wbytes * (b - a))
            self.params_flat = np.zeros(b + b % 2 - self.poff, np.uint16)
        elif self.as_words:  # ZeRO-3's slice
            self.poff = plo
            self.memory.reserve("parameters", "param_slice", wbytes * (phi - plo))
            self.params_flat = np.zeros(phi - plo, np.uint16)
        else:
            # ZeRO-3: the parameters held between stages are the rank's slice of the range
            self.poff = plo if zero3 else a  # the flat index of self.params_flat[0]
            self.params_flat = alloc("parameters", "param_slice" if zero3 else "params",
                                     (phi - plo) if zero3 else b - a)  # fmt: skip
        specs = {sp.name: sp for sp in layout.specs}

        def views(buf: np.ndarray) -> dict[str, np.ndarray]:
            out = {}
            for n, owner in plan.owner.items():
                if owner == s:
                    off = layout.offsets[n] - a
                    out[n] = buf[off : off + specs[n].numel].reshape(specs[n].shape)
            return out

        self.pviews = {} if zero3 or self.packed else views(self.params_flat)
        # tied copies (last stage) and the owner's receive buffers (first stage)
        self.tied_users = [(n, u) for n, own, u in plan.tied if own == s]
        self.tied_copies = [(n, own) for n, own, u in plan.tied if u == s]
        if self.zero_level >= 2:
            # the step's gradients: this rank's slice; each micro-batch's gradients go to a
            # bucket over the stage's range, reduce-scattered into the slice after its
            # backward (as data parallelism's ZeRO-2 does per gradient group)
            self.grads = alloc("gradients", "grad_slice", phi - plo)
            self.micro_grads = alloc("buckets", "grad_bucket", b - a)
            self.goff = plo  # the flat index of self.grads[0]
        else:
            self.grads = alloc("gradients", "grads", b - a)
            self.micro_grads = alloc("gradients", "micro_grads", b - a) if self.m > 1 else None
            self.goff = a
        if self.weight:
            self._weight_parts(plo, phi)
        self.gviews = GradientViews(
            views(self.grads if self.micro_grads is None else self.micro_grads)
        )
        self._tied_send: dict[str, list[np.ndarray]] = {}
        if zero3 or self.packed:
            self._allocate_gathers(alloc)
        for n, _ in self.tied_copies:
            shape = specs[n].shape
            if not (zero3 or self.packed):  # else its group's words or slice: _allocate_gathers
                self.pviews[n] = alloc("parameters", f"tied.{n}", specs[n].numel).reshape(shape)
            # two buffers: the send of micro-batch j may still run while j + 1 writes
            self._tied_send[n] = [
                alloc("gradients", f"tied_grad.{n}.{i}", specs[n].numel).reshape(shape)
                for i in range(2)
            ]
        nslots = slots_needed(self.kind, P, s, self.m)
        self.slots = []
        for i in range(nslots):
            model = self.model if i == 0 else self._new_model()
            if i and hasattr(model, "set_precision"):
                model.set_precision(self.precision)
            self.memory.reserve(
                "activations",
                f"model.arena.{i}",
                model.activation_bytes(self.micro_batch) * wbytes // 4,
            )
            model.allocate(self.micro_batch)
            if hasattr(model, "bind_step"):
                model.bind_step(r.seed, lambda: run.step)
            self.slots.append(model)
        self._tied_recv = {
            n: [
                alloc("gradients", f"tied_recv.{n}.{i}", specs[n].numel).reshape(specs[n].shape)
                for i in range(nslots)
            ]
            for n, _ in self.tied_users
        }
        self.optimizer = Optimizer(p.optimizer, layout, *self.update, self.memory.alloc, half)
        self.sampler = DistributedSampler(
            self.data.num_train,
            run.global_batch,
            self.replicas,
            self.replica,
            r.seed,
            p.train_input.shuffle,
            self.m,
        )
        # every rank draws the whole initialisation (one rng stream, as data parallelism)
        # and keeps its range and its tied copies
        full = np.zeros(layout.padded, F32)
        self.model.init_parameters(layout.views(full), np.random.default_rng(r.seed))
        fmt = self.precision.fmt
        if self.as_words:  # the words: the values' half rounding; the master: the values
            pack_half(self.params_flat, full[self.poff : self.poff + self.params_flat.size], fmt)
            for lo, buf in self.tied_slices.values():
                pack_half(buf, full[lo : lo + buf.size], fmt)
            np.copyto(self.optimizer.state["master"], full[self.update[0] : self.update[1]])
        else:
            self.params_flat[...] = full[self.poff : self.poff + self.params_flat.size]
            if zero3:
                for lo, buf in self.tied_slices.values():
                    buf[...] = full[lo : lo + buf.size]
            else:
                for n, _ in self.tied_copies:
                    self.pviews[n][...] = layout.views(full)[n]
        del full
        if half and not self.as_words:  # fp32 master of its update range; weights rounded
            self._master_from_weights()
        if self.weight:  # whole tensors, staged on every rank (``_staging``)
            self._staging()
        else:
            self.state_shard = StateShard(
                self.comm,
                self.rank,
                self.ranks,
                *self.update,
                self.optimizer.state,
                sharded=True,
                params=self.params_flat,
                params_lo=self.poff,
            )
            if self.packed:  # the range alone (the words may start one element early)
                self.state_shard.params = self.params_flat[a - self.poff : b - self.poff]
                self.state_shard.params_lo = a
            if self.as_words:  # the checkpoint reader packs what it reads (and fills the master)
                self.state_shard.write = self._write_packed
        self.k0, self.k1 = plan.ranges[s]
        self.p2p_bytes = 0
        self.wait_s = 0.0
        self.fb_steps: list[tuple[float, float]] = []  # (forward/backward time, waits) per step
        held = f"[{a:,}, {b:,})" if not zero3 else f"its slice [{plo:,}, {phi:,}) of [{a:,}, {b:,})"
        words = ""
        if self.packed:
            nbytes = self.params_flat.nbytes + sum(b.nbytes for _, b in self.tied_slices.values())
            words = (
                f" (on this host: weights {nbytes / 2**20:.1f} MiB as 16-bit words + "
                f"{self.windows[0].nbytes / 2**20:.1f} MiB float32 stage window)"
            )
        run.log(
            f"parameters: {layout.numel:,}; stage {s} of replica {d} holds {held} of "
            f"the flat layout, {nslots} activation slot(s); memory per rank (rank 0): "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.memory.bytes.items())
            + words
        )

    def _packs_weights(self) -> bool:
        """Mixed precision at ZeRO 0-2: whether this stage holds its range (and a tied group
        it reads again) as 16-bit words, each model stage reading the groups it needs
        unpacked into one float32 window (``simdist.packed_params``, per stage range):
        ``SIMDIST_PACK_WEIGHTS`` auto where that takes fewer host bytes than float32 words,
        1 always, 0 never; the bits are the same either way. Stages that share a tied
        parameter answer together, from their bytes summed (every rank of them computes
        the same), since the owner sends its values in the form the later stage holds; the
        others answer alone. Not where a group a stage reads straddles another stage."""
        mode = packing_mode()
        if mode == "0" or not hasattr(self.model, "stages"):
            return False
        together = {self.stage}
        while True:  # the stages linked to this one by tied parameters
            more = {x for _, own, user in self.plan.tied for x in (own, user)
                    if own in together or user in together}  # fmt: skip
            if more <= together:
                break
            together |= more
        layout, groups = self.layout, self.model.gradient_groups()
        numel = {sp.name: sp.numel for sp in layout.specs}
        words = floats = 0
        for s in sorted(together):
            (k0, k1), (a, b) = self.plan.ranges[s], self.plan.flat[s]
            gplan = GatherPlan(layout, self.model.stages()[k0:k1], groups)
            tied = {n for n, _, user in self.plan.tied if user == s}
            words += 2 * (b - a) + 4 * gplan.window
            floats += 4 * (b - a) + 4 * sum(numel[n] for n in tied)
            for gi in {g for u in gplan.forward + gplan.backward for g in u}:
                ga, gb = gplan.ranges[gi]
                if tied & set(gplan.names[gi]):
                    words += 2 * (gb - ga)
                elif not (a <= ga and gb <= b):
                    return False
        return mode == "1" or words < floats

    def _write_packed(self, a: int, values: np.ndarray) -> None:
        """The checkpoint reader's parameters: their rounding into the words, and the values
        into the master where this rank updates them (a saved master overwrites them after)."""
        values = np.ascontiguousarray(values, F32)
        master = self.optimizer.state["master"]
        lo, fmt = self.update[0], self.precision.fmt
        write_words(self.params_flat, self.poff, a, values, fmt, master, lo)

    def host_parameter_bytes(self) -> int:
        """Bytes of weights on this host: the range (words or float32), tied copies, windows."""
        if self.zero_level == 3 or self.packed:
            held = [self.params_flat, *self.windows, *(b for _, b in self.tied_slices.values())]
        else:
            held = [self.params_flat, *(self.pviews[n] for n, _ in self.tied_copies)]
        return sum(x.nbytes for x in held)

    def _weight_parts(self, plo: int, phi: int) -> None:
        """Weight mode: the parts of the gradient buffer this rank counts in the norm (its
        split elements, the replicated ones on shard 0 only, as ``tensor_parallel``), the
        sequence-parallel row shares in its update range, and the whole-tensor checkpoint
        layout with its staging."""
        split, seg = self.model.index, self.layout.segments
        self._norm_parts = [
            (x.lo - self.goff, x.hi - self.goff)
            for x in seg(plo, phi)
            if split[x.name] is not None or self.shard == 0
        ]
        rows = set(self.model.sequence_parallel_names())
        self._row_share_parts = [
            (x.lo - self.goff, x.hi - self.goff) for x in seg(*self.update) if x.name in rows
        ]
        self._row_share = np.zeros(sum(b - a for a, b in self._row_share_parts), F32)
        mine = {n for n, owner in self.plan.owner.items() if owner == self.stage}
        self._replicated = [n for n, x in split.items() if x is None and n in mine]
        self.checkpoint_layout = Layout(gpt2_specs(self.model.config), 1)

    def _allocate_gathers(self, alloc) -> None:
        """ZeRO-3: the gather schedule of this rank's model stages (``simdist.param_gather``
        on the stage range: its stages, every gradient group of the model as the unit),
        its two windows, and the slices of tied groups a later stage reads.

        The tied parameter (gpt2's wte, owned by stage 0, read again by the last stage's
        head) is partitioned on the last stage too: its rank of replica d keeps the tied
        gradient group's slice d (the group's range cut at the same DP boundaries as the
        owner's; the unit of a gather is a whole group, so gpt2's wpe comes along) and
        receives it from stage 0 of replica d after every update, 1/D of the tensor, then
        all-gathers it over its own stage group before the head runs. Why: wte is the
        largest tensor, and a whole copy on the last stage would undo ZeRO-3 there; the
        gathered blocks are the owner's bits, so the head computes from the values ZeRO
        0-2 hold. The head's gradient of it still travels whole to the owner each
        micro-batch (as at ZeRO 0-2): the owner adds it into its micro-batch gradient
        before its own backward, the one-rank summation order, before the reduce-scatter.

        Mixed precision's 16-bit words at ZeRO 0-2 (``self.packed``) use the same schedule
        with one float32 window on the host (the device reads the words) and whole groups:
        a group is unpacked from the rank's words, and the tied group's words are held whole
        on the last stage (sent by the owner after every update, as the tied tensor is).
        """
        layout, s, d, packed = self.layout, self.stage, self.replica, self.packed
        k0, k1 = self.plan.ranges[s]
        self.gplan = GatherPlan(layout, self.model.stages()[k0:k1], self.model.gradient_groups())
        group_of = {n: i for i, names in enumerate(self.gplan.names) for n in names}
        lo_d, hi_d = int(layout.bounds[d]), int(layout.bounds[d + 1])

        def mine(gi: int) -> tuple[int, int]:  # the group's elements in this replica's slice
            ga, gb = self.gplan.ranges[gi]
            if packed:  # every replica holds whole groups
                return ga, gb
            return max(ga, lo_d), max(max(ga, lo_d), min(gb, hi_d))

        # tied groups: received here (last stage) or sent from here (first stage)
        self.tied_slices: dict[int, tuple[int, np.ndarray]] = {}
        for gi in sorted({group_of[n] for n, _ in self.tied_copies}):
            lo, hi = mine(gi)
            if self.as_words:  # ZeRO-3: the device holds the slice, 2 bytes a weight
                if not packed:
                    self.memory.reserve("parameters", f"tied_slice.{gi}", 2 * (hi - lo))
                self.tied_slices[gi] = (lo, np.zeros(hi - lo, np.uint16))
            else:
                self.tied_slices[gi] = (lo, alloc("parameters", f"tied_slice.{gi}", hi - lo))
        if packed:  # the device holds the tied tensor, 2 bytes a weight, as without words
            numel = {sp.name: sp.numel for sp in layout.specs}
            for n, _ in self.tied_copies:
                self.memory.reserve("parameters", f"tied.{n}", 2 * numel[n])
        self.tied_out = [
            (*mine(gi), user) for gi, user in sorted({(group_of[n], u) for n, u in self.tied_users})
        ]
        for gi in sorted({g for u in self.gplan.forward + self.gplan.backward for g in u}):
            ga, gb = self.gplan.ranges[gi]
            if gi not in self.tied_slices and not (self.lo <= ga and gb <= self.hi):
                raise ConfigError(
                    f"model {self.model.name!r}: gradient group {self.gplan.names[gi]} is not "
                    f"inside pipeline stage {s}'s flat range; ZeRO-3 cannot gather it there",
                    "runconfig.zero_opt_level",
                )
        width = self.gplan.window
        if packed:  # a host working copy (no prefetch: unpacking moves nothing)
            self.windows = [np.zeros(width, F32)]
        else:
            buf = alloc("parameters", "param_window", 2 * width)
            self.windows = [buf[:width], buf[width:]]
        self.wviews: list[dict[str, np.ndarray]] = [{}, {}]
        self.cache = WindowCache(self.gplan, 1 if packed else 2)
        self.gathers = 0  # all-gathers so far (performance.json: per step)

    def _stage_params(self, k: int, phase: str) -> dict[str, np.ndarray]:
        """The parameters model stage ``k`` reads in ``phase``: ZeRO-3 gathers them (and
        prefetches the next use in one micro-batch's forward-then-backward order; across
        1F1B's interleaving the cache simply gathers what is not resident), 16-bit words
        are unpacked, else the rank's own views."""
        if self.zero_level < 3 and not self.packed:
            return self.pviews
        w, gathers = stage_gathers(self.gplan, self.cache, k - self.k0, phase, True)
        for g in gathers:
            self._gather(g)
        return self.wviews[w] if w is not None else {}

    def _gather(self, g: Gather) -> None:
        """One group all-gathered over the stage's replicas into its window (each rank's
        block from its slice; in mixed precision the half values move as 16-bit words), or
        with 16-bit words at ZeRO 0-2 unpacked from the rank's own (exact; nothing moves)."""
        region = self.windows[g.window][g.offset : g.offset + g.b - g.a]
        lo, src = self.tied_slices.get(g.group, (self.poff, self.params_flat))
        if self.packed:
            unpack_half(region, src[g.a - lo : g.b - lo], self.precision.fmt)
        else:
            bounds = self.gplan.block_bounds(g.group)
            b0, b1 = int(bounds[self.replica]), int(bounds[self.replica + 1])
            mine = src[g.a + b0 - lo : g.a + b1 - lo]
            if b1 > b0 and self.as_words:  # 16-bit words: unpacked into the window first
                unpack_half(region[b0:b1], mine, self.precision.fmt)
            elif b1 > b0:
                np.copyto(region[b0:b1], mine)
            with self.dcoll.half_wire(self.param_wire):
                self.dcoll.allgather(region, bounds=bounds, algorithm=self.algorithm)
            self.gathers += 1
        if g.offset == 0:  # the window is being reloaded: its old views are gone
            self.wviews[g.window] = {}
        views = self.wviews[g.window]
        specs = {sp.name: sp for sp in self.layout.specs}
        for n in self.gplan.names[g.group]:
            start = self.layout.offsets[n] - g.a
            views[n] = region[start : start + specs[n].numel].reshape(specs[n].shape)

    def feed(self, run) -> None:
        if not isinstance(self.data, MeasuredInput):  # every stage reads its micro-batches:
            self.data = MeasuredInput(self.data)  # the time it takes is input_report's wait
        self._send_tied()  # a resumed owner's values reach the copies
        if self.weight:
            self._staging(0)  # release the resume staging

    def start(self, run) -> None:
        self._coll_bytes0 = self.dcoll.bytes_sent + self.coll.bytes_sent
        self._group_bytes0 = self.tcoll.bytes_sent if self.weight else 0
        self.p2p_bytes = 0
        self.wait_s = 0.0
        self.fb_steps = []
        self.walls: list[float] = []
        self.gathers = 0  # ZeRO-3's parameter all-gathers
        self.busy_s = 0.0  # forward/backward phase: kernels, send waits, ZeRO-2/3's syncs
        self.host_steps: list[float] = []  # per step: the phase's rest (fetch, Python, copies)

    # ----------------------------------------------------------------- the step
    def step(self, run, step: int, guard) -> StepResult:
        n = step + 1
        scale = self.scaler.scale if self.scaler is not None else 1.0
        # the last stage's backward starts from the mean over this replica's samples times
        # the loss scale; every activation gradient sent back carries the scale
        self._dloss = scale / (self.micro_batch * self.m)
        guard.enter("forward_backward", n)
        if self.zero_level == 3 or self.packed:  # the parameters changed: windows are stale
            self.cache.invalidate()
        t0, wait0, busy0 = time.perf_counter(), self.wait_s, self.busy_s
        self._loss = 0.0
        self._pending: list[list[Any]] = [[] for _ in self.slots]
        self._tied_reqs: dict[int, list[Any]] = {}
        self._tied_send_reqs: list[list[Any]] = [[], []]
        batches = list(self.sampler.indices(step))
        self._hook = (n, guard.hook) if guard.hook else None  # test-only fault injection
        for op, j in schedule_ops(self.kind, self.P, self.stage, self.m):
            if op == "F":
                self._forward(j, batches[j])
            else:
                self._backward(j)
        t = time.perf_counter()
        for reqs in self._pending:
            self._wait(reqs)
        for reqs in self._tied_send_reqs:
            self._wait(reqs)
        fb = time.perf_counter() - t0
        self.busy_s += t0 + fb - t
        self.fb_steps.append((fb, self.wait_s - wait0))
        # what the simulated device does not replay: host time, measured (as data
        # parallelism's "other"); its kernels, waits and syncs are simulated instead
        self.host_steps.append(fb - (self.busy_s - busy0) - (self.wait_s - wait0))
        guard.enter("reduce_gradients", n)
        if self.zero_level < 2:  # mixed precision: stored half (ZeRO-2: per micro-batch)
            self.precision.store(self.grads)
        with self.dcoll.half_wire(self.grad_wire):
            grads = self._reduce()
        if self.weight and self._row_share_parts:  # sequence parallelism (tensor_parallel's)
            with self.tcoll.half_wire(self.grad_wire):
                store = self.precision.store if self.grad_wire else None
                sum_row_shares(self.tcoll, grads, self._row_share_parts, self._row_share, store)
        ulo, uhi = self.update
        g = grads[ulo - self.goff : uhi - self.goff]  # what this rank counts and updates
        if scale != 1.0:  # unscaled before the norm, clipping and the update (GradScaler)
            np.multiply(g, F32(1.0 / scale), out=g)
        own_sumsq = self._sumsq(grads)
        # the last stage's loss, once per replica (weight mode: every shard holds it)
        counts = self.stage == self.P - 1 and (not self.weight or self.shard == 0)
        loss = self._loss if counts else 0.0
        if self.scaler is None:
            sumsq, total_loss, stop = guard.check(n, own_sumsq, loss, lambda: nonfinite_text(n))
        else:
            sumsq, total_loss, stop, overflow = guard.check_overflow(n, own_sumsq, loss)
            if not self.scaler.update(overflow):  # every rank: the same overflow, the same scale
                where = self._overflow_stages(grads, loss)  # collective
                run.log(
                    f"global_step {n}: gradients overflowed at loss scale {scale:g}: step "
                    f"skipped, scale now {self.scaler.scale:g} "
                    f"({self.scaler.skipped_steps} skipped so far; {where})"
                )
                # nothing changed: no update, no gather, no tied values to send
                self.walls.append(time.perf_counter() - t0)
                return StepResult(loss, None, stop, mean_loss=total_loss / self.replicas)
        max_norm = self.params.optimizer.max_gradient_norm
        norm = float(np.sqrt(sumsq)) if max_norm is not None else None
        coef = clip_coefficient(max_norm, norm)  # applied in the update's pass
        guard.enter("update", n)
        owned = self.params_flat[ulo - self.poff : uhi - self.poff]
        lr = run.learning_rate(step)
        # the optimizer's own step count: skipped steps never reached it (GradScaler)
        applied = n - (self.scaler.skipped_steps if self.scaler is not None else 0)
        if self.precision.half is None:
            self.optimizer.step(owned, g, applied, lr, coef)
        else:
            master = self.optimizer.state["master"]
            self.optimizer.step(master, g, applied, lr, coef)
            if self.as_words:
                pack_half(owned, master, self.precision.fmt)
            else:
                self.precision.store_into(owned, master)
        guard.enter("gather_parameters", n)
        if self.zero_level in (1, 2) and self.packed:  # the words as they are, 2 per element
            bounds = np.clip(self.layout.bounds - self.poff, 0, self.params_flat.size) // 2
            with self.dcoll.half_wire(0):
                self.dcoll.allgather(self.params_flat.view(F32), bounds=bounds,
                                     algorithm=self.algorithm)  # fmt: skip
        elif self.zero_level in (1, 2):  # ZeRO-3: each stage gathers its own before it runs
            with self.dcoll.half_wire(self.param_wire):  # half values: exact in half words
                self.dcoll.allgather(self.params_flat, bounds=self.bounds, algorithm=self.algorithm)
        self._send_tied()
        self.walls.append(time.perf_counter() - t0)  # the step as DP measures it: fetch to gather
        return StepResult(loss, norm, stop, mean_loss=total_loss / self.replicas)

    def mean_loss(self, run, result: StepResult) -> float:
        if self.weight:
            self._check_shards(run.step)
        return super().mean_loss(run, result)

    def _check_shards(self, step: int) -> None:
        """Weight mode, at each summary (collective): the T shards of a stage hold the same
        replicated parameters (LayerNorms, wpe, row-parallel biases), hashes compared over
        the group as ``tensor_parallel`` compares them (16-bit words: the words; ZeRO-3
        holds slices: nothing)."""
        if self.zero_level == 3:
            return
        held = self.pviews
        if self.packed:
            specs = {sp.name: sp for sp in self.layout.specs}
            held = {}
            for n in self._replicated:
                at = self.layout.offsets[n] - self.poff
                held[n] = self.params_flat[at : at + specs[n].numel]
        if not shards_agree(self.group, held, self._replicated):
            raise RuntimeError(
                f"the replicated parameters of stage {self.stage}'s shards (replica "
                f"{self.replica}) diverged at global_step {step}"
            )

    def _overflow_stages(self, grads: np.ndarray, loss: float) -> str:
        """Where an agreed overflow came from (collective; only on overflow steps): the
        stages whose reduced gradients (the part each rank counts) hold an Inf or NaN, and
        whether the loss did."""
        plo, phi = self.own
        bad_grads = not np.isfinite(grads[plo - self.goff : phi - self.goff]).all()
        seen = self.comm.allgather((self.stage, bad_grads, not np.isfinite(loss)))
        stages = sorted({s for s, g, _ in seen if g})
        text = f"non-finite gradients on stage(s) {stages}" if stages else "finite gradients"
        return text + (", non-finite loss" if any(x for _, _, x in seen) else "")

    def _wait(self, reqs: list[Any]) -> None:
        for q in reqs:
            q.Wait()
        reqs.clear()

    def _recv(self, buf: np.ndarray, source: int, tag: int) -> None:
        t = time.perf_counter()
        self.pipe.Recv(buf, source=source, tag=tag)
        self.wait_s += time.perf_counter() - t

    def _send(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        self.p2p_bytes += buf.nbytes
        return self.pipe.Isend(buf, dest=dest, tag=tag)

    def _forward(self, j: int, indices: np.ndarray) -> None:
        s, slot = self.stage, j % len(self.slots)
        model = self.slots[slot]
        t = time.perf_counter()
        self._wait(self._pending[slot])  # the slot's previous micro-batch has left
        self.busy_s += time.perf_counter() - t
        x, y = self.data.train_batch(indices)
        if self._hook:
            self._hook[1].at_batch(self._hook[0], j, x)
        model.begin(x.copy(), y.copy())  # the loader reuses its buffers; the slot keeps these
        for n, _ in self.tied_users:  # the tied gradient of j arrives during j's journey
            buf = self._tied_recv[n][slot]
            self._tied_reqs.setdefault(j, []).append(
                self.pipe.Irecv(buf, source=self.P - 1, tag=TAG_TIED_GRAD)
            )
        if s > 0:
            for buf in model.stage_input(self.k0):
                self._recv(buf, s - 1, TAG_ACT)
        out = None
        t = time.perf_counter()
        for k in range(self.k0, self.k1):
            out = model.forward_stage(k, self._stage_params(k, FORWARD))
        self.busy_s += time.perf_counter() - t
        if s < self.P - 1:
            model.hold_for_backward()
            for buf in model.stage_input(self.k1):
                self._pending[slot].append(self._send(buf, s + 1, TAG_ACT))
        else:
            self._loss += out / self.m  # as data parallelism sums it

    def _backward(self, j: int) -> None:
        s, slot = self.stage, j % len(self.slots)
        model = self.slots[slot]
        dloss = self._dloss  # read by the last stage's head alone
        if s < self.P - 1:
            self._recv(model.stage_input_grad(self.k1), s + 1, TAG_GRAD)
        g = self.gviews
        if self.tied_copies:  # this stage writes the tied gradients' first part
            t = time.perf_counter()
            self._wait(self._tied_send_reqs[j % 2])  # the buffer's send of j - 2 is done
            self.wait_s += time.perf_counter() - t
            for n, _ in self.tied_copies:
                g[n] = self._tied_send[n][j % 2]
        if self.tied_users:  # the later stage's part, first (the order one rank runs)
            t = time.perf_counter()
            self._wait(self._tied_reqs.pop(j))
            self.wait_s += time.perf_counter() - t
            for n, _ in self.tied_users:
                np.copyto(g[n], self._tied_recv[n][slot])
        t = time.perf_counter()
        for k in range(self.k1 - 1, self.k0 - 1, -1):
            model.backward_stage(k, self._stage_params(k, BACKWARD), g, dloss)
        self.busy_s += time.perf_counter() - t
        if s > 0:
            self._pending[slot].append(self._send(model.stage_input_grad(self.k0), s - 1, TAG_GRAD))
        for n, _ in self.tied_copies:
            self._tied_send_reqs[j % 2].append(self._send(g[n], 0, TAG_TIED_GRAD))
        if self.zero_level >= 2:
            t = time.perf_counter()
            self._reduce_micro(j)
            self.busy_s += time.perf_counter() - t
        elif self.micro_grads is not None:  # simulated on the backward op
            t = time.perf_counter()
            if j == 0:
                np.copyto(self.grads, self.micro_grads)
            else:
                np.add(self.grads, self.micro_grads, out=self.grads)
            self.busy_s += time.perf_counter() - t

    def _reduce_micro(self, j: int) -> None:
        """ZeRO-2/3: micro-batch j's gradients reduce-scattered (averaged) over the stage's
        slice boundaries and added to this rank's slice in micro-batch order."""
        self.precision.store(self.micro_grads)  # mixed precision: reduced half
        if self.replicas == 1:
            mine = self.micro_grads
        else:
            with self.dcoll.half_wire(self.grad_wire):
                mine = self.dcoll.reduce_scatter(
                    self.micro_grads, bounds=self.bounds, average=True, algorithm=self.algorithm
                )
        if j == 0:
            np.copyto(self.grads, mine)
        else:
            np.add(self.grads, mine, out=self.grads)

    def _reduce(self) -> np.ndarray:
        """Average the stage's gradients over its D replicas, as data parallelism does for
        the whole buffer: reduce-scatter over the slice boundaries (+ all-gather, ZeRO-0);
        returns the stage's gradient buffer (ZeRO-1: valid in this rank's slice; ZeRO-2:
        the slice alone, which starts at flat index ``self.goff``)."""
        if self.replicas > 1 and self.zero_level < 2:  # ZeRO-2 reduced every micro-batch
            g = self.grads
            self.dcoll.reduce_scatter(g, bounds=self.bounds, average=True, algorithm=self.algorithm)
            if self.zero_level == 0:
                self.dcoll.allgather(g, bounds=self.bounds, algorithm=self.algorithm)
        return self.grads

    def _sumsq(self, grads: np.ndarray) -> float:
        """The float64 sum of squares of this replica's slice of the averaged gradients,
        summed exactly as ``sum_of_squares`` sums the slice in one piece: its LANES lanes
        passed along the pipeline in flat order; the last stage returns it, others 0."""
        acc = np.zeros(LANES, np.float64)
        if self.stage > 0:
            self.pipe.Recv(acc, source=self.stage - 1, tag=TAG_SUMSQ)
        plo, phi = self.own
        if self.weight:  # this shard's share, summed as one weight-mode rank sums it
            acc[0] = norm_share(grads, self._norm_parts, float(acc[0]))
        elif phi > plo:
            slice_lo = int(self.layout.bounds[self.replica])
            part = grads[plo - self.goff : phi - self.goff]
            lane_sum_of_squares(part, (plo - slice_lo) % LANES, acc)
        if self.stage < self.P - 1:
            self.pipe.Send(acc, dest=self.stage + 1, tag=TAG_SUMSQ)
            return 0.0
        return float(combine_lanes(acc))

    def _send_tied(self) -> None:
        """The owner's values of tied parameters to their copies (after each update; ZeRO-3:
        its slice of each tied group to the same replica's copy of that slice; 16-bit
        words: the whole tied group's words)."""
        if self.zero_level == 3 or self.packed:
            for lo, hi, user in self.tied_out:
                if hi > lo:
                    part = self.params_flat[lo - self.poff : hi - self.poff]
                    self.pipe.Send(part, dest=user, tag=TAG_TIED)
            for gi, (_, buf) in self.tied_slices.items():
                if buf.size:
                    own = self.plan.owner[self.gplan.names[gi][0]]
                    self.pipe.Recv(buf, source=own, tag=TAG_TIED)
            return
        for n, user in self.tied_users:
            self.pipe.Send(self.pviews[n], dest=user, tag=TAG_TIED)
        for n, own in self.tied_copies:
            self.pipe.Recv(self.pviews[n], source=own, tag=TAG_TIED)

    # ----------------------------------------------------------------- around the steps
    def _range_values(self) -> np.ndarray:
        """This rank's stage range of parameters, whole (ZeRO-3: its replicas' slices
        all-gathered over the stage group, a temporary; collective there; 16-bit words:
        unpacked, a temporary)."""
        if self.packed:
            words = self.params_flat[self.lo - self.poff : self.hi - self.poff]
            return read_words(words, self.precision.fmt)
        if self.zero_level < 3:
            return self.params_flat
        out = np.zeros(self.hi - self.lo, F32)
        plo, phi = self.own
        if self.as_words:
            unpack_half(out[plo - self.lo : phi - self.lo], self.params_flat, self.precision.fmt)
        else:
            out[plo - self.lo : phi - self.lo] = self.params_flat
        self.dcoll.allgather(out, bounds=self.bounds, algorithm=self.algorithm)
        return out

    def _gather_full(self, mine: np.ndarray) -> np.ndarray | None:
        """This replica's parameters, whole, on its stage 0 (None elsewhere); ``mine``:
        this rank's stage range (``_range_values``)."""
        if self.stage > 0:
            self.pipe.Send(mine, dest=0, tag=TAG_GATHER)
            return None
        full = np.zeros(self.layout.padded, F32)
        for s, (a, b) in enumerate(self.plan.flat):
            if s == 0:
                full[a:b] = mine
            else:
                self.pipe.Recv(full[a:b], source=s, tag=TAG_GATHER)
        return full

    def before_checkpoint(self, run) -> None:
        """Weight mode, collective before ``Run`` saves: world rank 0 assembles whole
        tensors from every shard's pieces (parameters from replica 0's stages, optimizer
        state from each rank's update range) into the staging ``Run`` writes."""
        if not self.weight:
            return
        mine = self._range_values()  # ZeRO-3: every replica joins its stage's gather
        first = self.replica == 0
        part = (
            self.shard,
            self.lo,
            mine if first else None,
            *self.update,
            dict(self.optimizer.state) if first or self.zero_level else {},
        )
        self._gather_whole(part)

    def checkpoint_parameters(self, run) -> dict[str, np.ndarray] | None:
        if self.weight:  # assembled by before_checkpoint
            return self.checkpoint_layout.views(self.state_shard.params) if self.rank == 0 else None
        mine = self._range_values()  # ZeRO-3: every replica joins its stage's gather
        if self.replica != 0:
            return None
        full = self._gather_full(mine)
        return None if full is None else self.layout.views(full)

    def _master_from_weights(self) -> None:
        """Mixed precision: the fp32 weights of the range this rank updates become its
        master, and every weight it holds (its range, its tied copies) their half rounding
        (all ranks round the same values). 16-bit words: the checkpoint reader wrote both
        (``_write_packed``)."""
        if self.as_words:
            return
        ulo, uhi = self.update
        np.copyto(
            self.optimizer.state["master"], self.params_flat[ulo - self.poff : uhi - self.poff]
        )
        self.precision.store(self.params_flat)
        if self.zero_level == 3:
            for _, buf in self.tied_slices.values():
                self.precision.store(buf)
        else:
            for n, _ in self.tied_copies:
                self.precision.store(self.pviews[n].reshape(-1))

    def restore(self, run, path, attrs: dict[str, Any], loaded: set[str]) -> None:
        """After ``Run`` read a checkpoint: the loss scaler's state (as data parallelism
        keeps it, so either mode resumes the other's), and a checkpoint written in fp32 has
        no master: its parameters become the master weights of this mixed-precision run.
        Weight mode: first this rank's pieces of the whole tensors ``Run`` read."""
        if self.weight:
            own, full, index = self.state_shard, self.checkpoint_layout, self.model.index
            local = shard_of_whole(index, full, own.params, self.layout)
            mine = local[self.poff : self.poff + self.params_flat.size]
            ulo, uhi = self.update
            if self.as_words:  # the words: the values' rounding; the master: the values
                pack_half(self.params_flat, mine, self.precision.fmt)
                np.copyto(self.optimizer.state["master"], local[ulo:uhi])
            else:
                self.params_flat[...] = mine
            for key in loaded:
                self.optimizer.state[key][...] = shard_of_whole(index, full, own.state[key],
                                                                self.layout)[ulo:uhi]  # fmt: skip
        if self.scaler is not None and "loss_scaler.scale" in attrs:
            self.scaler.load({k: attrs[f"loss_scaler.{k}"] for k in self.scaler.state()})
            self.skipped_steps_at_start = self.scaler.skipped_steps
        if self.precision.half is not None and "master" not in loaded:
            self._master_from_weights()
            run.log(
                f"{path} was written in {attrs.get('precision', 'fp32')}: its parameters "
                f"become the fp32 master weights of this {self.precision.name} run"
            )

    def checkpoint_attrs(self) -> dict[str, Any]:
        attrs = {
            "precision": self.precision.name,
            "tensor_parallel": self.T,
            "tensor_parallel_mode": "weight" if self.weight else "batch",
            "pipeline_parallel": self.P,
            "pipeline_schedule": self.kind,
        }
        if self.scaler is not None:  # the same on every rank; data parallelism's keys
            attrs.update({f"loss_scaler.{k}": v for k, v in self.scaler.state().items()})
        return attrs

    def summary_scalars(self) -> dict[str, float]:
        """Extra TensorBoard scalars at a summary step (as data parallelism writes them)."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped_steps}

    def _scaler_report(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        """Data parallelism's loss-scaling fields, and each rank's scale and skip count: the
        agreement keeps them equal."""
        if self.scaler is None:
            return {}
        return {
            **scaler_report(self.scaler, self.skipped_steps_at_start),
            "loss_scale_per_rank": [x["loss_scale"] for x in ranks],
            "skipped_steps_per_rank": [x["skipped_steps"] for x in ranks],
        }

    def eval_sums(self, run) -> np.ndarray:
        """Each replica's stage 0 gathers the replica's parameters and scores the replica's
        contiguous share of the held-out set, as a data-parallel rank does."""
        full = self._gather_full(self._range_values())
        if full is None:
            return np.zeros(4, np.float64)
        n, D, d = self.num_eval(), self.replicas, self.replica
        lo, hi = n * d // D, n * (d + 1) // D
        batch = self.params.eval_input.batch_size
        params = self.layout.views(full)
        loss_sum, correct = 0.0, 0
        for start in range(lo, hi, batch):
            x, y = self.data.eval_batch(start, min(start + batch, hi))
            l, c = self.model.evaluate(params, x, y)  # weight mode: with the group
            loss_sum, correct = loss_sum + l, correct + c
        if self.weight and self.shard:  # every shard scored the same: shard 0 counts
            loss_sum, correct = 0.0, 0
        meta = self.eval_meta(n) if self.rank == 0 else (0, 0)
        return np.array([loss_sum, correct, *meta], np.float64)

    def _simulate(self, run, steps: int, host_s: float, working_set: float) -> dict[str, Any]:
        """Rank 0: a step on the simulated device (``simdist.sim.pp_schedule``, the function
        plan mode calls for the same configuration) and its Chrome trace
        (``model_dir/timeline.json``, the first ``runconfig.trace_steps`` steps).
        ``est_step_time_s`` adds ``host_s`` (the measured host time of the
        forward/backward phase, the largest rank's mean per step: what a plan cannot
        know), as data parallelism's estimate adds its measured "other" time.
        ``working_set``: the bytes the ranks of rank 0's node keep resident."""
        from simdist.device import write_chrome_trace
        from simdist.sim.pp_schedule import pipeline_step, pipeline_trace

        prof, r = run.profile, self.params.runconfig
        link = "intra" if self.coll.placement.num_nodes == 1 else "inter"
        est = pipeline_step(
            self.model,
            prof,
            self.plan,
            kind=self.kind,
            micro=self.m,
            micro_batch=self.micro_batch,
            replicas=self.replicas,
            zero=self.zero_level,
            optimizer_type=self.params.optimizer.optimizer_type,
            algorithm=self.algorithm,
            link_class=link,
            half=self.precision.half,
            half_gradients=bool(self.grad_wire),
            group=self._group_calls(),
            working_set=working_set,
        )
        traced = min(r.trace_steps, steps)
        if traced:
            write_chrome_trace(
                run.model_dir / TIMELINE,
                pipeline_trace(est, self.P, self.T, self.ranks, traced),
                rank_labels=[self._rank_label(q, prof.name) for q in range(self.ranks)],
                metadata={
                    "profile": prof.name,
                    "profile_sha256": prof.sha256,
                    "steps_traced": traced,
                    "note": "simulated pipeline steps (simdist.sim.pp_schedule): every "
                    "replica's stage runs the same ops at the same simulated times",
                },
            )
        compute, exposed, bubble, stage = device_split(est, self.P)
        return {
            # the documented fields, as data parallelism's: the critical stage's compute,
            # its communication not hidden behind compute, its idle time (the bubble: waiting
            # on other stages) and the measured host time; they sum to est_step_time_s
            **est_fields(
                prof,
                run.global_batch,
                est.step_s + host_s,
                {
                    "compute": compute,
                    "exposed_comm": exposed,
                    "bubble": bubble,
                    "other": host_s,
                },
            ),
            "est_breakdown_stage": stage,
            "est_device_step_time_s": est.step_s,
            # the step's phases (plan mode's breakdown_s for the same configuration)
            "est_step_phases_s": {**est.breakdown(), "other": host_s},
            "est_forward_backward_s": est.forward_backward_s,
            "est_bubble_fraction": est.bubble_fraction,
            "est_stage_compute_s": est.stage_compute_s,
            "est_send_s": est.send_s,
            "est_send_back_s": est.send_back_s,
            "est_gradient_sync_s": est.sync_s,
            "est_optimizer_s": est.optimizer_s,
            **({"est_group_collectives_s": est.group_s} if self.weight else {}),
            **(
                {  # per stage: a step's parameter all-gathers (count, seconds)
                    "est_param_gathers_per_step": est.param_gathers,
                    "est_param_gather_s": est.param_gather_s,
                }
                if self.zero_level == 3
                else {}
            ),
            "est_note": f"{'; '.join(est.notes)}; sends and collectives over the {link} link; "
            + "input and the loop's host time measured, not simulated",
            "timeline": TIMELINE if traced else None,
        }

    def _group_calls(self) -> dict[str, list[list[Any]]] | None:
        """Weight mode: the group's collectives per phase and model stage, as the shard
        issues them (activations on the half wire in mixed precision)."""
        if not self.weight:
            return None
        act = 2 if self.precision.half is not None else 4
        seq = self.model.config.block_size
        r = self.params.runconfig
        return stage_group_calls(
            self.model, self.T, self.micro_batch, seq, r.collective_algorithm, act
        )

    def _rank_label(self, q: int, profile: str) -> str:
        T, P = self.T, self.P
        if self.weight:
            where = f"shard {q % T}, replica {q // (P * T)}"
            return f"rank {q}: stage {(q // T) % P}, {where} ({profile})"
        return f"rank {q}: stage {(q // T) % P}, replica {(q // (P * T)) * T + q % T} ({profile})"

    def close(self) -> None:
        half_operands(None)  # the process's products are plain float32 again
        super().close()

    def performance(self, run, common: dict[str, Any]) -> dict[str, Any] | None:
        r, t, steps = self.params.runconfig, run.timers, common["steps"]
        per = max(steps, 1)
        sent = self.p2p_bytes + self.dcoll.bytes_sent + self.coll.bytes_sent - self._coll_bytes0
        group = (self.tcoll.bytes_sent - self._group_bytes0) if self.weight else 0
        sent += group
        fb = sum(f for f, _ in self.fb_steps)
        mine = {
            "stage": self.stage,
            "replica": self.replica,
            "fb_steps": self.fb_steps,
            "walls": self.walls,
            "host_s": float(np.mean(self.host_steps)) if self.host_steps else 0.0,
            "receive_wait_fraction": self.wait_s / fb if fb > 0 else 0.0,
            "p2p_bytes_per_step": self.p2p_bytes / per,
            "param_gathers_per_step": self.gathers / per if self.zero_level == 3 else 0,
            "comm_bytes_sent_per_step": sent / per,
            "group_bytes_per_step": group / per,
            "memory_bytes": dict(self.memory.bytes),
            "device_memory": self.memory.device_memory.summary(),
            "host_parameter_bytes": self.host_parameter_bytes(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "loss_scale": self.scaler.scale if self.scaler else None,
            "skipped_steps": self.scaler.skipped_steps if self.scaler else None,
        }
        inputs = input_report(self.comm, self.data.wait_s, t.train_time, 0)  # collective
        ranks = self.comm.gather(mine, root=0)
        if ranks is None:
            return None
        host = max(x["host_s"] for x in ranks)
        # what the ranks of rank 0's node keep resident: on profiles keyed by it (a CPU's
        # shared caches) a kernel's operands come from as far away as this reaches
        place = self.coll.placement
        resident = sum(sum(ranks[q]["memory_bytes"].values()) for q in place.members(place.node))
        simulated = self._simulate(run, steps, host, resident) if steps else {}  # views set
        line = simulated_line(simulated)
        if line:
            run.log(line)
        return {
            **common,
            "execution_mode": "pipelined",
            "world_size": self.ranks,
            "replicas": self.replicas,
            "pipeline_parallel": self.P,
            "pipeline_schedule": self.kind,
            "precision": self.precision.name,
            "gemm": self.gemm,  # how the matrix products ran (kernels.blas.half_operands)
            **self._scaler_report(ranks),
            "tensor_parallel": self.T,
            "tensor_parallel_mode": "weight" if self.weight else "batch",
            **(
                {  # the shard's, per rank; "parameters" below: the whole model
                    "parameters_per_rank": self.layout.numel,
                    "parameters_padded_per_rank": self.layout.padded,
                    "tensor_parallel_bytes_sent_per_step": max(
                        x["group_bytes_per_step"] for x in ranks
                    ),
                }
                if self.weight
                else {}
            ),
            "pipeline_split": [
                {
                    "stage": s,
                    "model_stages": self.plan.stage_names[s],
                    "flat_range": list(self.plan.flat[s]),
                    "parameters": self.plan.params[s],
                }
                for s in range(self.P)
            ],
            "global_batch_size": run.global_batch,
            "micro_batch_size": self.micro_batch,
            "grad_accum_steps": self.m,
            "zero_opt_level": self.zero_level,
            "collective_algorithm": r.collective_algorithm,
            "gradient_algorithm": self.algorithm,
            "parameters": (self.checkpoint_layout.numel if self.weight else self.layout.numel),
            "parameters_padded": self.layout.padded,
            "step_time_s": t.train_time / per,
            **measured_steps(ranks),
            **measured_bubble(ranks, self.P),
            "predicted_bubble_fraction": predicted_bubble(self.P, self.m),
            **simulated,
            "memory_bytes": ranks[0]["memory_bytes"],
            "memory_bytes_per_rank": [x["memory_bytes"] for x in ranks],
            # the weights on each host (16-bit words and a float32 window, or float32 words)
            "host_parameter_bytes_per_rank": [x["host_parameter_bytes"] for x in ranks],
            "peak_memory_bytes_per_rank": max(sum(x["memory_bytes"].values()) for x in ranks),
            # the simulated devices' accounted peaks, as data parallelism reports them
            **memory_fields([x["device_memory"] for x in ranks], run.profile.memory_bytes),
            "peak_rss_bytes": max(x["peak_rss_bytes"] for x in ranks),
            "comm_bytes_sent_per_step": max(x["comm_bytes_sent_per_step"] for x in ranks),
            "pipeline_bytes_sent_per_step": [x["p2p_bytes_per_step"] for x in ranks],
            **(
                {"param_gathers_per_step_per_rank": [x["param_gathers_per_step"] for x in ranks]}
                if self.zero_level == 3
                else {}
            ),
            **inputs,
            "host": socket.gethostname(),
        }


def device_split(est: Any, P: int) -> tuple[float, float, float, int]:
    """(compute, exposed communication, idle, stage) of a simulated pipeline step on its
    critical stage: the one computing longest (the bottleneck; the lowest on a tie). Its
    compute-track events (forward and backward segments, accumulation, norm, optimizer)
    are compute; its communication-track events (activation sends and receives, ZeRO-3's
    gathers, weight mode's group collectives, gradient sync, agreement, all-gather, tied
    parameters) where they do not overlap its compute are exposed communication; the rest
    of ``est.step_s`` the stage idles (the bubble)."""
    per_stage = pipeline_trace(est, P, 1, P, 1)
    splits = []
    for events in per_stage:
        spans = {"compute": [], "comm": []}
        for e in events:
            spans["compute" if e["track"] == "compute" else "comm"].append((e["start"], e["dur"]))
        splits.append(busy_split(spans["compute"], spans["comm"], est.step_s))
    stage = max(range(P), key=lambda s: (splits[s][0], -s))
    return (*splits[stage], stage)


__all__ = [
    "Pipeline",
    "device_split",
    "StagePlan",
    "measured_bubble",
    "predicted_bubble",
    "schedule_ops",
    "simulate_pipeline",
    "slots_needed",
    "split_stages",
]
