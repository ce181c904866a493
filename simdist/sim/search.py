"""Plan mode's search: the fastest parallel layout of a model on N devices that fits.

    python -m simdist.plan --model gpt3-175b --devices 1024 --global-batch 1536 --search

Every configuration the analytic planner models is enumerated: data / tensor / pipeline
parallel degrees (dp·tp·pp = devices), ZeRO level, micro-batch size, activation recompute
(none / selective / full), interleaved pipeline stages, sequence parallelism and precision.
Each is planned by the same ``Planner`` as a single plan (``Planner.evaluate``, layer costs
memoised per planner), so the numbers of a configuration are exactly its ``python -m
simdist.plan`` numbers; a configuration whose model states alone exceed the device memory
is pruned before its activations and step are computed. The ranking is by predicted time
per sample (step time / global batch; with one sequence length the same order as time per
token), among the configurations that fit.

Rules that keep the space to what the frameworks run (Megatron-LM, DeepSpeed):

* tp divides the attention heads and the KV heads and stays within a node (``--max-tp``,
  default the profile's devices per node); pp divides the layers (even stages);
* the global batch is fixed (``--global-batch``: strong scaling over ``--devices``) or
  ``--batch`` samples per device (weak scaling); dp must divide it, the micro-batch must
  divide the per-replica batch (up to ``--max-micro-batch``);
* interleaving (v > 1) needs pp > 1, v dividing the layers per stage and the number of
  micro-batches a multiple of pp (Megatron's interleaved schedule);
* ZeRO 2 and 3 only without pipeline parallelism (DeepSpeed refuses them with a pipeline);
  ZeRO > 0 needs dp > 1; sequence parallelism needs tp > 1;
* precision: mixed (the profile's half type), and fp32 too unless the device's half-precision
  matmul peak is the faster (GPUs: fp32 then only with ``--precision fp32``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from simdist.device.profile import load_profile

from .plan import PlanConfig, Planner, tensor_split_error
from .plan_shapes import MLPSpec, TransformerSpec, model_state_bytes

# the dimensions of a configuration, in the order results list them
DIMENSIONS = ("tp", "pp", "dp", "interleave", "zero", "micro_batch", "recompute",
              "sequence_parallel", "precision")  # fmt: skip
EXPOSED = ("tp_comm", "pp_p2p", "dp_comm_exposed")  # exposed communication
COMPUTE = ("forward_compute", "backward_compute", "recompute", "head_and_embedding",
           "other_compute")  # fmt: skip


@dataclass(frozen=True)
class SearchSpace:
    """What a search may choose; ``None`` leaves a dimension free."""

    global_batch: int | None = None  # fixed: strong scaling; None: batch_per_device x devices
    batch_per_device: int = 8
    max_tp: int | None = None  # default: devices per node
    max_pp: int | None = None
    max_micro_batch: int = 64
    max_interleave: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    interleave: int | None = None
    sequence_parallel: bool | None = None
    precision: str | None = None

    def label(self) -> str:
        return "strong (fixed global batch)" if self.global_batch else "weak (fixed batch/device)"


@dataclass
class Candidate:
    """One evaluated configuration."""

    tp: int
    pp: int
    dp: int
    interleave: int
    zero: int
    micro_batch: int
    recompute: str
    sequence_parallel: bool
    precision: str
    global_batch: int
    fits: bool
    total_bytes: int  # a lower bound (the model states) where pruned
    step_s: float | None = None
    breakdown_s: dict[str, float] = field(default_factory=dict)
    memory_bytes: dict[str, int] = field(default_factory=dict)
    model_flops: float | None = None
    pruned: bool = False
    hw_flops: float | None = None  # model FLOPs + what recompute runs again

    @property
    def time_per_sample(self) -> float:
        return self.step_s / self.global_batch if self.step_s else math.inf

    def key(self) -> tuple:
        return tuple(getattr(self, d) for d in DIMENSIONS)

    def parts(self) -> dict[str, float]:
        """The step in four parts: compute, exposed communication, bubble, optimizer."""
        b = self.breakdown_s
        return {
            "compute": sum(b.get(k, 0.0) for k in COMPUTE),
            "exposed_comm": sum(b.get(k, 0.0) for k in EXPOSED),
            "bubble": b.get("pp_bubble", 0.0),
            "optimizer": b.get("optimizer", 0.0),
        }

    def as_dict(self, r: SearchResult, rank: int | None) -> dict[str, Any]:
        """A plan result's fields (``config``, ``memory_bytes``, ``step_s``, ... as ``python
        -m simdist.plan --json`` writes them, so ``simdist.report`` reads a search like a
        list of plans) plus the search's own (rank, time per sample, parts, TFLOP/s)."""
        cfg = {k: getattr(self, k) for k in DIMENSIONS if k != "dp"}
        cfg.update(model=r.model, devices=r.devices, profile=r.profile,
                   batch=self.global_batch // self.dp, seq=r.seq)  # fmt: skip
        samples = self.global_batch / self.step_s if self.step_s else None
        return {
            "rank": rank,
            "model": r.model,
            "profile": r.profile,
            "config": cfg,
            "dp": self.dp,
            "global_batch": self.global_batch,
            "micro_batches": self.global_batch // self.dp // self.micro_batch,
            "fits": self.fits,
            "pruned": self.pruned,
            "step_s": self.step_s,
            "time_per_sample_s": self.time_per_sample if self.step_s else None,
            "samples_per_s": samples,
            "tokens_per_s": samples * r.seq if samples else None,
            "memory_bytes": self.memory_bytes,
            "total_bytes": self.total_bytes,
            "capacity_bytes": r.capacity_bytes,
            "memory_headroom_bytes": r.capacity_bytes - self.total_bytes,
            "breakdown_s": self.breakdown_s,
            "parts_s": self.parts() if self.step_s else {},
            "model_flops_per_step": self.model_flops,
            "model_tflops_per_device": self.tflops(r.devices),
            "hardware_tflops_per_device": self.tflops(r.devices, hardware=True),
            "mfu": self.tflops(r.devices) * 1e12 / r.peak_flops
            if r.peak_flops and self.step_s
            else None,
        }

    def tflops(self, devices: int, hardware: bool = False) -> float:
        """Model FLOP/s per device in TFLOP/s (``hardware``: counting the recompute, as
        Narayanan et al. 2021 eq. 3 does)."""
        flops = self.hw_flops if hardware else self.model_flops
        if not (flops and self.step_s):
            return 0.0
        return flops / (self.step_s * devices) / 1e12


@dataclass
class SearchResult:
    model: str
    devices: int
    profile: str
    capacity_bytes: int
    peak_flops: float | None
    space: SearchSpace
    global_batch: int
    seq: int
    candidates: list[Candidate]  # all, best first (fitting ones ranked by time per sample)
    considered: int
    evaluated: int
    seconds: float
    excluded_by: list[str] = field(default_factory=list)  # the rules that removed choices

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits and c.step_s]

    @property
    def best(self) -> Candidate | None:
        fit = self.fitting
        return fit[0] if fit else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "devices": self.devices,
            "profile": self.profile,
            "capacity_bytes": self.capacity_bytes,
            "scaling": self.space.label(),
            "global_batch": self.global_batch,
            "seq": self.seq,
            "space": dataclasses.asdict(self.space),
            "considered": self.considered,
            "evaluated": self.evaluated,
            "fitting": len(self.fitting),
            "search_seconds": self.seconds,
            "configurations": [
                c.as_dict(self, i + 1 if c.fits and c.step_s else None)
                for i, c in enumerate(self.candidates)
            ],
        }


