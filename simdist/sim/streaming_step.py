"""One weight-streaming step on the simulated device: the run's clock and plan mode both.

A weight-streaming device (``simdist.streaming``) computes stage after stage while the
weights of the next stages stream in and the gradients of finished groups stream out. Its
step is a replay of that list of (weight bytes in, compute seconds, gradient bytes out) per
stage execution (``simulate_step``). The list follows from the model's stages and gradient
groups alone (``stage_traffic``): the run (``simdist.schedules.weight_streaming``) passes its
live model's, ``python -m simdist.plan`` those of a model built from shapes, and both call
``device_step``, so the two agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from simdist.device import CostModel, DeviceProfile
from simdist.models.base import GradientGroup
from simdist.models.stages import Stage
from simdist.sim.step import compute_dtype

GRADIENT_SLOTS = 2  # one group's gradients in flight while the next is computed


@dataclass
class StepTime:
    """One simulated step of one device (seconds, bytes)."""

    total_s: float = 0.0
    compute_s: float = 0.0
    weight_wait_s: float = 0.0  # compute stalled for weights not yet in the window
    gradient_wait_s: float = 0.0  # stalled for a free gradient slot
    drain_s: float = 0.0  # after the last compute, until the last gradient is out
    weights_in_bytes: float = 0.0
    gradients_out_bytes: float = 0.0

    @property
    def exposed_streaming_s(self) -> float:
        return self.total_s - self.compute_s


def simulate_step(
    work: list[tuple[float, float, float]],
    depth: int,
    bandwidth: float | None,
    latency: float = 0.0,
    gradient_slots: int = GRADIENT_SLOTS,
    spans: list[tuple[str, int, float, float]] | None = None,
) -> StepTime:
    """Replay one step: ``work`` lists (weight bytes in, compute seconds, gradient bytes
    out) per stage execution, in order. A weight transfer starts when the inbound link is
    free and its slot is (the slot's previous stage, depth + 1 transfers back, has
    computed); a stage computes when the previous one is done and its weights have arrived;
    a stage that produces gradients also needs a free gradient slot (the transfer
    ``gradient_slots`` groups back has left). ``bandwidth`` None: transfers take no time.
    ``spans``: receives (what, execution index, start, seconds) of each weight transfer
    ("weights"), computation ("compute") and gradient transfer ("gradients")."""
    t = StepTime()
    beta = 0.0 if not bandwidth else 1.0 / bandwidth
    slots = depth + 1
    in_free = out_free = end = 0.0
    weight_done: list[float] = []  # compute end of each stage that used a weight slot
    grad_out: list[float] = []  # transfer end of each gradient
    for x, (w_bytes, compute, g_bytes) in enumerate(work):
        ready = end
        if w_bytes > 0:
            i = len(weight_done)
            slot_free = weight_done[i - slots] if i >= slots else 0.0
            start = max(in_free, slot_free)
            in_free = start + latency + w_bytes * beta
            if spans is not None:
                spans.append(("weights", x, start, in_free - start))
            if in_free > ready:
                t.weight_wait_s += in_free - ready
                ready = in_free
            t.weights_in_bytes += w_bytes
        if g_bytes > 0 and len(grad_out) >= gradient_slots:
            free = grad_out[-gradient_slots]
            if free > ready:
                t.gradient_wait_s += free - ready
                ready = free
        end = ready + compute
        t.compute_s += compute
        if w_bytes > 0:
            weight_done.append(end)
        if spans is not None:
            spans.append(("compute", x, ready, compute))
        if g_bytes > 0:
            sent = max(out_free, end)
            out_free = sent + latency + g_bytes * beta
            grad_out.append(out_free)
            t.gradients_out_bytes += g_bytes
            if spans is not None:
                spans.append(("gradients", x, sent, out_free - sent))
    t.total_s = max(end, out_free)
    t.drain_s = t.total_s - end
    return t


def stage_compute_times(model, stages: list[Stage], cost: CostModel, batch: int) -> tuple:
    """(forward seconds, backward seconds) per stage on the simulated device, from the
    model's ``kernel_costs`` where it has them (each kernel on its stage: ``_stage_of``),
    else 6 N FLOPs per token. Returns (fwd, bwd, note)."""
    nst = len(stages)
    fwd, bwd = [0.0] * nst, [0.0] * nst
    if not cost.profile.has_peak("matmul", cost.dtype):
        return fwd, bwd, f"{cost.profile.name} publishes no {cost.dtype} peak: compute not modelled"
    index = {st.name: k for k, st in enumerate(stages)}
    costs = getattr(model, "kernel_costs", None)
    if costs is not None:
        aliases = getattr(model, "kernel_stages", {})
        for kc in costs(batch):
            k = _stage_of(kc.name, index, aliases, nst)
            secs = kc.count * cost.compute_time(
                kc.flops, kc.bytes, kc.kind, shape=kc.shape, serial_flops=kc.serial_flops
            )
            (fwd if kc.phase == "forward" else bwd)[k] += secs
        return fwd, bwd, "compute: the model's kernel costs on the profile"
    specs = {s.name: s for s in model.parameter_specs()}
    tokens = batch * getattr(getattr(model, "config", None), "block_size", 1)
    for k, st in enumerate(stages):
        n = sum(specs[p].numel for p in st.forward_params if len(specs[p].shape) >= 2)
        fwd[k] = cost.compute_time(2.0 * tokens * n, 4.0 * n)
        bwd[k] = 2 * fwd[k]
    return fwd, bwd, "compute: 2 FLOPs per weight and token forward, twice that backward"


def _stage_of(name: str, index: dict[str, int], aliases: dict[str, str], nst: int) -> int:
    """The stage a kernel cost belongs to: its name's first two parts or first part, as
    the model's ``kernel_stages`` renames them, name a stage (a block's kernels: "h.3.*",
    "layer.3.*", "encoder.3.*"); else the inputs' and embedding's are stage 0's and the
    rest the head's."""
    head = name.split(".")
    for n in (2, 1):
        key = ".".join(head[:n])
        key = aliases.get(key, key)
        if key in index:
            return index[key]
    return 0 if head[0] in ("tokens", "inputs", "embedding", "wte", "wpe") else nst - 1


