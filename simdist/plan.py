"""Analytic plan mode: memory per device and predicted step time, without running anything.

    python -m simdist.plan --model gpt2-xl --devices 64 --profile a100-80gb --zero 2 --batch 8

Everything is closed-form from the model's shapes, the device profile and the parallel
layout, so a plan takes milliseconds. What it computes, per device:

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
  Optimizer: one memory-bound pass over the owned shard.
* Weight-streaming profiles (Cerebras): weights in external memory stream in for forward and
  again for backward while gradients stream out; the step is bounded by that I/O, and
  compute is left out where the vendor publishes no peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from simdist.device.cost import CostModel, collective_time
from simdist.device.memory import CATEGORIES, DeviceMemory, SimulatedOutOfMemoryError
from simdist.device.profile import DeviceProfile, Link, ProfileError, load_profile

DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP bucket_cap_mb default (torch docs)


# -- model shapes ------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer's shapes (GPT-2 layout unless flags say otherwise)."""

    name: str
    n_layer: int
    n_head: int
    d_model: int
    vocab: int
    seq_len: int
    d_ff: int = 0  # 0: 4 * d_model
    tied_head: bool = True
    learned_pos: bool = True
    attn_bias: bool = True
    mlp_bias: bool = True
    head_bias: bool = False
    parallel_block: bool = False  # GPT-J: one LayerNorm, attention and MLP side by side
    source: str = ""

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    def layer_params(self) -> int:
        h, f = self.d_model, self.ffn
        n_ln = 1 if self.parallel_block else 2
        attn = 4 * h * h + (4 * h if self.attn_bias else 0)
        mlp = 2 * h * f + ((f + h) if self.mlp_bias else 0)
        return n_ln * 2 * h + attn + mlp

    def param_count(self) -> int:
        h, v = self.d_model, self.vocab
        emb = v * h + (self.seq_len * h if self.learned_pos else 0)
        head = 0 if self.tied_head else h * v + (v if self.head_bias else 0)
        return emb + self.n_layer * self.layer_params() + 2 * h + head


@dataclass(frozen=True)
class MLPSpec:
    """A fully connected network (ReLU, softmax cross-entropy)."""

    name: str
    sizes: tuple[int, ...]
    source: str = ""

    def param_count(self) -> int:
        return sum(a * b + b for a, b in zip(self.sizes, self.sizes[1:], strict=False))


@dataclass(frozen=True)
class CountSpec:
    """Only a parameter count: model states are planned, activations and time are not."""

    name: str
    params: int
    source: str = "--params-count"

    def param_count(self) -> int:
        return self.params


_MEGATRON = "Narayanan et al. 2021 (arXiv 2104.04473) / Korthikanti et al. 2022 (arXiv 2205.05198)"
MODELS: dict[str, TransformerSpec | MLPSpec] = {
    # HF transformers GPT-2 configs (n_layer, n_head, n_embd, n_ctx 1024, vocab 50257)
    "gpt2-mini": TransformerSpec(
        "gpt2-mini", 4, 4, 256, 256, 128, source="simdist preset (L4 H4 E256 T128 V256, 3.26M)"
    ),
    "gpt2": TransformerSpec("gpt2", 12, 12, 768, 50257, 1024, source="HF gpt2 (124M)"),
    "gpt2-medium": TransformerSpec("gpt2-medium", 24, 16, 1024, 50257, 1024, source="HF (355M)"),
    "gpt2-large": TransformerSpec("gpt2-large", 36, 20, 1280, 50257, 1024, source="HF (774M)"),
    "gpt2-xl": TransformerSpec("gpt2-xl", 48, 25, 1600, 50257, 1024, source="HF (1.56B)"),
    # GPT-3 paper (Brown et al. 2020) Table 2.1: 1.3B, 24 layers, d_model 2048, d_head 128.
    # The table's 24 heads x 128 would not give 1.3B; d_model/128 = 16 heads does.
    "gpt3-xl": TransformerSpec("gpt3-xl", 24, 16, 2048, 50257, 2048, source="GPT-3 Table 2.1"),
    # EleutherAI GPT-J-6B (HF config): rotary (no learned positions), parallel block, no
    # attention biases, untied head with bias, vocab 50400, d_ff 16384. The model card says
    # 6,053,381,344 parameters; this count gives 6,050,882,784 (0.04 % fewer, not resolved).
    "gpt-j-6b": TransformerSpec(
        "gpt-j-6b",
        28,
        16,
        4096,
        50400,
        2048,
        d_ff=16384,
        tied_head=False,
        learned_pos=False,
        attn_bias=False,
        head_bias=True,
        parallel_block=True,
        source="HF EleutherAI/gpt-j-6b",
    ),
    "fc-mnist": MLPSpec("fc-mnist", (784, 512, 512, 10), source="simdist/params/fc_mnist.yaml"),
    # Models of the published Megatron runs used by scripts/validate_sim.py (V = 51200).
    "megatron-1.7b": TransformerSpec("megatron-1.7b", 24, 24, 2304, 51200, 2048, source=_MEGATRON),
    "megatron-22b": TransformerSpec("megatron-22b", 48, 64, 6144, 51200, 2048, source=_MEGATRON),
    "gpt3-175b": TransformerSpec("gpt3-175b", 96, 96, 12288, 51200, 2048, source=_MEGATRON),
    "turing-530b": TransformerSpec("turing-530b", 105, 128, 20480, 51200, 2048, source=_MEGATRON),
    "megatron-1t": TransformerSpec("megatron-1t", 128, 160, 25600, 51200, 2048, source=_MEGATRON),
}


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
    pp: int = 1
    interleave: int = 1
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False
    overlap: bool = True
    algorithm: str = "ring"
    optimizer: str = "adam"  # adam | sgd (momentum)
    bucket_bytes: int = DDP_BUCKET_BYTES


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

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- memory formulas -----------------------------------------------------------------------