# PlanConfig's fields, settable: the search changes a few per configuration on one planner
_MutableConfig = dataclasses.make_dataclass(
    "_MutableConfig", [(f.name, f.type, f) for f in dataclasses.fields(PlanConfig)]
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_upto(n: int) -> list[int]:
    return [2**k for k in range(int(math.log2(n)) + 1)] if n >= 1 else []


def enumerate_configs(
    spec: Any,
    devices: int,
    space: SearchSpace,
    devices_per_node: int,
    has_half: bool = True,
    why: dict[str, None] | None = None,
) -> list[dict[str, Any]]:
    """Every configuration the rules of the module docstring allow (see there); ``why``
    collects, in order, each rule that removed a choice (to explain an empty result)."""

    def reject(reason: str) -> None:
        if why is not None:
            why[reason] = None

    transformer = isinstance(spec, TransformerSpec)
    layers = spec.n_layer if transformer else 1
    gb = space.global_batch or space.batch_per_device * devices
    max_tp = space.max_tp or devices_per_node
    tps = [space.tp] if space.tp else _pow2_upto(min(max_tp, devices))
    if not transformer and not space.tp:  # only a transformer's layers are split
        tps = [1]
    for t in tps:  # Megatron splits heads (and KV heads) over the TP ranks, within a node
        if (reason := tensor_split_error(spec, t, max_tp)) is not None:
            reject(reason)
    tps = [t for t in tps if tensor_split_error(spec, t, max_tp) is None]
    # fp32 only on request where half precision has the faster matmul peak (see search())
    precisions = [space.precision] if space.precision else (
        ["mixed"] if has_half else ["mixed", "fp32"]
    )  # fmt: skip
    recomputes = [space.recompute] if space.recompute else (
        ["none", "selective", "full"] if transformer else ["none"]
    )  # fmt: skip
    out: list[dict[str, Any]] = []
    for tp in tps:
        if devices % tp:
            reject(f"tp {tp} does not divide the {devices} devices")
            continue
        pps = [space.pp] if space.pp else _divisors(devices // tp)
        for pp in pps:
            if devices % (tp * pp):
                reject(f"tp x pp ({tp} x {pp}) does not divide the {devices} devices")
                continue
            if pp > layers or layers % pp:
                reject(f"pp {pp} does not divide {spec.name}'s {layers} layers")
                continue
            if space.max_pp and pp > space.max_pp:
                reject(f"pp {pp} exceeds --max-pp {space.max_pp}")
                continue
            if not transformer and pp > 1:
                reject(f"pp {pp}: the search pipelines transformers only")
                continue
            dp = devices // (tp * pp)
            if gb % dp:
                reject(f"dp {dp} does not divide the global batch {gb}")
                continue
            per_replica = gb // dp
            if space.micro_batch:
                micros = [space.micro_batch] if per_replica % space.micro_batch == 0 else []
                if not micros:
                    reject(f"--micro-batch {space.micro_batch} does not divide the batch per "
                           f"replica ({per_replica})")  # fmt: skip
            else:
                micros = [b for b in _divisors(per_replica) if b <= space.max_micro_batch]
            zeros = [space.zero] if space.zero is not None else (
                [0] if dp == 1 else [0, 1] if pp > 1 else [0, 1, 2, 3]
            )  # fmt: skip
            if space.zero and (dp == 1 or (pp > 1 and space.zero >= 2)):
                reject(f"--zero {space.zero} needs dp > 1" if dp == 1
                       else f"--zero {space.zero} not with a pipeline (pp {pp})")  # fmt: skip
                continue
            vs = [1]
            if pp > 1 and transformer:
                vs = [v for v in _divisors(layers // pp) if v <= (space.max_interleave or v)]
            if space.interleave:
                vs = [space.interleave] if space.interleave in vs else []
                if not vs:
                    reject(f"--interleave {space.interleave} needs pp > 1 and must divide the "
                           f"layers per stage (pp {pp}: {layers // pp})")  # fmt: skip
            sps = [False, True] if tp > 1 else [False]
            if space.sequence_parallel is not None:
                sps = [space.sequence_parallel] if (tp > 1 or not space.sequence_parallel) else []
                if not sps:
                    reject("--sequence-parallel needs tp > 1")
            for mb, z, v, rec, sp, prec in itertools.product(
                micros, zeros, vs, recomputes, sps, precisions
            ):
                m = per_replica // mb
                if v > 1 and m % pp:
                    reject(f"interleaving needs the micro-batches per replica to be a multiple "
                           f"of pp ({pp})")  # fmt: skip
                    continue
                out.append(dict(tp=tp, pp=pp, dp=dp, interleave=v, zero=z, micro_batch=mb,
                                recompute=rec, sequence_parallel=sp, precision=prec,
                                batch=per_replica))  # fmt: skip
    return out


def search(
    model: str,
    devices: int,
    profile: str = "a100-80gb",
    space: SearchSpace | None = None,
    base: PlanConfig | None = None,
    progress: bool | None = None,
) -> SearchResult:
    """Evaluate every allowed configuration of ``model`` on ``devices``; best first."""
    t0 = time.perf_counter()
    space = space or SearchSpace()
    base = base or PlanConfig(model=model, profile=profile)
    base = dataclasses.replace(base, model=model, profile=profile, devices=devices)
    prof = load_profile(profile)
    if base.devices_per_node:
        prof = dataclasses.replace(prof, devices_per_node=base.devices_per_node)
    planners: dict[str, Planner] = {}

    def planner(precision: str) -> Planner:
        if precision not in planners:
            p = Planner(dataclasses.replace(base, precision=precision), prof)
            p.cfg = _MutableConfig(**dataclasses.asdict(p.cfg))
            planners[precision] = p
        return planners[precision]

    first = planner(space.precision or "mixed")
    if first.execution == "weight_streaming":
        raise ValueError(
            f"--search plans resident weights; {prof.name} streams them here (plan it without "
            "--search)"
        )
    spec = first.spec
    if not isinstance(spec, (TransformerSpec, MLPSpec)):
        raise ValueError("--search needs a model's shapes (not --params-count)")
    # On a device whose half-precision matmul peak exceeds fp32's (every GPU profile), an fp32
    # layout needs twice the memory and runs its GEMMs at a fraction of the rate: it is
    # searched only when asked for (--precision fp32); each fp32 data-parallel layout is also
    # the run's own step replayed (~10 ms, not a closed form).
    half = first.dtype if first.elem == 2 else None
    has_half = bool(
        half
        and prof.has_peak("matmul", half)
        and (
            not prof.has_peak("matmul", "fp32")
            or prof.peak("matmul", half) > prof.peak("matmul", "fp32")
        )
    )
    excluded: dict[str, None] = {}
    configs = enumerate_configs(spec, devices, space, prof.devices_per_node, has_half, excluded)
    gb = space.global_batch or space.batch_per_device * devices
    seq = base.seq or getattr(spec, "seq_len", 1)
    cap = prof.memory_bytes
    params = spec.param_count()
    show = progress if progress is not None else (len(configs) > 20_000 and sys.stderr.isatty())
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(configs), desc=f"search {devices} devices", unit="cfg",
                   file=sys.stderr, mininterval=0.5)  # fmt: skip
    cands: list[Candidate] = []
    evaluated = 0
    for i, cfg in enumerate(configs):
        if bar is not None and i % 2000 == 0 and i:
            bar.update(2000)
        states = model_state_bytes(
            math.ceil(params / (cfg["tp"] * cfg["pp"])), cfg["dp"], cfg["zero"],
            cfg["precision"], base.optimizer,
        )  # fmt: skip
        lower = sum(states.values())
        dims = {k: cfg[k] for k in DIMENSIONS}
        if lower > cap:  # pruned: the model states alone do not fit
            cands.append(Candidate(**dims, global_batch=gb, fits=False, total_bytes=lower,
                                   pruned=True))  # fmt: skip
            continue
        p = planner(cfg["precision"])
        pc = p.cfg  # a mutable copy of the PlanConfig (see planner()): set in place, fast
        pc.tp, pc.pp, pc.interleave, pc.zero = cfg["tp"], cfg["pp"], cfg["interleave"], cfg["zero"]
        pc.batch, pc.micro_batch, pc.recompute = cfg["batch"], cfg["micro_batch"], cfg["recompute"]
        pc.sequence_parallel = cfg["sequence_parallel"]
        p.notes = []
        mem, breakdown, step, flops = p.evaluate()
        evaluated += 1
        total = sum(mem.values())
        cands.append(Candidate(**dims, global_batch=gb, fits=total <= cap, total_bytes=total,
                               step_s=step, breakdown_s=breakdown, memory_bytes=mem,
                               model_flops=flops,
                               hw_flops=_hardware_flops(spec, flops, cfg["recompute"], gb,
                                                        seq)))  # fmt: skip
    if bar is not None:
        bar.update(len(configs) - bar.n)
        bar.close()
    cands.sort(key=lambda c: (not (c.fits and c.step_s), c.time_per_sample, c.total_bytes))
    peak = planner(space.precision or "mixed")._peak_or_none()
    return SearchResult(model=spec.name, devices=devices, profile=prof.name, capacity_bytes=cap,
                        peak_flops=peak, space=space, global_batch=gb, seq=seq,
                        candidates=cands, considered=len(configs), evaluated=evaluated,
                        seconds=time.perf_counter() - t0,
                        excluded_by=list(excluded))  # fmt: skip


def _hardware_flops(
    spec: Any, flops: float | None, recompute: str, gb: int, seq: int
) -> float | None:
    """Model FLOPs plus those recompute runs again: full recompute repeats the layers'
    forward (the model's per-token forward less the logits' 2hV), selective the attention
    core (4 s h per token and attention block). For d_ff = 4h and full recompute this is
    Narayanan et al. 2021 eq. (3) exactly."""
    if not flops or not isinstance(spec, TransformerSpec) or recompute == "none":
        return flops
    tokens = gb * seq
    if recompute == "full":
        return flops + tokens * (flops / (3 * tokens) - 2 * spec.d_model * spec.vocab)
    return flops + tokens * 4 * seq * spec.d_model * (spec.n_layer + spec.cross_layers)


# -- explanation and tables ------------------------------------------------------------------


def _secs(x: float) -> str:
    """A step time: millisecond resolution from 1 s up (the tables' published figures), four
    significant digits below, where a small model's steps would all read 0.001."""
    return f"{x:.3f}" if x >= 1 else f"{x:#.4g}"


def _layout(c: Candidate) -> str:
    s = f"dp{c.dp} tp{c.tp} pp{c.pp}"
    if c.interleave > 1:
        s += f" v{c.interleave}"
    s += f" z{c.zero} mb{c.micro_batch} {c.recompute}"
    if c.sequence_parallel:
        s += " sp"
    return s + ("" if c.precision == "mixed" else " fp32")


def why(r: SearchResult, top: int = 3) -> list[str]:
    """Why the best configurations win: their step in parts and memory headroom, then what
    changing one choice of the best does (slower by how much, and where; or no fit)."""
    fit = r.fitting
    if not fit:
        return ["no configuration fits: " + _closest_miss(r)]
    lines = []
    for i, c in enumerate(fit[:top], 1):
        parts = c.parts()
        tot = c.step_s or 1.0
        shares = ", ".join(f"{k.replace('_', ' ')} {100 * v / tot:.0f} %" for k, v in parts.items())
        lines.append(
            f"#{i} {_layout(c)}: step {_secs(c.step_s)} s = {shares}; memory "
            f"{c.total_bytes / 1e9:.1f} of {r.capacity_bytes / 1e9:.1f} GB (headroom "
            f"{(r.capacity_bytes - c.total_bytes) / 1e9:.1f} GB)"
        )
    best = fit[0]
    index = {c.key(): c for c in r.candidates}
    lines.append(f"what changing one choice of #1 does (time per sample vs {_layout(best)}):")
    for dim in DIMENSIONS:
        if dim == "dp":
            continue
        alts = sorted({getattr(c, dim) for c in r.candidates} - {getattr(best, dim)}, key=str)
        for alt in alts:
            key = list(best.key())
            key[DIMENSIONS.index(dim)] = alt
            if dim in ("tp", "pp"):  # dp follows tp and pp
                t = alt if dim == "tp" else best.tp
                p = alt if dim == "pp" else best.pp
                if r.devices % (t * p):
                    continue
                key[DIMENSIONS.index("dp")] = r.devices // (t * p)
            other = index.get(tuple(key))
            if other is None:
                continue
            lines.append(f"  {dim}={alt}: " + _compare(best, other, r.capacity_bytes))
    return lines


def _compare(best: Candidate, other: Candidate, cap: int) -> str:
    if not other.fits:
        kind = "model states" if other.pruned else "total"
        return f"does not fit ({kind} {other.total_bytes / 1e9:.1f} GB > {cap / 1e9:.1f} GB)"
    slower = other.time_per_sample / best.time_per_sample - 1
    scale = best.global_batch / other.global_batch
    diffs = {k: v * scale - best.parts()[k] for k, v in other.parts().items()}
    k, d = max(diffs.items(), key=lambda kv: abs(kv[1]))
    return (
        f"{100 * slower:+.1f} % time per sample (largest change: {k.replace('_', ' ')} "
        f"{d:+.3f} s per step); memory {other.total_bytes / 1e9:.1f} GB"
    )


def no_layout_reason(r: SearchResult) -> str:
    """Why a search listed no configuration at all: the rules that removed every choice."""
    rules = "; ".join(r.excluded_by) or "none recorded"
    return (
        f"no configuration of {r.model} on {r.devices} devices satisfies the constraints ({rules})"
    )


def _closest_miss(r: SearchResult) -> str:
    if not r.candidates:
        return no_layout_reason(r)
    c = min(r.candidates, key=lambda c: c.total_bytes)
    return (
        f"the smallest footprint is {_layout(c)} at {c.total_bytes / 1e9:.1f} GB of "
        f"{r.capacity_bytes / 1e9:.1f} GB; use more devices or a larger device"
    )


def format_search(r: SearchResult, top: int = 10) -> str:
    fit = r.fitting
    lines = [
        f"search: {r.model} on {r.devices} x {r.profile}, global batch {r.global_batch} "
        f"(seq {r.seq}), {r.considered:,} configurations ({r.evaluated:,} evaluated, "
        f"{r.considered - r.evaluated:,} pruned: model states alone over capacity), "
        f"{len(fit):,} fit, in {r.seconds:.2f} s",
        f"  ranked by predicted time per sample; TFLOP/s per device: model FLOPs (MFU), and "
        f"hardware FLOPs counting recompute (HW); top {min(top, len(fit))}:",
        f"  {'#':>3} {'layout':<40}{'step s':>10}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>6}"
        f"{'HW TF/s':>9}{'mem GB':>8}{'comp%':>7}{'comm%':>7}{'bubl%':>7}",
    ]
    for i, c in enumerate(fit[:top], 1):
        parts = c.parts()
        tf = c.tflops(r.devices)
        mfu = f"{100 * tf * 1e12 / r.peak_flops:.0f}%" if r.peak_flops and tf else "-"
        lines.append(
            f"  {i:>3} {_layout(c):<40}{_secs(c.step_s):>10}{r.global_batch / c.step_s:>11.1f}"
            f"{tf:>9.1f}{mfu:>6}{c.tflops(r.devices, True):>9.1f}{c.total_bytes / 1e9:>8.1f}"
            f"{100 * parts['compute'] / c.step_s:>7.1f}"
            f"{100 * parts['exposed_comm'] / c.step_s:>7.1f}"
            f"{100 * parts['bubble'] / c.step_s:>7.1f}"
        )
    lines.append("  why:")
    lines += ["    " + ln for ln in why(r)]
    return "\n".join(lines)


def scaling(
    model: str, devices: list[int], profile: str, space: SearchSpace,
    base: PlanConfig | None = None, progress: bool | None = None,
) -> list[SearchResult]:  # fmt: skip
    """The search at each device count (strong scaling with a fixed global batch, weak with
    a fixed batch per device)."""
    return [search(model, n, profile, space, base, progress) for n in devices]


def format_scaling(results: list[SearchResult]) -> str:
    first = results[0]
    lines = [
        f"scaling: {first.model} on {first.profile}, {first.space.label()}; the best "
        "configuration at each size",
        f"  {'devices':>8} {'global batch':>12}  {'best layout':<40}{'step s':>9}"
        f"{'samples/s':>11}{'TFLOP/s/dev':>12}{'efficiency':>11}{'search s':>9}",
    ]
    ref = None
    for r in results:
        b = r.best
        if b is None:
            lines.append(f"  {r.devices:>8} {r.global_batch:>12}  {'no configuration fits':<40}")
            continue
        per_dev = r.global_batch / b.step_s / r.devices
        ref = ref or (per_dev, r.devices)
        eff = per_dev / ref[0]
        lines.append(
            f"  {r.devices:>8} {r.global_batch:>12}  {_layout(b):<40}{_secs(b.step_s):>9}"
            f"{r.global_batch / b.step_s:>11.1f}{b.tflops(r.devices):>12.1f}"
            f"{100 * eff:>10.1f}%{r.seconds:>9.2f}"
        )
    if ref:
        lines.append(
            f"  efficiency: samples/s per device relative to the smallest size that fits "
            f"({ref[1]} devices)"
        )
    return "\n".join(lines)


def scaling_dict(results: list[SearchResult], all_configs: bool = False) -> dict[str, Any]:
    rows = []
    for r in results:
        d = r.as_dict()
        if not all_configs:
            d["configurations"] = d["configurations"][:1] if r.best else []
        rows.append(d)
    return {"scaling": results[0].space.label(), "sizes": rows}


__all__ = [
    "Candidate",
    "SearchResult",
    "SearchSpace",
    "enumerate_configs",
    "format_scaling",
    "format_search",
    "no_layout_reason",
    "scaling",
    "scaling_dict",
    "search",
    "why",
]