@dataclass(frozen=True)
class StageTraffic:
    """Elements each stage streams: weights in for its forward and for its backward (0: the
    stage has no backward weights), and the gradients its backward finishes (sent out)."""

    forward_in: tuple[int, ...]
    backward_in: tuple[int, ...]
    gradients_out: tuple[int, ...]


def finishing_stage(stages: list[Stage], names: tuple[str, ...]) -> int | None:
    """The stage whose backward finishes a gradient group: the last one (lowest index)
    reading all of its parameters; None if none reads them all."""
    ks = [k for k, st in enumerate(stages) if set(names) <= set(st.forward_params)]
    return min(ks) if ks else None


def stage_traffic(
    stages: list[Stage], groups: list[GradientGroup], numel: dict[str, int]
) -> StageTraffic:
    fwd = tuple(sum(numel[n] for n in st.forward_params) for st in stages)
    bwd = tuple(sum(numel[n] for n in st.backward_params) for st in stages)
    out = [0] * len(stages)
    for g in groups:
        k = finishing_stage(stages, tuple(g.names))
        if k is not None:
            out[k] += sum(numel[n] for n in g.names)
    return StageTraffic(fwd, bwd, tuple(out))


def step_work(
    traffic: StageTraffic, fwd_s: list[float], bwd_s: list[float], accum: int, word: int = 4
) -> list[tuple[float, float, float]]:
    """The (weight bytes in, compute seconds, gradient bytes out) of each stage execution
    of one step, in order: per micro-batch every stage forward, then backward in reverse;
    ``word`` bytes per element."""
    work = []
    nst = len(fwd_s)
    for _ in range(accum):
        for k in range(nst):
            work.append((word * traffic.forward_in[k], fwd_s[k], 0.0))
        for k in range(nst - 1, -1, -1):
            work.append((word * traffic.backward_in[k], bwd_s[k], word * traffic.gradients_out[k]))
    return work