def model_state_bytes(
    params: int, dp: int, zero: int, precision: str = "mixed", optimizer: str = "adam"
) -> dict[str, int]:
    """Per-device parameters / gradients / optimizer state (ZeRO paper §5 notation)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if precision not in ("mixed", "fp32"):
        raise ValueError(f"precision must be mixed or fp32, got {precision!r}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be adam or sgd, got {optimizer!r}")
    w = g = 2 if precision == "mixed" else 4
    # K: fp32 master (mixed only) + Adam m, v (or one momentum buffer for SGD)
    k = (4 if precision == "mixed" else 0) + (8 if optimizer == "adam" else 4)
    shard = math.ceil(params / dp)
    return {
        "parameters": w * (shard if zero >= 3 else params),
        "gradients": g * (shard if zero >= 2 else params),
        "optimizer_state": k * (shard if zero >= 1 else params),
    }


def layer_activation_bytes(
    spec: TransformerSpec,
    micro_batch: int,
    seq: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    elem: int = 2,
) -> int:
    """Activation bytes one transformer layer stores for backward (Korthikanti §4)."""
    s, b, h, a, f, t = seq, micro_batch, spec.d_model, spec.n_head, spec.ffn, tp
    sbh, sbf, as2b = s * b * h, s * b * f, a * s * s * b
    if recompute == "full":
        return sbh * elem // (t if sequence_parallel else 1)
    # replicated across TP ranks unless sequence parallel: LN inputs, QKV and fc1 inputs, masks
    replicated = (4 * elem + 2) * sbh
    split = 4 * elem * sbh + 2 * elem * sbf  # Q, K, V, projection input, GELU in/out
    scores = 0 if recompute == "selective" else (2 * elem + 1) * as2b
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if sequence_parallel:
        return (replicated + split + scores) // t
    return replicated + split // t + scores // t


# -- kernels of one layer ------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # matmul | vector | comm
    flops: float = 0.0
    bytes: float = 0.0
    collective: str = ""  # for comm ops
    count: int = 1  # identical kernels (e.g. the two backward GEMMs)


def transformer_layer_ops(
    spec: TransformerSpec, b: int, s: int, t: int, sp: bool, e: int
) -> tuple[list[Op], list[Op]]:
    """(forward, backward) kernels of one layer on one TP rank, per micro-batch."""
    h, f, a = spec.d_model, spec.ffn, spec.n_head
    tok = b * s
    hs, fs, heads = h / t, f / t, a / t
    rows = tok / t if sp else tok  # sequence-parallel regions hold 1/t of the tokens
    scores = b * heads * s * s
    act = e * tok * h  # bytes of one full [s, b, h] activation

    def gemm(name: str, m: float, k: float, n: float) -> Op:
        return Op(name, "matmul", 2 * m * k * n, e * (m * k + k * n + m * n))

    def ew(name: str, n: float, flops_per: float, bytes_per: float) -> Op:
        return Op(name, "vector", n * flops_per, n * bytes_per)

    tp_out = "reduce_scatter" if sp else "allreduce"
    fwd: list[Op] = [ew("ln1", rows * h, 8, 2 * e)]
    if sp and t > 1:
        fwd.append(Op("tp.allgather.attn", "comm", bytes=act, collective="allgather"))
    fwd += [
        gemm("qkv", tok, h, 3 * hs),
        Op("attn.qk", "matmul", 2 * scores * (h / a), e * (2 * tok * hs + scores)),
        ew("attn.softmax", scores, 5, 2 * e),
        ew("attn.dropout", scores, 1, 2 * e + 1),
        Op("attn.av", "matmul", 2 * scores * (h / a), e * (scores + 2 * tok * hs)),
        gemm("attn.proj", tok, hs, h),
    ]
    if t > 1:
        fwd.append(Op(f"tp.{tp_out}.attn", "comm", bytes=act, collective=tp_out))
    fwd += [ew("attn.dropout_residual", rows * h, 2, 3 * e + 1), ew("ln2", rows * h, 8, 2 * e)]
    if sp and t > 1:
        fwd.append(Op("tp.allgather.mlp", "comm", bytes=act, collective="allgather"))
    fwd += [gemm("mlp.fc1", tok, h, fs), ew("mlp.gelu", tok * fs, 8, 2 * e)]
    fwd.append(gemm("mlp.fc2", tok, fs, h))
    if t > 1:
        fwd.append(Op(f"tp.{tp_out}.mlp", "comm", bytes=act, collective=tp_out))
    fwd.append(ew("mlp.dropout_residual", rows * h, 2, 3 * e + 1))

    bwd: list[Op] = []
    for op in reversed(fwd):
        if op.kind == "matmul":  # data gradient and weight gradient, same size each
            bwd.append(dataclasses.replace(op, name=op.name + ".bwd", count=2))
        elif op.kind == "vector":  # read grad + saved input, write grad: ~1.5x the bytes
            bwd.append(dataclasses.replace(op, name=op.name + ".bwd", bytes=1.5 * op.bytes))
        else:  # the conjugate collective (Megatron's f/g operators)
            conj = {"allreduce": "allreduce", "reduce_scatter": "allgather"}
            bwd.append(
                dataclasses.replace(
                    op, name=op.name + ".bwd", collective=conj.get(op.collective, "reduce_scatter")
                )
            )
            if sp and op.collective == "allgather":  # redo the gather for the weight gradient
                bwd.append(dataclasses.replace(op, name=op.name + ".redo"))
    return fwd, bwd


ATTENTION_CORE = ("attn.qk", "attn.softmax", "attn.dropout", "attn.av")


def _attention_core(fwd: list[Op]) -> list[Op]:
    """The kernels selective recompute re-runs (Korthikanti §5)."""
    return [op for op in fwd if op.name in ATTENTION_CORE]


# -- the planner ---------------------------------------------------------------------------


class Planner:
    """Turns a ``PlanConfig`` into a ``PlanResult``."""

    def __init__(self, config: PlanConfig, profile: DeviceProfile | None = None):
        self.cfg = config
        prof = profile or load_profile(config.profile)
        if config.devices_per_node:
            prof = dataclasses.replace(prof, devices_per_node=config.devices_per_node)
        self.profile = prof
        self.notes: list[str] = []
        if config.precision == "mixed":
            half = config.half or ("fp16" if prof.has_peak("matmul", "fp16") else "bf16")
            self.dtype, self.elem = half, 2
        else:
            self.dtype, self.elem = "fp32", 4
        self.cost = CostModel(prof, self.dtype)

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

    def _dp_link(self, dp: int) -> tuple[Link, int]:
        """Link a data-parallel ring sees and how many DP ranks share a node."""
        prof, c = self.profile, self.cfg
        mp = c.tp * c.pp
        k_dp = max(1, prof.devices_per_node // mp) if mp < prof.devices_per_node else 1
        if dp <= k_dp:
            return prof.intra, k_dp
        if mp == 1:  # the DP group fills whole nodes: the flat multi-node ring
            return self.cost.link("inter", dp), k_dp
        nic = prof.inter
        if not nic.known:
            return nic, k_dp
        # the DP groups of a node share its NICs: this group gets k_dp/devices_per_node of them
        share = k_dp / prof.devices_per_node
        usable = nic.effective_bandwidth * prof.nics_per_node * share
        if k_dp > 1 and prof.intra.known:
            usable = min(usable, prof.intra.effective_bandwidth)
        return Link("dp", usable, nic.latency, 1.0, nic.gamma), k_dp

    def _dp_time(self, op: str, nbytes: float, dp: int) -> float:
        if dp <= 1 or nbytes <= 0:
            return 0.0
        link, k_dp = self._dp_link(dp)
        alg = self.cfg.algorithm
        if alg in ("hierarchical", "auto") and 1 < k_dp < dp:
            rail = self.cost.rail(self.profile.devices_per_node)
            return collective_time(
                op, alg, nbytes, dp, self.profile.intra, inter=rail, devices_per_node=k_dp
            )
        return collective_time(op, "ring" if alg == "hierarchical" else alg, nbytes, dp, link)

    def _op_time(self, op: Op) -> float:
        if op.kind == "comm":
            return op.count * self.cost.collective_time(
                op.collective, "ring", op.bytes, self.cfg.tp, "intra"
            )
        return op.count * self.cost.compute_time(op.flops, op.bytes, op.kind, self.dtype)

    def _ops_time(self, ops: list[Op]) -> tuple[float, float]:
        """(compute seconds, exposed TP-communication seconds)."""
        comp = comm = 0.0
        for op in ops:
            if op.kind == "comm":
                comm += self._op_time(op)
            else:
                comp += self._op_time(op)
        return comp, comm

    # ---- main entry
    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        c, prof = self.cfg, self.profile
        spec = self._spec()
        dp, m = self._layout()
        micro = c.micro_batch or c.batch
        seq = c.seq or getattr(spec, "seq_len", 1)
        params = spec.param_count()
        params_dev = math.ceil(params / (c.tp * c.pp))
        mem = dict.fromkeys(CATEGORIES, 0)
        states = model_state_bytes(params_dev, dp, c.zero, c.precision, c.optimizer)
        # profiles keyed by the working set (a CPU's caches): the model states at least
        self.cost.working_set = float(sum(states.values()))
        breakdown: dict[str, float] = {}
        step: float | None = None
        model_flops: float | None = None

        if prof.execution == "weight_streaming":
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
                layer = spec.layer_params() if isinstance(spec, TransformerSpec) else 0
                mem["buckets"] = 2 * self.elem * math.ceil(layer / c.tp)
            elif dp > 1:
                mem["buckets"] = min(c.bucket_bytes, grad_bytes)

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
        )

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
        c = self.cfg
        if c.params_count is not None:
            return CountSpec(f"custom-{c.params_count}", int(c.params_count))
        try:
            return MODELS[c.model]
        except KeyError:
            raise ValueError(
                f"unknown model '{c.model}'; available: {', '.join(MODELS)} (or --params-count)"
            ) from None

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

    # ---- transformer on a resident-weights device
    def _transformer(
        self, spec: TransformerSpec, mem: dict, dp: int, m: int, micro: int, seq: int, out: dict
    ) -> tuple[float | None, float]:
        c, e = self.cfg, self.elem
        t, pp, v = c.tp, c.pp, c.interleave
        sp = c.sequence_parallel and t > 1
        if spec.n_layer % pp:
            self.notes.append(f"{spec.n_layer} layers do not split evenly over pp={pp}")
        layers = math.ceil(spec.n_layer / pp)

        # activations: first stage holds min(pp, m) micro-batches of its layers
        per_layer = layer_activation_bytes(
            spec, micro, seq, tp=t, sequence_parallel=sp, recompute=c.recompute, elem=e
        )
        in_flight = min(pp, m)
        factor = 1 + (pp - 1) / (pp * v) if v > 1 and pp > 1 else 1.0
        stored = per_layer * layers * in_flight * factor
        working = 0
        if c.recompute != "none":  # the layer being recomputed holds its full set again
            working = layer_activation_bytes(
                spec, micro, seq, tp=t, sequence_parallel=sp, recompute="none", elem=e
            )
        tok = micro * seq
        logits = tok * spec.vocab / t * (e + 4)  # logits + fp32 cross-entropy (vocab-parallel)
        embed = tok * spec.d_model * (e + 1) / (t if sp else 1)
        first = stored + working + embed + (logits if pp == 1 else 0)
        last = per_layer * layers * factor + working + logits
        mem["activations"] = int(max(first, last))
        coef = (
            f"sbh({16 * e + 2} + {2 * e + 1}as/h)" if spec.ffn == 4 * spec.d_model else "sbh(...)"
        )
        self.notes.append(
            f"activations: Korthikanti et al. 2022, {coef} bytes per layer before TP/SP/"
            f"recompute ({e}-byte elements, 1-byte dropout masks), {layers} layers x "
            f"{in_flight} micro-batch(es) in flight, + logits"
            + (", + the working set of the layer being recomputed" if working else "")
        )

        # compute of one micro-batch on one stage
        fwd, bwd = transformer_layer_ops(spec, micro, seq, t, sp, e)
        f_c, f_tp = self._ops_time(fwd)
        b_c, b_tp = self._ops_time(bwd)
        r_c = r_tp = 0.0
        if c.recompute == "full":
            r_c, r_tp = f_c, f_tp
        elif c.recompute == "selective":
            r_c, r_tp = self._ops_time(_attention_core(fwd))
        h, vcb = spec.d_model, spec.vocab
        head = [
            Op(
                "logits",
                "matmul",
                2 * tok * h * vcb / t,
                e * (tok * h + h * vcb / t + tok * vcb / t),
            ),
            Op("cross_entropy", "vector", 5 * tok * vcb / t, (e + 4) * tok * vcb / t),
        ]
        head_bwd = [dataclasses.replace(head[0], count=2), dataclasses.replace(head[1])]
        emb = [Op("embedding", "vector", tok * h, 3 * e * tok * h)]
        hf_c, _ = self._ops_time(head)
        hb_c, _ = self._ops_time(head_bwd)
        ef_c, _ = self._ops_time(emb)
        eb_c, _ = self._ops_time([dataclasses.replace(emb[0], bytes=2 * emb[0].bytes)])
        if t > 1:  # vocab-parallel cross-entropy: all-reduce of max and sum per token
            hf_c += 2 * self.cost.collective_time("allreduce", "ring", 4 * tok, t, "intra")
        layer_f = layers * (f_c + f_tp)
        layer_b = layers * (b_c + b_tp + r_c + r_tp)
        first_stage = layer_f + layer_b + ef_c + eb_c + (hf_c + hb_c if pp == 1 else 0)
        last_stage = layer_f + layer_b + hf_c + hb_c
        stage = max(first_stage, last_stage)
        p2p = 0.0
        if pp > 1:  # scatter-gather p2p (Narayanan §4.1): 1/t of the activation per TP rank
            nbytes = e * tok * h / t
            dpn = self.profile.devices_per_node
            link = self.cost.rail(dpn) if t * pp > dpn else self.profile.intra
            one = collective_time("p2p", "ring", nbytes, 2, link)
            if t > 1:
                one += self.cost.collective_time("allgather", "ring", nbytes * t, t, "intra")
            p2p = 2 * v * one  # forward activation and backward gradient per virtual stage
        per_micro = stage + p2p
        pipeline = (m + (pp - 1) / v) * per_micro if pp > 1 else m * per_micro
        out["forward_compute"] = m * layers * f_c
        out["backward_compute"] = m * layers * b_c
        out["recompute"] = m * layers * r_c
        out["head_and_embedding"] = m * (stage - layer_f - layer_b)
        out["tp_comm"] = m * layers * (f_tp + b_tp + r_tp)
        out["pp_p2p"] = m * p2p
        out["pp_bubble"] = pipeline - m * per_micro

        # data parallel and optimizer
        params_dev = math.ceil(spec.param_count() / (t * pp))
        dp_exposed, dp_total = self._dp_sync(params_dev, dp, m, f_c * layers, b_c * layers)
        out["dp_comm_total"] = dp_total
        out["dp_comm_exposed"] = dp_exposed
        self._overlap_note(dp)
        opt = self._optimizer_time(params_dev, dp)
        out["optimizer"] = opt
        step = pipeline + dp_exposed + opt
        # model FLOPs (no recompute) per step, whole job: Narayanan eq. (3) with 72
        gb = c.batch * dp
        nl = spec.n_layer
        # per token: 3 passes x (layers x (QKV+proj 8h^2, MLP 4hf, scores 4sh) + logits 2hV);
        # for f = 4h this is Narayanan et al. eq. (3) without recompute (factor 72)
        ff = spec.ffn
        model_flops = 3.0 * gb * seq * (nl * (8 * h * h + 4 * h * ff + 4 * seq * h) + 2 * h * vcb)
        return step, model_flops

    def _dp_sync(
        self, params_dev: int, dp: int, m: int, fwd_s: float, bwd_s: float
    ) -> tuple[float, float]:
        """(exposed, total) seconds of data-parallel communication per step."""
        c = self.cfg
        if dp <= 1:
            return 0.0, 0.0
        try:
            g = (2 if c.precision == "mixed" else 4) * params_dev
            w = self.elem * params_dev
            bucket = min(1.0, c.bucket_bytes / g) if g else 1.0
            window = bwd_s * (1 - bucket) if c.overlap else 0.0

            def hidden(t_comm: float, win: float) -> float:
                return max(t_comm - win, t_comm * bucket) if c.overlap else t_comm

            if c.zero == 0:
                t_ar = self._dp_time("allreduce", g, dp)
                return hidden(t_ar, window), t_ar
            t_rs = self._dp_time("reduce_scatter", g, dp)
            t_ag = self._dp_time("allgather", w, dp)
            if c.zero in (1, 2):
                n_rs = m if c.zero == 2 else 1  # ZeRO-2 reduces every micro-batch
                return n_rs * hidden(t_rs, window) + t_ag, n_rs * t_rs + t_ag
            # ZeRO-3: per micro-batch gather for forward and backward, reduce-scatter grads
            first = t_ag / max(1, self._spec_layers())
            fwd_exp = max(first, t_ag - fwd_s) if c.overlap else t_ag
            bwd_exp = max(0.0, t_ag + t_rs - bwd_s) if c.overlap else t_ag + t_rs
            return m * (fwd_exp + bwd_exp), m * (2 * t_ag + t_rs)
        except ProfileError as err:
            self.notes.append(f"data-parallel communication not modelled: {err}")
            return 0.0, 0.0

    def _overlap_note(self, dp: int) -> None:
        c = self.cfg
        if dp <= 1:
            return
        if not c.overlap:
            self.notes.append("overlap: none (--no-overlap): all DP communication is exposed")
            return
        rule = {
            0: "gradient all-reduce hidden behind the last micro-batch's backward except one "
            f"{c.bucket_bytes / 2**20:g} MiB bucket",
            1: "gradient reduce-scatter hidden as for DP; parameter all-gather after the "
            "optimizer step exposed",
            2: "reduce-scatter every micro-batch, hidden behind its backward except one bucket; "
            "parameter all-gather after the step exposed",
            3: "parameter all-gathers hidden behind forward/backward compute except the first "
            "layer's; gradient reduce-scatter behind backward",
        }[c.zero]
        self.notes.append(f"overlap: {rule}; compute slowdown from overlap not modelled")

    def _spec_layers(self) -> int:
        spec = self._spec()
        return spec.n_layer if isinstance(spec, TransformerSpec) else 1

    def _optimizer_time(self, params_dev: int, dp: int) -> float:
        """One memory-bound pass over the owned parameters (fused Adam / SGD)."""
        c = self.cfg
        owned = math.ceil(params_dev / dp) if c.zero >= 1 else params_dev
        # bytes per parameter read + written: Adam 28 (fp32: g,p,m,v in; p,m,v out;
        # mixed: fp16 g in, fp16 p out instead of one fp32 each way: also 28); SGD 20
        per = 28 if c.optimizer == "adam" else 20
        return self.cost.compute_time(12 * owned, per * owned, "vector", "fp32")

    # ---- MLP
    def _mlp(
        self, spec: MLPSpec, mem: dict, dp: int, m: int, micro: int, out: dict
    ) -> tuple[float, float]:
        e = self.elem
        sizes = spec.sizes
        # same workspace as simdist.models.fc_mnist: outputs, hidden grads, probs, losses
        elems = micro * (sum(sizes[1:]) + sum(sizes[1:-1]) + sizes[-1] + 1)
        mem["activations"] = e * elems
        f = b = 0.0
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
            gemm = Op(
                f"fc{i}",
                "matmul",
                2 * micro * n_in * n_out,
                e * (micro * n_in + n_in * n_out + micro * n_out),
            )
            act = Op(f"act{i}", "vector", 2 * micro * n_out, 3 * e * micro * n_out)
            f += self._op_time(gemm) + self._op_time(act)
            b += 2 * self._op_time(gemm) + self._op_time(act)
        loss = Op("softmax_ce", "vector", 5 * micro * sizes[-1], 3 * e * micro * sizes[-1])
        f += self._op_time(loss)
        b += self._op_time(loss)
        params = spec.param_count()
        dp_exp, dp_total = self._dp_sync(params, dp, m, f, b)
        self._overlap_note(dp)
        opt = self._optimizer_time(params, dp)
        out.update(
            forward_compute=m * f,
            backward_compute=m * b,
            dp_comm_total=dp_total,
            dp_comm_exposed=dp_exp,
            optimizer=opt,
        )
        flops = 6 * params * micro * m * dp
        return m * (f + b) + dp_exp + opt, float(flops)

    # ---- weight streaming (Cerebras)
    def _weight_streaming(
        self, spec: Any, mem: dict, micro: int, seq: int, m: int, out: dict
    ) -> tuple[float, None]:
        c, e, prof = self.cfg, self.elem, self.profile
        assert prof.streaming is not None
        params = spec.param_count()
        store = sum(model_state_bytes(params, 1, 0, c.precision, c.optimizer).values())
        if store > prof.streaming.capacity_bytes:
            self.notes.append(
                f"model states {store / 1e12:.2f} TB exceed the weight store "
                f"({prof.streaming.capacity_bytes / 1e12:.1f} TB)"
            )
        layer = spec.layer_params() if isinstance(spec, TransformerSpec) else params
        mem["parameters"] = e * layer  # one streamed layer on the wafer at a time
        mem["gradients"] = e * layer
        if isinstance(spec, TransformerSpec):
            per_layer = layer_activation_bytes(spec, micro, seq, recompute=c.recompute, elem=e)
            mem["activations"] = per_layer * spec.n_layer
        self.notes.append(
            "weight streaming: optimizer state and master weights live in the weight store "
            "(MemoryX); the step below is the streaming I/O bound"
        )
        io = prof.streaming.bandwidth
        w = e * params
        # per micro-batch: weights in for forward, in again for backward while the gradients
        # (same size) stream out on the other direction of the full-duplex links
        t_io = m * 2 * w / io
        out["weight_streaming_io"] = t_io
        if not prof.has_peak("matmul", self.dtype):
            self.notes.append(f"{prof.name} publishes no {self.dtype} peak: compute not modelled")
        return t_io, None


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simdist.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--params-count", type=float, default=None, help="plan model states only")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--profile", default="a100-80gb", help="profile name or YAML path")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--batch", type=int, default=8, help="samples per data-parallel replica")
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: context)")
    p.add_argument("--precision", default="mixed", choices=("mixed", "fp32"))
    p.add_argument("--half", default=None, choices=("fp16", "bf16"))
    p.add_argument("--devices-per-node", type=int, default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (within a node)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--interleave", type=int, default=1, help="virtual stages per device")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--no-overlap", action="store_true", help="expose all DP communication")
    p.add_argument("--algorithm", default="ring", choices=("ring", "rhd", "hierarchical", "auto"))
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    p.add_argument("--bucket-mb", type=float, default=DDP_BUCKET_BYTES / 2**20)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = plan(
            model=args.model,
            params_count=None if args.params_count is None else int(args.params_count),
            devices=args.devices,
            profile=args.profile,
            zero=args.zero,
            batch=args.batch,
            micro_batch=args.micro_batch,
            seq=args.seq,
            precision=args.precision,
            half=args.half,
            devices_per_node=args.devices_per_node,
            tp=args.tp,
            pp=args.pp,
            interleave=args.interleave,
            recompute=args.recompute,
            sequence_parallel=args.sequence_parallel,
            overlap=not args.no_overlap,
            algorithm=args.algorithm,
            optimizer=args.optimizer,
            bucket_bytes=int(args.bucket_mb * 2**20),
        )
    except (ValueError, ProfileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
