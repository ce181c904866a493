"""Analytic plan mode: memory per device and predicted step time, without running anything.

    python -m simdist.plan --model gpt2-xl --devices 64 --profile a100-80gb --zero 2 --batch 8

Everything comes from the model's shapes, the device profile and the parallel layout. Two
schedules, one set of cost functions (``simdist.device``: kernels, collectives):

* A configuration ``simdist.train`` runs itself (``--precision fp32``, data parallel / ZeRO
  0-2, FC-MNIST or a GPT-2-layout transformer, resident weights, overlap on) is planned as
  the run would simulate it: ``simdist.sim.dp_schedule`` writes down the step's events
  (kernels of simdist's own model, every collective with its real blocks) and the run's
  ``simdist.sim.step.StepModel`` times them; memory is the run's own plan
  (``simdist.memplan.rank_entries``, less the dataset's input batch buffers). The step
  equals a run's simulated compute + exposed communication (``tests/test_simulate.py``);
  only the run's measured input and host time are left out. (The first such plan in a
  process imports the model's numba kernels and MPI: 0.4 s here, once; later ones take
  milliseconds.)
* Tensor-parallel weight mode as ``simdist.train`` runs it (``--tp T --tp-mode weight``,
  fp32, a GPT-2 layout whose heads and vocabulary T divides, ZeRO 0-2 on the data-parallel
  axis, no sequence parallelism) is planned the same way on rank 0's shard
  (``simdist.models.gpt2_tp.GPT2TP`` from the shapes): ``simdist.sim.tp_schedule`` adds
  the group's collectives to the shard's data-parallel events, memory is the shard's plan
  (``tests/test_simulate.py``: rel 1e-5). ``--tp-mode batch`` (the run's batch mode: the
  group's devices divide its batch) is data parallelism over every device.
* Everything else (mixed precision, Megatron tensor / pipeline parallelism, ZeRO-3,
  recompute, weight streaming) uses the closed forms below (``simdist.sim.plan_analytic``),
  which take milliseconds. What they compute, per device:

* Model states (ZeRO, Rajbhandari et al. 2020, arXiv 1910.02054 §5): Ψ parameters on this
  model-parallel shard, N data-parallel ranks, mixed-precision Adam K = 12 (fp32 master,
  m, v): DP (2+2+K)Ψ, ZeRO-1 4Ψ + KΨ/N, ZeRO-2 2Ψ + (2+K)Ψ/N, ZeRO-3 (2+2+K)Ψ/N.
  fp32 Adam (no master copy, K = 8): DP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N,
  ZeRO-3 16Ψ/N. Shards are ceil(Ψ/N) elements (the paper's Ψ/N; no alignment padding).
* Activations (Korthikanti et al. 2022, arXiv 2205.05198 §4): per layer, e = bytes per
  activation element (2 mixed, 4 fp32), dropout masks 1 byte, f = d_ff::

      attention  sbh(5e + 1) + as²b(2e + 1)     MLP  sbh(e + 1) + 2e·sbf     LN  2e·sbh

  which for e = 2, f = 4h is the paper's sbh(34 + 5as/h); for fp32 it is sbh(66 + 9as/h).
  Tensor parallel t splits the Q, K, V, projection-input, GELU and attention-score terms
  (paper: sbh(10 + 24/t + 5as/(ht))); sequence parallel splits the rest; selective
  recompute drops the as²b terms; full recompute keeps only the layer input (sbh·e) plus one
  layer's working set during its backward. 1F1B pipelining keeps min(pp, m) micro-batches in
  flight on the first stage (×(1 + (pp−1)/(pp·v)) interleaved); the last stage adds the
  logits (s·b·V/t elements at e bytes, plus fp32 for the cross-entropy).
* Step time: every kernel of one layer (GEMMs, attention core, softmax, dropout, LayerNorm,
  GELU, residual) through the profile's kernel-time rule (``CostModel.compute_time``: the
  roofline max, or the additive rule the GPU profiles' Calculon tables were fitted with,
  see ``simdist.device.cost``); backward GEMMs are two GEMMs of the forward's size,
  backward elementwise ops move 1.5× the bytes. Tensor
  parallel all-reduces (or reduce-scatter/all-gather with sequence parallel, plus the
  backward all-gather redo) are exposed, as in Megatron. Pipeline: (m + (pp−1)/v) stage
  times (Narayanan et al. 2021, arXiv 2104.04473 §2.2) plus blocking p2p transfers.
  Overlap rule for data parallel: the gradient reduction overlaps the backward pass of the
  last micro-batch except one bucket (DDP, bucket 25 MB); ZeRO-1/2 add the parameter
  all-gather after the optimizer step, exposed; ZeRO-2 reduce-scatters every micro-batch;
  ZeRO-3 gathers parameters for forward and backward, hidden behind that pass's compute
  except the first layer's gather. ``--no-overlap`` exposes everything (Megatron 2021).
  Optimizer: one memory-bound pass over the owned shard (plus the fp32-master copies and
  unscale of mixed precision). Every micro-batch adds its weight gradients into the gradient
  buffer (Megatron's DDP hook; the 1/dp shard with ZeRO-2/3).
* Model shapes (``simdist.sim.plan_shapes``, YAML files): grouped-query attention narrows
  the K/V projections (and the stored K, V) to kv_heads/heads; a gated FFN (SwiGLU) has
  three d_ff matrices and stores gate, up and their product (3e·sbf instead of 2e·sbf); an
  encoder-decoder's decoder layers add a cross-attention block (same kernels and stored
  activations as self-attention, one sequence length for both streams), and a pipeline
  stage is planned with the mean layer. Model FLOPs: 2 per GEMM weight per token plus the
  attention core, ×3 for forward and backward.
* Search (``simdist.sim.search``): every layout these rules allow, each planned as above.
* Weight-streaming profiles (Cerebras): weights in external memory stream in for forward and
  again for backward while gradients stream out; the step is bounded by that I/O, and
  compute is left out where the vendor publishes no peak.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from simdist.device.cost import CostModel
from simdist.device.memory import CATEGORIES, DeviceMemory, SimulatedOutOfMemoryError
from simdist.device.profile import DeviceProfile, load_profile

from .plan_analytic import DDP_BUCKET_BYTES, AnalyticStep
from .plan_shapes import (
    MODELS,
    CountSpec,
    MLPSpec,
    TransformerSpec,
    is_gpt2_layout,
    load_shape,
    model_state_bytes,
)

# -- plan inputs and result ----------------------------------------------------------------


@dataclass(frozen=True)
class PlanConfig:
    model: str = "gpt2"
    params_count: int | None = None
    devices: int = 1
    profile: str = "a100-80gb"
    zero: int = 0
    batch: int = 8  # per data-parallel replica per optimizer step
    micro_batch: int | None = None  # default: batch (no gradient accumulation)
    seq: int | None = None
    precision: str = "mixed"  # mixed | fp32
    half: str | None = None  # fp16 | bf16 for mixed; default fp16 where published, else bf16
    devices_per_node: int | None = None
    tp: int = 1
    tp_mode: str = "weight"  # runconfig.tensor_parallel_mode: weight (Megatron) | batch
    pp: int = 1
    interleave: int = 1
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False
    overlap: bool = True
    algorithm: str = "ring"
    optimizer: str = "adam"  # adam | sgd (momentum)
    bucket_bytes: int = DDP_BUCKET_BYTES
    execution: str | None = None  # pipelined (resident) | weight_streaming; default: profile's
    prefetch_depth: int = 1  # weight streaming: stages in flight ahead of the computed one
    pipeline_schedule: str = "1f1b"  # 1f1b | gpipe (pp > 1)
    model_overrides: dict[str, Any] = field(default_factory=dict)  # --model.KEY=VALUE


@dataclass
class PlanResult:
    config: dict[str, Any]
    model: str
    params: int
    params_per_device: int
    profile: str
    profile_sha256: str
    dp: int
    global_batch: int
    micro_batches: int
    seq: int
    memory_bytes: dict[str, int]
    total_bytes: int
    capacity_bytes: int
    fits: bool
    oom_message: str | None
    step_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    breakdown_s: dict[str, float]
    model_flops_per_step: float | None
    mfu: float | None
    notes: list[str] = field(default_factory=list)
    plan_seconds: float = 0.0
    # weight mode as simdist runs it: bytes a rank sends in its group's collectives per step
    # (performance.json's tensor_parallel_bytes_sent_per_step)
    tp_bytes_sent_per_step: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tensor_split_error(spec: Any, tp: int, max_tp: int) -> str | None:
    """Why Megatron's weight split (which ``simdist.train`` and ``--search`` follow) cannot
    take ``tp`` ranks for ``spec``, or None: the heads and the KV heads are divided among the
    ranks, and a group stays within ``max_tp`` devices (a node; the search's ``--max-tp``).
    The search filters its layouts with this; a single plan refuses what it names."""
    if tp == 1 or isinstance(spec, CountSpec):  # a bare count has no heads to split
        return None
    if not isinstance(spec, TransformerSpec):
        return (
            f"tp {tp}: weight mode splits a transformer's layers, and {spec.name} is not one "
            "(--tp-mode batch divides the batch instead)"
        )
    if spec.n_head % tp:
        return (
            f"tp {tp} does not divide {spec.name}'s {spec.n_head} attention heads (use a divisor)"
        )
    if spec.kv_heads % tp:
        return (
            f"tp {tp} does not divide {spec.name}'s {spec.kv_heads} key/value heads (use a divisor)"
        )
    if tp > max_tp:
        return (
            f"tp {tp} exceeds {max_tp} devices per node: a tensor-parallel group stays on one "
            "node (--devices-per-node sets the node size)"
        )
    return None


# -- the planner ---------------------------------------------------------------------------


class Planner(AnalyticStep):
    """Turns a ``PlanConfig`` into a ``PlanResult``."""

    def __init__(self, config: PlanConfig, profile: DeviceProfile | None = None):
        self.cfg = config
        prof = profile or load_profile(config.profile)
        if config.devices_per_node:
            prof = dataclasses.replace(prof, devices_per_node=config.devices_per_node)
        self.profile = prof
        # the run's runconfig.execution_mode names resident execution "pipelined"
        execution = config.execution or prof.execution
        self.execution = "resident" if execution == "pipelined" else execution
        if self.execution not in ("resident", "weight_streaming"):
            raise ValueError(f"execution must be pipelined or weight_streaming, got {execution!r}")
        if config.prefetch_depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {config.prefetch_depth}")
        self.notes: list[str] = []
        if config.precision == "mixed":
            half = config.half or ("fp16" if prof.has_peak("matmul", "fp16") else "bf16")
            self.dtype, self.elem = half, 2
        else:
            self.dtype, self.elem = "fp32", 4
        self.cost = CostModel(prof, self.dtype)
        self.spec = self._resolve_spec()
        if config.tp_mode not in ("weight", "batch"):
            raise ValueError(f"tp mode must be weight or batch, got {config.tp_mode!r}")
        if config.tp_mode == "batch" and config.tp > 1:
            # simdist's batch mode: the group's T devices each hold the whole model and
            # divide the group's batch, i.e. data parallelism over every device
            self.cfg = dataclasses.replace(config, tp=1)
            self.notes.append(
                f"tp mode batch: the {config.tp} devices of a group each hold the whole model "
                "and take their share of its batch; planned as data parallelism over the "
                "devices (--batch per device)"
            )

    # ---- layout
    def _layout(self) -> tuple[int, int]:
        c = self.cfg
        if c.devices < 1 or c.tp < 1 or c.pp < 1 or c.interleave < 1:
            raise ValueError("devices, tp, pp and interleave must be >= 1")
        if c.devices % (c.tp * c.pp):
            raise ValueError(f"devices ({c.devices}) must be a multiple of tp*pp ({c.tp * c.pp})")
        dp = c.devices // (c.tp * c.pp)
        micro = c.micro_batch or c.batch
        if c.batch < 1 or micro < 1 or c.batch % micro:
            raise ValueError(f"batch ({c.batch}) must be a positive multiple of micro-batch")
        return dp, c.batch // micro

    def evaluate(self) -> tuple[dict[str, int], dict[str, float], float | None, float | None]:
        """(memory by category, step breakdown, step seconds, model FLOPs per step) of
        ``self.cfg``: the plan without the memory check, the notes' profile remarks and the
        result record, so that a search can evaluate many configurations on one planner
        (set ``cfg``, clear ``notes``, call this)."""
        c, prof = self.cfg, self.profile
        spec = self._spec()
        dp, m = self._layout()
        micro = c.micro_batch or c.batch
        seq = c.seq or getattr(spec, "seq_len", 1)
        params = spec.param_count()
        params_dev = math.ceil(params / (c.tp * c.pp))
        self.params_per_device = params_dev  # weight mode: the run's shard (_simdist_step)
        self.tp_bytes_sent: float | None = None  # weight mode: set by _simdist_step
        mem = dict.fromkeys(CATEGORIES, 0)
        states = model_state_bytes(params_dev, dp, c.zero, c.precision, c.optimizer)
        # profiles keyed by the working set (a CPU's caches): the model states at least
        self.cost.working_set = float(sum(states.values()))
        breakdown: dict[str, float] = {}
        step: float | None = None
        model_flops: float | None = None

        if self._simdist_runs(spec):  # the run's own step, from the shapes
            step, model_flops = self._simdist_step(spec, mem, dp, m, micro, seq, breakdown)
        elif self._simdist_splits(spec):  # the run's own weight-mode step, from the shapes
            step, model_flops = self._simdist_step(spec, mem, dp, m, micro, seq, breakdown, tp=c.tp)
        elif self._simdist_pipelines(spec):  # the run's own pipeline step, from the shapes
            step, model_flops = self._pipelined_step(spec, mem, dp, m, micro, seq, breakdown)
        elif self.execution == "weight_streaming" and self._simdist_streams(spec):
            step, model_flops = self._streamed_step(spec, mem, dp, m, micro, seq, breakdown)
        elif self.execution == "weight_streaming":
            if prof.streaming is None:
                raise ValueError(self._no_weight_store(spec))
            step, model_flops = self._weight_streaming(spec, mem, micro, seq, m, breakdown)
        else:
            mem.update(states)
            if isinstance(spec, TransformerSpec):
                step, model_flops = self._transformer(spec, mem, dp, m, micro, seq, breakdown)
            elif isinstance(spec, MLPSpec):
                step, model_flops = self._mlp(spec, mem, dp, m, micro, breakdown)
            else:
                self.notes.append("parameter count only: activations and step time not planned")
            grad_bytes = (2 if c.precision == "mixed" else 4) * params_dev
            if c.zero == 3:  # gathered parameters of the current and the prefetched layer
                layer = 0
                if isinstance(spec, TransformerSpec):
                    layer = spec.layer_params() + (spec.cross_params() if spec.cross_layers else 0)
                mem["buckets"] = 2 * self.elem * math.ceil(layer / c.tp)
            elif dp > 1:
                mem["buckets"] = min(c.bucket_bytes, grad_bytes)
        return mem, breakdown, step, model_flops

    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        c, prof = self.cfg, self.profile
        spec = self._spec()
        # a layout the search would never list is refused, not planned (batch mode has tp 1)
        why = tensor_split_error(spec, c.tp, prof.devices_per_node)
        if why:
            raise ValueError(f"--tp: {why}")
        mem, breakdown, step, model_flops = self.evaluate()
        dp, m = self._layout()
        micro = c.micro_batch or c.batch
        seq = c.seq or getattr(spec, "seq_len", 1)
        params = spec.param_count()
        params_dev = self.params_per_device

        fits, oom = self._check(mem, spec, dp, micro, seq)
        total = sum(mem.values())
        gb = c.batch * dp
        samples = gb / step if step else None
        peak = self._peak_or_none()
        mfu = model_flops / (step * c.devices * peak) if (model_flops and step and peak) else None
        return PlanResult(
            config=dataclasses.asdict(c),
            model=spec.name,
            params=params,
            params_per_device=params_dev,
            profile=prof.name,
            profile_sha256=prof.sha256,
            dp=dp,
            global_batch=gb,
            micro_batches=m,
            seq=seq,
            memory_bytes=mem,
            total_bytes=total,
            capacity_bytes=prof.memory_bytes,
            fits=fits,
            oom_message=oom,
            step_s=step,
            samples_per_s=samples,
            tokens_per_s=samples * seq if samples and isinstance(spec, TransformerSpec) else None,
            breakdown_s=breakdown,
            model_flops_per_step=model_flops,
            mfu=mfu,
            notes=self.notes + self._unknown_note(),
            plan_seconds=time.perf_counter() - t0,
            tp_bytes_sent_per_step=self.tp_bytes_sent,
        )

    # ---- a configuration simdist.train runs: the run's step-time model on the shapes
    def _simdist_runs(self, spec: Any) -> bool:
        """Would ``simdist.train`` run this (fp32, or mixed precision with its half format
        named; data parallel / ZeRO 0-3, resident weights, a model simdist implements)?
        Then the plan is the run's own step."""
        c = self.cfg
        model_ok = isinstance(spec, MLPSpec) or (
            isinstance(spec, TransformerSpec) and is_gpt2_layout(spec)
        )
        return (
            model_ok
            and (c.precision == "fp32" or c.half is not None)
            and c.zero <= 3
            and c.tp == c.pp == c.interleave == 1
            and c.recompute == "none"
            and not c.sequence_parallel
            and c.overlap  # --no-overlap asks for the analytic rule (everything exposed)
            and self.execution != "weight_streaming"
        )

    def _simdist_splits(self, spec: Any) -> bool:
        """Would ``simdist.train --tensor-parallel T --tensor-parallel-mode weight`` run this
        (GPT-2 layout in fp32, bf16 or fp16, T dividing the heads and the vocabulary, and
        the sequence with sequence parallelism, ZeRO 0-2 on the data-parallel axis, no
        pipeline)? Then the plan is the run's own step."""
        c = self.cfg
        if not (
            isinstance(spec, TransformerSpec)
            and is_gpt2_layout(spec)
            and c.tp > 1
            and c.tp_mode == "weight"
            and (c.precision == "fp32" or c.half is not None)
            and c.zero <= 2
            and c.pp == c.interleave == 1
            and c.recompute == "none"
            and c.overlap
            and self.execution != "weight_streaming"
        ):
            return False
        return self._weight_split_ok(spec)

    def _weight_split_ok(self, spec: Any) -> bool:
        """Can simdist's weight mode split ``spec`` at ``tp`` (heads, vocabulary and, with
        sequence parallelism, the sequence divisible; the group on one node)? Else a note
        says why the analytic schedule is used."""
        c = self.cfg
        if c.sequence_parallel and spec.seq_len % c.tp:
            self.notes.append(
                f"simdist's sequence parallelism needs tp ({c.tp}) to divide the sequence "
                f"({spec.seq_len}): Megatron's analytic schedule instead"
            )
            return False
        if spec.n_head % c.tp or spec.vocab % c.tp:
            self.notes.append(
                f"simdist's weight mode needs tp ({c.tp}) to divide the heads ({spec.n_head}) "
                f"and the vocabulary ({spec.vocab}): Megatron's analytic schedule instead"
            )
            return False
        if c.tp > self.profile.devices_per_node:
            self.notes.append(
                f"simdist's weight mode keeps a group on one node, and tp ({c.tp}) exceeds "
                f"{self.profile.name}'s {self.profile.devices_per_node} devices per node "
                "(--devices-per-node sets it): Megatron's analytic schedule instead"
            )
            return False
        return True

    def _simdist_model(self, spec: MLPSpec | TransformerSpec, tp: int = 1) -> Any:
        """simdist's own model of ``spec``, built from its shapes (allocates nothing); with
        ``tp`` > 1 rank 0's weight-mode shard."""
        if isinstance(spec, MLPSpec):
            from simdist.model_config import FCMNISTConfig
            from simdist.models.fc_mnist import FCMNIST

            sizes = spec.sizes
            return FCMNIST(FCMNISTConfig("fc_mnist", list(sizes[1:-1]), sizes[0], sizes[-1]))
        from simdist.models.gpt2 import GPT2, GPT2Config

        cfg = GPT2Config(spec.n_layer, spec.n_head, spec.d_model, spec.seq_len, spec.vocab)
        if tp > 1:
            from simdist.models.gpt2_tp import GPT2TP

            return GPT2TP(cfg, tp, 0, self.cfg.sequence_parallel)
        return GPT2(cfg)

    def _simdist_step(
        self, spec: Any, mem: dict, dp: int, m: int, micro: int, seq: int, out: dict, tp: int = 1
    ) -> tuple[float, float]:
        """The events a simdist run of this configuration records on rank 0
        (``dp_step_events``; weight mode, ``tp`` > 1: ``tp_step_events`` on the shard),
        played by the run's ``StepModel``; memory is the run's own plan
        (``memplan.rank_entries``, of the shard in weight mode)."""
        from simdist.arena import Layout
        from simdist.comm.cost import choose_algorithm
        from simdist.device.collective import Network
        from simdist.memplan import RankSetup, by_category, rank_entries, window_elements

        from .clock import VirtualClock
        from .dp_schedule import dp_step_events
        from .step import StepModel, compute_dtype
        from .tp_schedule import group_bytes_sent, tp_step_events

        c, prof = self.cfg, self.profile
        model = self._simdist_model(spec, tp)
        tokens = isinstance(spec, TransformerSpec)
        T = seq if tokens else None
        if tokens and seq > spec.seq_len:
            raise ValueError(f"seq ({seq}) exceeds {spec.name}'s context ({spec.seq_len})")
        opt = "adamw" if c.optimizer == "adam" else "sgd"
        algorithm = c.algorithm
        if algorithm == "auto":  # what GradientSync resolves it to, without shared memory
            padded = Layout(model.parameter_specs(), dp).padded
            algorithm = choose_algorithm("reduce_scatter", 4 * padded, dp)
            self.notes.append(
                f"algorithm auto -> {algorithm} (a run with shared-memory buffers may pick shm)"
            )
        setup = RankSetup(
            numel_specs=tuple((s.name, s.numel) for s in model.parameter_specs()),
            groups=tuple((tuple(g.names), g.held) for g in model.gradient_groups()),
            world=dp,
            rank=0,
            zero_level=c.zero,
            accum=m,
            optimizer_type=opt,
            micro_batch=micro,
            algorithm=algorithm,
            activation_bytes=model.activation_bytes,
            input_bytes_per_sample=0,
            window_elements=window_elements(model, dp),
            weight_bytes=self.elem,
        )
        mem.update(by_category(rank_entries(setup)))
        dpn, ranks = prof.devices_per_node, dp * tp  # weight mode: rank d T + t, shard t
        nodes = tuple(tuple(range(a, min(a + dpn, ranks))) for a in range(0, ranks, dpn))
        net = Network(ranks, 0, "intra" if len(nodes) == 1 else "inter", nodes)
        # profiles keyed by the working set: what the ranks of a node keep resident
        self.cost.working_set = float(sum(mem.values())) * len(nodes[0])
        half = c.half if c.precision == "mixed" else None
        dtype, notes = compute_dtype(prof, half)
        self.notes += notes
        clock = VirtualClock(self.cost, 0, record_events=False)
        step_model = StepModel(
            clock,
            self.cost,
            dtype,
            net,
            c.zero,
            (0, Layout(model.parameter_specs(), dp).shard_size),
            model.kernel_costs,
            self.notes,
            elem_bytes=self.elem,
        )
        group: list = []
        if tp > 1:
            self.params_per_device = model.num_parameters()  # replicated tensors included
            assert T is not None
            events, group = tp_step_events(
                model, tp=tp, replicas=dp, level=c.zero, micro_batch=micro, seq=T, accum=m,
                optimizer_type=opt, algorithm=algorithm, requested=c.algorithm,
                grad_bytes=self.elem, param_bytes=self.elem, act_bytes=self.elem,
            )  # fmt: skip
            self.tp_bytes_sent = group_bytes_sent(group)
        else:
            events = dp_step_events(
                model, world=dp, level=c.zero, micro_batch=micro, seq=T, accum=m,
                optimizer_type=opt, algorithm=algorithm, grad_bytes=self.elem,
                param_bytes=self.elem,
            )  # fmt: skip
        played = step_model.play(events)
        summary = step_model.close(0.0, played)
        fwd, bwd = step_model.kernels((micro, T))
        # the group's collectives are all exposed (placed blocking on the clock)
        tp_comm = sum(step_model.collective_seconds(x) for x in group)
        out["forward_compute"] = m * sum(k.seconds for k in fwd)
        out["backward_compute"] = m * sum(k.seconds for k in bwd)
        out["optimizer"] = played.est.get("optimizer", 0.0)
        out["other_compute"] = summary.compute_s - sum(out.values())  # accumulate, norm
        if tp > 1:
            out["tp_comm"] = tp_comm
        out["dp_comm_total"] = summary.comm_s - tp_comm
        out["dp_comm_exposed"] = summary.exposed_comm_s - tp_comm
        if tp > 1:
            self.notes.append(
                f"schedule: simdist's own tensor-parallel weight-mode step (tp={tp}, "
                f"{dp} replica(s), ZeRO-{c.zero} on the data-parallel axis"
                + ("; sequence parallel" if c.sequence_parallel else "")
                + "; simdist.sim.tp_schedule, as a run replays it): the group's collectives "
                "exposed; memory: the shard's; no input or host time"
            )
        else:
            self.notes.append(
                f"schedule: simdist's own DP/ZeRO-{c.zero} step (simdist.sim.step, as a run "
                "replays it): ZeRO-2's per-group reduce-scatters overlap the rest of the "
                "backward (ZeRO-3's too), every other collective is exposed (ZeRO-3's stage "
                "all-gathers included); no input or host time"
            )
        return summary.total_s, self._model_flops(spec, dp, m, micro, seq)

    def _model_flops(self, spec: Any, dp: int, m: int, micro: int, seq: int) -> float:
        """Model FLOPs of one step over all replicas (attention included for transformers)."""
        if isinstance(spec, TransformerSpec):
            h, f, nl = spec.d_model, spec.ffn, spec.n_layer
            per_token = nl * (8 * h * h + 4 * h * f + 4 * seq * h) + 2 * h * spec.vocab
            return 3.0 * self.cfg.batch * dp * seq * per_token
        return float(6 * spec.param_count() * micro * m * dp)

    # ---- pipelines simdist runs: the run's pipeline step on the shapes
    def _simdist_pipelines(self, spec: Any) -> bool:
        """Would ``simdist.train --pipeline-parallel P`` run this (a model simdist pipelines,
        in fp32 or mixed precision with its half format named, ZeRO 0-3 on the data-parallel
        axis, no tensor split or a GPT-2 layout split in weight mode, with or without
        sequence parallelism)? Then the plan is the run's own simulated step
        (``simdist.sim.pp_schedule``)."""
        c = self.cfg
        gpt2 = isinstance(spec, TransformerSpec) and is_gpt2_layout(spec)
        if not (
            (isinstance(spec, MLPSpec) or gpt2)
            and c.pp > 1
            and (c.precision == "fp32" or c.half is not None)  # as _simdist_runs
            and c.interleave == 1
            and c.recompute == "none"
            and (c.tp == 1 or (gpt2 and c.tp_mode == "weight"))
            and (c.tp > 1 or not c.sequence_parallel)
            and self.execution != "weight_streaming"
        ):
            return False
        return c.tp == 1 or self._weight_split_ok(spec)

    def _pipelined_step(
        self, spec: Any, mem: dict, dp: int, m: int, micro: int, seq: int, out: dict
    ) -> tuple[float, float]:
        """What a pipeline run of this configuration estimates on its rank 0
        (``pipeline_step``: the same function, on a model built from the shapes, split by
        the run's ``StagePlan``); memory: the run's accounting of its largest rank
        (``stage_memory``)."""
        from simdist.arena import Layout
        from simdist.comm.cost import choose_algorithm
        from simdist.config import ConfigError

        from .pp_schedule import StagePlan, pipeline_step, stage_memory
        from .tp_schedule import stage_group_calls

        c, prof = self.cfg, self.profile
        if c.pipeline_schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"pipeline schedule must be 1f1b or gpipe, got {c.pipeline_schedule}")
        model = self._simdist_model(spec, c.tp)  # weight mode: shard 0 of each stage
        if isinstance(spec, TransformerSpec) and seq != spec.seq_len:
            raise ValueError(f"a pipeline runs at {spec.name}'s context ({spec.seq_len})")
        layout = Layout(model.parameter_specs(), dp)
        try:
            split = StagePlan(model, layout, c.pp)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        algorithm = c.algorithm
        if algorithm == "auto":  # what the run's stage groups resolve it to
            algorithm = choose_algorithm("reduce_scatter", 4 * layout.padded, dp)
        elif algorithm == "hierarchical":
            raise ValueError("a pipeline's stage groups sync with ring, rhd or auto")
        nodes = -(-c.devices // prof.devices_per_node)
        opt = "adamw" if c.optimizer == "adam" else "sgd"
        per_rank = [
            stage_memory(
                model,
                layout,
                split,
                s,
                kind=c.pipeline_schedule,
                micro=m,
                micro_batch=micro,
                zero=c.zero,
                replica=d,
                optimizer_type=opt,
                elem=self.elem,
            )  # fmt: skip
            for d in range(dp)
            for s in range(c.pp)
        ]
        # profiles keyed by the working set (a CPU's caches): what the ranks of the first
        # node keep resident, rank (d P + s) T + t holding its stage's accounting
        per_node = min(prof.devices_per_node, c.devices)
        resident = sum(sum(per_rank[q // c.tp].values()) for q in range(per_node))
        est = pipeline_step(
            model, prof, split, kind=c.pipeline_schedule, micro=m, micro_batch=micro,
            replicas=dp, zero=c.zero, optimizer_type=opt, algorithm=algorithm,
            link_class="intra" if nodes == 1 else "inter",
            half=self.dtype if self.elem == 2 else None,  # the run's runconfig.precision
            group=None if c.tp == 1 else stage_group_calls(
                model, c.tp, micro, seq, c.algorithm, self.elem),
            working_set=resident,
        )  # fmt: skip
        mem.update(max(per_rank, key=lambda x: sum(x.values())))
        out.update(est.breakdown())
        self.notes += est.notes
        self.notes.append(
            f"schedule: simdist's own pipeline step ({c.pipeline_schedule}, {m} micro-batches, "
            f"simulated bubble {est.bubble_fraction:.3f}; "
            "simdist.sim.pp_schedule, as a run estimates it); memory: the run's largest rank; "
            "stages: " + split.describe()
        )
        return est.step_s, self._model_flops(spec, dp, m, micro, seq)

    # ---- weight streaming simdist runs: the run's streaming step on the shapes
    def _simdist_streams(self, spec: Any) -> bool:
        """Would ``simdist.train --execution_mode weight_streaming`` run this (a GPT-2-layout
        model in fp32 or mixed precision with its half format named, no tensor or pipeline
        split)? Then the plan is the run's step."""
        c = self.cfg
        return (
            isinstance(spec, TransformerSpec)
            and is_gpt2_layout(spec)
            and (c.precision == "fp32" or c.half is not None)  # as _simdist_runs
            and c.tp == c.pp == c.interleave == 1
            and c.recompute == "none"
        )

    def _no_weight_store(self, spec: Any) -> str:
        """Why weight streaming cannot be planned here: what of ``_simdist_streams`` fails,
        each with the flag that fixes it (the usual one: mixed precision with no half format
        named, which simdist.train does not run)."""
        c = self.cfg
        needs = []
        if not (isinstance(spec, TransformerSpec) and is_gpt2_layout(spec)):
            needs.append(f"a GPT-2-layout model ({spec.name} is not)")
        if c.precision == "mixed" and c.half is None:
            needs.append(
                "a precision simdist.train runs: --precision fp32, bf16 or fp16 (mixed, the "
                "default, leaves the half format open)"
            )
        fixed = [f"--{k} {v}" for k, v in (("tp", c.tp), ("pp", c.pp), ("interleave",
                 c.interleave)) if v != 1] + ([f"--recompute {c.recompute}"]
                 if c.recompute != "none" else [])  # fmt: skip
        if fixed:
            needs.append("no " + ", ".join(fixed))
        return (
            f"{self.profile.name} has no weight store: weight streaming on it is planned only "
            f"as simdist.train runs it streamed, which needs: {'; and '.join(needs)}"
        )

    def _streamed_step(
        self, spec: Any, mem: dict, dp: int, m: int, micro: int, seq: int, out: dict
    ) -> tuple[float, float]:
        """What a weight-streaming run of this configuration replays on each device
        (``simdist.sim.streaming_step.device_step``) and accounts in its memory
        (``device_footprint``), from a model built from the shapes."""
        from .streaming_step import (
            FOOTPRINT_CATEGORY,
            device_compute,
            device_footprint,
            device_step,
            stage_traffic,
        )

        c, prof = self.cfg, self.profile
        if seq != spec.seq_len:
            raise ValueError(f"weight streaming runs at {spec.name}'s context ({spec.seq_len})")
        self._weight_store_note(spec)
        model = self._simdist_model(spec)
        stages = model.stages()
        numel = {s.name: s.numel for s in model.parameter_specs()}
        traffic = stage_traffic(stages, model.gradient_groups(), numel)
        half = self.dtype if self.elem == 2 else None  # the run's runconfig.precision
        fwd, bwd, note = device_compute(model, stages, prof, micro, half)
        t = device_step(traffic, fwd, bwd, m, prof, c.prefetch_depth, self.elem)
        for entry, n in device_footprint(model, dp, micro, c.prefetch_depth, self.elem).items():
            mem[FOOTPRINT_CATEGORY[entry]] += n
        out.update(
            compute=t.compute_s,
            exposed_weight_wait=t.weight_wait_s,
            exposed_gradient_wait=t.gradient_wait_s,
            exposed_gradient_drain=t.drain_s,
        )
        self.notes.append(
            f"schedule: simdist's own weight-streaming step (simdist.sim.streaming_step, as a "
            f"run replays it), prefetch depth {c.prefetch_depth}; {note}; the servers' "
            "optimizer time is not modelled"
        )
        return t.total_s, self._model_flops(spec, dp, m, micro, seq)

    def _unknown_note(self) -> list[str]:
        """Unpublished profile figures this plan could have used (other dtypes left out)."""
        other = [f"tflops.{d}" for d in ("fp32", "tf32", "bf16", "fp16") if d != self.dtype]
        missing = [u for u in self.profile.unknown if not u.endswith(tuple(other))]
        return [f"profile leaves out (not published): {', '.join(missing)}"] if missing else []

    def _peak_or_none(self) -> float | None:
        if self.profile.has_peak("matmul", self.dtype):
            return self.profile.peak("matmul", self.dtype)
        return None

    def _spec(self) -> TransformerSpec | MLPSpec | CountSpec:
        return self.spec

    def _resolve_spec(self) -> TransformerSpec | MLPSpec | CountSpec:
        c = self.cfg
        if c.params_count is not None:
            return CountSpec(f"custom-{c.params_count}", int(c.params_count))
        if c.model in MODELS and not c.model_overrides:
            return MODELS[c.model]
        return load_shape(c.model, c.model_overrides)  # a shape file, or a preset + overrides

    # ---- memory check with a hint
    def _check(
        self, mem: dict[str, int], spec: Any, dp: int, micro: int, seq: int
    ) -> tuple[bool, str | None]:
        c = self.cfg
        cap = self.profile.memory_bytes

        def hint(_shortfall: int) -> str:
            tips = []
            if c.zero < 3 and dp > 1:
                for z in range(c.zero + 1, 4):
                    st = model_state_bytes(
                        math.ceil(spec.param_count() / (c.tp * c.pp)),
                        dp,
                        z,
                        c.precision,
                        c.optimizer,
                    )
                    if sum(st.values()) + mem["activations"] + mem["buckets"] <= cap:
                        tips.append(f"zero_opt_level {z} would fit")
                        break
            if mem["activations"] and micro > 1:
                per = mem["activations"] / micro  # activations scale ~linearly with the batch
                fixed = sum(mem.values()) - mem["activations"]
                room = cap - fixed
                fit_b = int(room // per) if room > 0 else 0
                if 0 < fit_b < micro:
                    tips.append(f"micro-batch {fit_b} would fit")
            if c.recompute != "full" and isinstance(spec, TransformerSpec):
                tips.append("activation recompute (--recompute full) saves the most")
            return "; ".join(tips) or "use more devices or a smaller model"

        dm = DeviceMemory(cap, self.profile.name, hint=hint)
        try:
            for cat in CATEGORIES:
                dm.reserve(cat, cat, mem[cat])
        except SimulatedOutOfMemoryError as err:
            return False, str(err)
        return True, None


# -- formatting and CLI ----------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 1e9:9.3f} GB"


def format_plan(r: PlanResult) -> str:
    c = r.config
    lines = [
        f"plan: {r.model} ({r.params:,} params, {r.params_per_device:,} per model shard) on "
        f"{c['devices']} x {r.profile}",
        f"  layout: dp={r.dp} tp={c['tp']} pp={c['pp']} zero={c['zero']} precision="
        f"{c['precision']} batch/replica={c['batch']} micro-batches={r.micro_batches} "
        f"global batch={r.global_batch} seq={r.seq} recompute={c['recompute']}",
        "  memory per device (GB = 1e9 bytes, as in the ZeRO paper):",
    ]
    for cat, n in r.memory_bytes.items():
        lines.append(f"    {cat:<16}{_gb(n)}")
    lines.append(
        f"    {'total':<16}{_gb(r.total_bytes)}  of {_gb(r.capacity_bytes).strip()}"
        f"  -> {'fits' if r.fits else 'DOES NOT FIT'}"
    )
    if r.oom_message:
        lines += ["    " + ln for ln in r.oom_message.splitlines()]
    if r.step_s:
        lines.append(
            f"  predicted step time: {r.step_s * 1e3:.2f} ms  ->  "
            f"{r.samples_per_s:,.1f} samples/s"
            + (f", {r.tokens_per_s:,.0f} tokens/s" if r.tokens_per_s else "")
        )
        if r.mfu:
            lines.append(f"  model FLOPs utilisation: {100 * r.mfu:.1f} % of peak")
        if r.tp_bytes_sent_per_step:
            lines.append(
                f"  tensor-parallel bytes sent per step and rank: {r.tp_bytes_sent_per_step:,.0f}"
            )
        for k, v in r.breakdown_s.items():
            if v:
                lines.append(f"    {k:<22}{v * 1e3:12.3f} ms")
    for note in r.notes:
        lines.append(f"  note: {note}")
    lines.append(f"  (planned in {r.plan_seconds * 1e3:.1f} ms)")
    return "\n".join(lines)


def plan(**kwargs: Any) -> PlanResult:
    """Programmatic entry: ``plan(model="gpt2-xl", devices=64, zero=2, batch=8)``."""
    return Planner(PlanConfig(**kwargs)).run()