def device_step(
    traffic: StageTraffic,
    fwd_s: list[float],
    bwd_s: list[float],
    accum: int,
    profile: DeviceProfile,
    depth: int,
    word: int = 4,
    spans: list[tuple[str, int, float, float]] | None = None,
) -> StepTime:
    """One device's step: the profile's streaming link (MemoryX to system; a profile
    without one streams over its host link, with that link's latency); ``word`` bytes per
    streamed element (2 in mixed precision); ``spans`` as ``simulate_step``'s."""
    if profile.streaming is not None:
        bandwidth, latency = profile.streaming.bandwidth, 0.0  # no latency published
    else:
        bandwidth, latency = profile.host.bandwidth, profile.host.latency
    work = step_work(traffic, fwd_s, bwd_s, accum, word)
    return simulate_step(work, depth, bandwidth, latency, spans=spans)


def step_events(
    spans: list[tuple[str, int, float, float]], stages: list[Stage], step_s: float, steps: int
) -> list[dict]:
    """Chrome-trace events (``simdist.device.write_chrome_trace``) of ``steps`` consecutive
    device steps from one step's ``spans`` (every step replays the same work): the stages'
    forward and backward on the compute track, weights in and gradients out on the
    communication track. Execution x of a step is micro-batch x // 2n, then stage x % 2n
    forward, or backward counting down from n (``step_work``'s order)."""
    n = len(stages)
    events = []
    for s in range(steps):
        for what, x, start, dur in spans:
            micro, k = divmod(x, 2 * n)
            phase, k = ("forward", k) if k < n else ("backward", 2 * n - 1 - k)
            name = stages[k].name if what == "compute" else f"{what} {stages[k].name}"
            events.append({
                "name": f"{name} {phase}", "track": "compute" if what == "compute" else "comm",
                "start": s * step_s + start, "dur": dur,
                "args": {"step": s, "micro_batch": micro, "stage": k},
            })  # fmt: skip
    return events


def device_compute(
    model,
    stages: list[Stage],
    profile: DeviceProfile,
    batch: int,
    half: str | None = None,
    working_set: float = 0.0,
) -> tuple:
    """``stage_compute_times`` on the profile's cost model at the run's precision (``half``:
    a mixed-precision run's format, timed at the profile's half rates where it has them).
    ``working_set``: the bytes the ranks of a node keep resident, on profiles whose memory
    efficiency is keyed by it (a CPU's shared caches: ``CostModel.working_set``)."""
    dtype, notes = compute_dtype(profile, half)
    cost = CostModel(profile, dtype, working_set)
    fwd, bwd, note = stage_compute_times(model, stages, cost, batch)
    return fwd, bwd, "; ".join([note, *notes])


def device_footprint(
    model, replicas: int, micro_batch: int, depth: int, word: int = 4
) -> dict[str, int]:
    """Bytes a weight-streaming device accounts, by entry (what the schedule allocates:
    ``prefetch_depth + 1`` weight slots of the largest stage, ``GRADIENT_SLOTS`` slots of the
    largest shared gradient group, the held groups, the activation arena and, with several
    devices, the reduce-scatter's scratch), at ``word`` bytes per weight, gradient and
    activation element; nothing is allocated here."""
    from simdist.comm.p2p import DEPTH, SEGMENT

    numel = {s.name: s.numel for s in model.parameter_specs()}
    groups = model.gradient_groups()
    traffic = stage_traffic(model.stages(), groups, numel)
    sizes = [(sum(numel[n] for n in g.names), g.held) for g in groups]
    out = {
        "window.weights": word * (depth + 1) * max(traffic.forward_in + traffic.backward_in),
        "window.gradients": word * GRADIENT_SLOTS * max((n for n, h in sizes if not h), default=0),
        "window.held_gradients": word * sum(n for n, h in sizes if h),
        "model.arena": int(model.activation_bytes(micro_batch)) * word // 4,
    }
    if replicas > 1:
        out["collectives.scratch"] = 4 * DEPTH * SEGMENT
    return out


# the device memory category of each footprint entry (as the schedule reserves them)
FOOTPRINT_CATEGORY = {
    "window.weights": "streaming_window",
    "window.gradients": "streaming_window",
    "window.held_gradients": "streaming_window",
    "model.arena": "activations",
    "collectives.scratch": "workspace",
}
