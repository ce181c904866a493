"""One pipeline-parallel step on the simulated device: the run's estimate and plan mode's.

``simdist.schedules.pipeline`` (a run, rank 0, on its live model) and ``python -m
simdist.plan --pp P`` (on a model built from the shapes) both call ``pipeline_step`` with
the same stage split (``StagePlan``), so their step times agree by construction
(``tests/test_simulate.py``'s pipeline rows: rel 1e-9). What a step is, for replica 0 (all
replicas run the same ops at the same simulated times):

* the forward/backward phase: each op of ``schedule_ops`` on its stage, a stage's forward
  and backward per micro-batch from the model's kernel costs summed over the stage's model
  stages (``simdist.sim.streaming_step.stage_compute_times``), an op starting when its
  stage is free and its input has arrived over the link (latency + bytes x beta); ZeRO-3
  adds each model stage's parameter all-gathers before it computes, in the order the run's
  window cache issues them (``simdist.param_gather``, replayed per stage in its schedule
  order from empty windows, as the run starts every step);
* each stage's gradient sync over its D replicas as soon as its own last backward is done:
  ZeRO-0 reduce-scatter + all-gather of the stage's range cut at the slice boundaries,
  ZeRO-1 the reduce-scatter; ZeRO-2 (and 3) reduce-scatters every micro-batch right after its
  backward, placed on the stage after that op (serial with the stage's compute: the run
  issues it blocking);
* the loop's agreement (3 float64 values over every rank), then each stage's optimizer
  pass over the range it updates (AdamW 14 FLOPs and 28 bytes an element, SGD 6 and 20),
  ZeRO-1/2's parameter all-gather, and the tied embedding's new value sent from the first
  to the last stage (ZeRO-3: replica 0's slice of its gradient group). The step ends
  when the slowest stage is done.

ZeRO-0/1 with several micro-batches add each backward's gradients into the stage's sum (one
elementwise pass on the backward op; the first micro-batch's a copy); after its gradient
sync each stage adds its part of the norm's float64 sum of squares, in flat order, passing
its float64 lanes to the next stage (the agreement starts when the last stage has the sum).

Left out (host work a plan cannot know): input fetch and the loop's Python; a run adds its
measured host time to the estimate.

``stage_memory`` is the bytes a stage's rank accounts (what the run's ``_allocate``
allocates, by category), so plan mode reports the run's memory per rank too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simdist.arena import Layout
from simdist.config import ConfigError
from simdist.device import CostModel, DeviceProfile
from simdist.device.collective import CollectiveCall, Network, collective_seconds
from simdist.device.profile import ProfileError
from simdist.kernels.optim import LANES
from simdist.param_gather import BACKWARD, FORWARD, GatherPlan, WindowCache, stage_gathers
from simdist.sim.step import compute_dtype

AGREEMENT_VALUES = 3  # the loop's per-step check: sum of squares, loss, stop signal


def schedule_ops(kind: str, stages: int, stage: int, micro: int) -> list[tuple[str, int]]:
    """("F" | "B", micro-batch) in the order stage ``stage`` of ``stages`` runs them.

    GPipe: every forward, then every backward. 1F1B (PipeDream-Flush, Megatron's default):
    ``stages - stage - 1`` warm-up forwards, then one forward and one backward alternately,
    then the remaining backwards; at most ``stages - stage`` micro-batches are in flight.
    Backwards run in micro-batch order on every stage in both."""
    if kind == "gpipe":
        return [("F", j) for j in range(micro)] + [("B", j) for j in range(micro)]
    warm = min(stages - stage - 1, micro)
    ops = [("F", j) for j in range(warm)]
    for i in range(micro - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", j) for j in range(micro - warm, micro)]


def slots_needed(kind: str, stages: int, stage: int, micro: int) -> int:
    """Micro-batches in flight at once on ``stage``: one activation arena each."""
    return micro if kind == "gpipe" else min(stages - stage, micro)


def split_stages(costs: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of ``costs`` into ``parts`` non-empty pieces minimising
    the largest piece's sum (ties: the earliest cut)."""
    n = len(costs)
    prefix = np.concatenate([[0], np.cumsum(costs, dtype=np.int64)])
    inf = np.iinfo(np.int64).max
    best = np.full((parts + 1, n + 1), inf, np.int64)  # best[p][i]: first i into p parts
    cut = np.zeros((parts + 1, n + 1), np.int64)
    best[0][0] = 0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                if best[p - 1][j] == inf:
                    continue
                v = max(best[p - 1][j], prefix[i] - prefix[j])
                if v < best[p][i]:
                    best[p][i], cut[p][i] = v, j
    out, i = [], n
    for p in range(parts, 0, -1):
        j = int(cut[p][i])
        out.append((j, i))
        i = j
    return out[::-1]


class StagePlan:
    """Which model stages, parameters and flat range each pipeline stage owns."""

    def __init__(self, model, layout: Layout, P: int):
        stages = model.stages()
        numel = {s.name: s.numel for s in layout.specs}
        if P > len(stages):
            raise ConfigError(
                f"runconfig.pipeline_parallel={P} exceeds the {len(stages)} stages of model "
                f"{model.name!r} ({', '.join(s.name for s in stages)}): give at most "
                f"{len(stages)}",
                "runconfig.pipeline_parallel",
            )

        def names(st) -> list[str]:
            return list(dict.fromkeys((*st.forward_params, *st.backward_params)))

        # balance compute where the model counts it per stage, else parameters
        if hasattr(model, "stage_flops"):
            costs = list(model.stage_flops())
        else:
            costs = [sum(numel[n] for n in names(st)) for st in stages]
        self.ranges = split_stages(costs, P)
        self.stage_names = [[stages[k].name for k in range(a, b)] for a, b in self.ranges]
        owner: dict[str, int] = {}
        self.reads: list[list[str]] = []
        for s, (a, b) in enumerate(self.ranges):
            read = list(dict.fromkeys(n for k in range(a, b) for n in names(stages[k])))
            self.reads.append(read)
            for n in read:
                owner.setdefault(n, s)
        self.owner = owner
        # tied: (name, owner stage, reading stage) for each copy a later stage keeps
        self.tied = [
            (n, owner[n], s) for s, read in enumerate(self.reads) for n in read if owner[n] != s
        ]
        for name, own, user in self.tied:
            if user != P - 1 or own != 0:
                raise ConfigError(
                    f"model {model.name!r}: parameter {name!r} is read by pipeline stages "
                    f"{own} and {user}; only the first and last stage may share one (a tied "
                    "embedding)",
                    "runconfig.pipeline_parallel",
                )
        # flat ranges: the owned parameters of each stage must follow one another
        self.flat: list[tuple[int, int]] = []
        at = 0
        for s in range(P):
            mine = sorted((layout.offsets[n], n) for n in owner if owner[n] == s)
            if not mine or mine[0][0] != at:
                raise ConfigError(
                    f"model {model.name!r}: the parameters of pipeline stage {s} are not the "
                    "next range of its flat layout; it cannot be pipelined",
                    "runconfig.pipeline_parallel",
                )
            for off, n in mine:
                if off != at:
                    raise ConfigError(
                        f"model {model.name!r}: parameter {n!r} breaks stage {s}'s flat range",
                        "runconfig.pipeline_parallel",
                    )
                at += numel[n]
            self.flat.append((mine[0][0], at))
        self.flat[-1] = (self.flat[-1][0], layout.padded)  # the padding goes with the last
        self.params = [sum(numel[n] for n in owner if owner[n] == s) for s in range(P)]

    def describe(self) -> str:
        return "; ".join(
            f"stage {s}: {' '.join(self.stage_names[s])} ({self.params[s]:,} parameters)"
            for s in range(len(self.ranges))
        )


@dataclass
class Op:
    """One forward or backward of a micro-batch on a stage, on the simulated clock; its
    input arrived at ``arrived`` (sent at ``sent``: the op it depends on ended then)."""

    stage: int
    op: str  # "F" | "B"
    micro: int
    start: float
    end: float
    sent: float | None = None  # None: no input message (first stage's F, last stage's B)
    arrived: float | None = None
    # ZeRO-3: (what, start, duration) of the op's parts in order, "gather" (one parameter
    # all-gather) or "compute" (one model stage); empty: the op computes throughout
    segments: list[tuple[str, float, float]] = field(default_factory=list)


Segments = Callable[[str, int, int], list[tuple[str, float]]]


def pipeline_ops(
    kind: str,
    fwd: list[float],
    bwd: list[float],
    micro: int,
    send: list[float],
    send_back: list[float] | None = None,
    segments: Segments | None = None,
) -> list[Op]:
    """The schedule on the simulated device: stage s takes ``fwd[s]`` / ``bwd[s]`` seconds
    per micro-batch, a message across boundary s -> s + 1 ``send[s]`` (back, s + 1 -> s:
    ``send_back[s]``, default the same); each op starts when its stage is free and its
    input has arrived. ``segments(op, s, j)``, where given, replaces the op's cost by its
    parts ("gather" | "compute", seconds), asked for in each stage's schedule order (ZeRO-3:
    its gathers follow the window cache). Ops in the order placed."""
    back = send if send_back is None else send_back
    P = len(fwd)
    ops = [schedule_ops(kind, P, s, micro) for s in range(P)]
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * P, [0.0] * P
    out: list[Op] = []
    left = sum(len(o) for o in ops)
    while left:
        moved = False
        for s in range(P):
            while pos[s] < len(ops[s]):
                op, j = ops[s][pos[s]]
                if op == "F":
                    dep = None if s == 0 else ("F", s - 1, j)
                    wire, cost = (send[s - 1] if s else 0.0), fwd[s]
                else:
                    dep = None if s == P - 1 else ("B", s + 1, j)
                    wire, cost = (back[s] if s < P - 1 else 0.0), bwd[s]
                if dep is not None and dep not in done:
                    break
                sent = None if dep is None else done[dep]
                ready = 0.0 if sent is None else sent + wire
                start = max(free[s], ready)
                parts: list[tuple[str, float, float]] = []
                if segments is not None:
                    at = start
                    for what, dur in segments(op, s, j):
                        parts.append((what, at, dur))
                        at += dur
                    cost = at - start
                free[s] = done[(op, s, j)] = start + cost
                out.append(
                    Op(s, op, j, start, free[s], sent, None if sent is None else sent + wire, parts)
                )
                pos[s] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"{kind} schedule cannot proceed: {pos}")
    return out


def simulate_pipeline(
    kind: str, fwd: list[float], bwd: list[float], micro: int, send: list[float]
) -> tuple[float, list[float]]:
    """(makespan, busy seconds per stage) of ``pipeline_ops``; with equal stages and free
    sends the idle share is exactly (P - 1) / (m + P - 1)."""
    ops = pipeline_ops(kind, fwd, bwd, micro, send)
    return max(o.end for o in ops), [micro * (f + b) for f, b in zip(fwd, bwd, strict=True)]


def boundary_bytes(model: Any, k: int, batch: int) -> tuple[int, int]:
    """Bytes a pipeline sends across the boundary before model stage ``k`` per micro-batch
    of ``batch``: (forward: ``stage_input(k)``, backward: ``stage_input_grad(k)``), from the
    model's shapes (nothing allocated; ``tests/test_pipeline.py`` checks them against a
    run's sends). FC-MNIST: layer k - 1's output both ways; a model that counts them
    itself (BERT): its ``boundary_numel``; GPT-2: the embedding's output
    before block 0, else the previous block's res2 and MLP output, and one residual-stream
    gradient back."""
    if hasattr(model, "sizes"):  # fc_mnist
        n = 4 * batch * int(model.sizes[k])
        return n, n
    if hasattr(model, "boundary_numel"):  # BERT: one hidden state each way
        f, b = model.boundary_numel(k)
        return 4 * batch * f, 4 * batch * b
    cfg = model.config  # a GPT-2 layout
    stream = 4 * batch * cfg.block_size * cfg.n_embd
    if getattr(model, "sequence_parallel", False):  # weight mode: this shard's token rows
        stream //= model.tp
    return (stream if k == 1 else 2 * stream), stream


def link_seconds(profile: DeviceProfile, link_class: str, nbytes: int) -> float:
    """One point-to-point message over the profile's link (0 where it publishes none)."""
    link = profile.link(link_class)
    return link.latency + nbytes * link.beta_at(nbytes) if link.known else 0.0


@dataclass
class PipelineStep:
    """One simulated step of a pipeline (replica 0's ranks; seconds)."""

    ops: list[Op]
    forward_backward_s: float  # the schedule's makespan
    bubble_fraction: float
    stage_compute_s: list[float]  # per stage: forward + backward of one micro-batch
    send_s: list[float]  # per boundary: one forward message
    send_back_s: list[float]  # per boundary: one backward message
    sync_s: list[float]  # per stage: its gradient collectives (ZeRO-2: all micro-batches)
    step_check_s: float
    optimizer_s: list[float]
    gather_s: list[float]  # ZeRO-1/2's parameter all-gather
    tied_s: float  # the tied embedding's new value, first -> last stage
    step_s: float
    # ZeRO-3, per stage: the parameter all-gathers of a step (count, seconds)
    param_gathers: list[int] = field(default_factory=list)
    param_gather_s: list[float] = field(default_factory=list)
    # weight mode, per stage: the group's collectives of one micro-batch's F and B
    group_s: list[float] = field(default_factory=list)
    # per stage: (name, start, duration, track) of the events after the forward/backward
    tail: list[list[tuple[str, float, float, str]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def breakdown(self) -> dict[str, float]:
        sync_end = max(self.tail_end("gradient sync"))
        fb = self.forward_backward_s
        norm_end = max(self.tail_end("gradient norm"))
        return {
            "forward_backward": fb,
            "gradient_sync_exposed": sync_end - fb,
            "gradient_norm": norm_end - sync_end,
            "step_check": self.step_check_s,
            "update": self.step_s - norm_end - self.step_check_s,
        }

    def tail_end(self, name: str) -> list[float]:
        """Per stage: when its event ``name`` ended (its forward/backward end if none)."""
        out = []
        for s, events in enumerate(self.tail):
            ends = [a + d for n, a, d, _ in events if n == name]
            stage_end = max(o.end for o in self.ops if o.stage == s)
            out.append(max(ends) if ends else stage_end)
        return out


def _group_seconds(cost: CostModel, c: Any, notes: list[str]) -> float:
    """One of a weight-mode group's collectives (``tp_schedule.Coll``) on its one node."""
    T = len(c.blocks)
    try:
        return collective_seconds(cost, Network(T, 0, "intra", (tuple(range(T)),)), c.call)
    except ProfileError as err:
        notes.append(f"communication not modelled: {err}")
        return 0.0


def _blocks(bounds: np.ndarray, elem: int = 4) -> tuple[int, ...]:
    return tuple(int(x) for x in elem * np.diff(bounds))


def pipeline_step(
    model: Any,
    profile: DeviceProfile,
    plan: Any,
    *,
    kind: str,
    micro: int,
    micro_batch: int,
    replicas: int,
    zero: int,
    optimizer_type: str,
    algorithm: str,
    link_class: str,
    half: str | None = None,
    half_gradients: bool = True,
    group: dict[str, list[list[Any]]] | None = None,
    working_set: float = 0.0,
) -> PipelineStep:
    """The step described in the module docstring. ``plan``: the run's ``StagePlan``;
    ``replicas``: D x T (the stage groups' size); ``algorithm``: the gradient collectives'
    resolved algorithm; ``link_class``: intra or inter (sends and collectives). ``half``: a
    mixed-precision run's format: kernels at the profile's half rates, activations,
    weights and (``half_gradients``: unless ``fp32_allreduce``) gradients at 2 bytes on
    every link, as the device holds them. ``group``: tensor-parallel weight mode, the
    group's collectives per phase and model stage (``tp_schedule.stage_group_calls``),
    each run blocking after its model stage's kernels, over the group's node.
    ``working_set``: the bytes the ranks of a node keep resident (every stage's model states
    and activations), which keys the memory efficiency of a CPU profile's kernels, as in
    data parallelism's step (``CostModel.working_set``)."""
    from .streaming_step import device_compute

    P = len(plan.ranges)
    elem = 2 if half else 4  # bytes of an activation or weight on the device
    gelem = 2 if half and half_gradients else 4  # of a gradient in its collectives
    f, b, note = device_compute(model, model.stages(), profile, micro_batch, half, working_set)
    fwd = [sum(f[k0:k1]) for k0, k1 in plan.ranges]
    bwd = [sum(b[k0:k1]) for k0, k1 in plan.ranges]
    sizes = [
        (f_b * elem // 4, b_b * elem // 4)
        for f_b, b_b in (boundary_bytes(model, k0, micro_batch) for k0, _ in plan.ranges[1:])
    ]
    send = [link_seconds(profile, link_class, f_b) for f_b, _ in sizes]
    back = [link_seconds(profile, link_class, b_b) for _, b_b in sizes]
    notes = [note]
    cost = CostModel(profile, compute_dtype(profile, half)[0], working_set)
    layout = Layout(model.parameter_specs(), replicas)
    D = replicas

    def coll(op: str, blocks: tuple[int, ...], world: int, alg: str) -> float:
        if world == 1:
            return 0.0
        nodes = (
            (tuple(range(world)),) if link_class == "intra" else tuple((r,) for r in range(world))
        )
        try:
            return collective_seconds(
                cost, Network(world, 0, link_class, nodes), CollectiveCall(op, alg, blocks)
            )
        except ProfileError as err:
            notes.append(f"communication not modelled: {err}")
            return 0.0

    def vector(flops: float, nbytes: float) -> float:
        try:
            return cost.compute_time(flops, nbytes, "vector", "fp32")
        except ProfileError as err:
            notes.append(f"compute not modelled: {err}")
            return 0.0

    segments, gathers = None, [0] * P
    gather_s = [0.0] * P
    plans: list[GatherPlan] | None = None
    if zero == 3:  # each op gathers its model stages' parameters, as the run's window cache
        plans = [
            GatherPlan(layout, model.stages()[k0:k1], model.gradient_groups())
            for k0, k1 in plan.ranges
        ]
        caches = [WindowCache(g) for g in plans]  # empty at the start of the step
    # weight mode: seconds of the group's collectives per phase and model stage
    tp_s: dict[str, list[float]] = {FORWARD: [0.0] * len(f), BACKWARD: [0.0] * len(b)}
    if group is not None:
        for phase, per_stage in group.items():
            tp_s[phase] = [sum(_group_seconds(cost, c, notes) for c in st) for st in per_stage]
        notes.append(
            "tensor parallel (weight mode): each model stage's group collectives run "
            "blocking after its kernels, over the group's node"
        )
    # ZeRO-0/1: each backward's gradients are added into the stage's sum (the first copied:
    # 2 of the add's 3 streams); part of every B op, after its model stages
    accumulate = [0.0] * P
    if zero < 2 and micro > 1:
        for s, (a, bb) in enumerate(plan.flat):
            n = bb - a
            accumulate[s] = vector(n * (micro - 1) / micro, elem * n * (3 * micro - 1) / micro)
            bwd[s] += accumulate[s]
    if plans is not None or group is not None:

        def segments(op: str, s: int, j: int) -> list[tuple[str, float]]:
            k0, k1 = plan.ranges[s]
            order = range(k0, k1) if op == "F" else range(k1 - 1, k0 - 1, -1)
            phase, times = (FORWARD, f) if op == "F" else (BACKWARD, b)
            out: list[tuple[str, float]] = []
            for k in order:
                if plans is not None:
                    for g in stage_gathers(plans[s], caches[s], k - k0, phase, True)[1]:
                        blocks = _blocks(plans[s].block_bounds(g.group), elem)
                        t = coll("allgather", blocks, D, algorithm)
                        out.append(("gather", t))
                        gathers[s] += 1
                        gather_s[s] += t
                out.append(("compute", times[k]))
                if tp_s[phase][k] > 0:
                    out.append(("group", tp_s[phase][k]))
            if op == "B" and accumulate[s] > 0:
                out.append(("compute", accumulate[s]))
            return out

    if zero == 3:
        notes.append(
            "ZeRO-3: each op's parameter all-gathers run blocking before the model stage "
            "that reads them, in the run's window-cache order"
        )
    ops = pipeline_ops(kind, fwd, bwd, micro, send, back, segments)
    span = max(o.end for o in ops)
    # per stage and micro-batch: the group's collectives (weight mode), busy as the kernels
    group_s = [sum(tp_s[FORWARD][k0:k1]) + sum(tp_s[BACKWARD][k0:k1]) for k0, k1 in plan.ranges]
    busy = [micro * (x + y + g) for x, y, g in zip(fwd, bwd, group_s, strict=True)]

    tail: list[list[tuple[str, float, float, str]]] = []
    sync, opt, gather, stage_end = [], [], [], []
    per_flop, per_byte = (14.0, 28.0) if optimizer_type == "adamw" else (6.0, 20.0)
    for s in range(P):
        a, bb = plan.flat[s]
        bounds = np.clip(layout.bounds - a, 0, bb - a)
        blocks = _blocks(bounds, gelem)  # the gradients' collectives
        rs = coll("reduce_scatter", blocks, D, algorithm)
        events: list[tuple[str, float, float, str]] = []
        end = max(o.end for o in ops if o.stage == s)
        if zero >= 2:  # after each backward, blocking: the stage's later ops wait for it
            shift = 0.0
            for o in [o for o in ops if o.stage == s]:
                o.start, o.end = o.start + shift, o.end + shift
                o.segments = [(w, a0 + shift, d0) for w, a0, d0 in o.segments]
                if o.op == "B" and rs > 0:
                    events.append(("gradient sync", o.end, rs, "comm"))
                    shift += rs
            end += shift
            sync.append(micro * rs)
        else:
            t = rs + (coll("allgather", blocks, D, algorithm) if zero == 0 else 0.0)
            if t > 0:
                events.append(("gradient sync", end, t, "comm"))
            end += t
            sync.append(t)
        stage_end.append(end)
        n = int(bounds[1] - bounds[0]) if zero >= 1 else bb - a  # the range it updates
        opt.append(vector(per_flop * n, per_byte * n))
        pblocks = _blocks(bounds, elem)  # the updated parameters' gather
        gather.append(coll("allgather", pblocks, D, algorithm) if zero in (1, 2) else 0.0)
        tail.append(events)
    if zero >= 2:  # ZeRO-2/3 shifted the ops; the makespan follows
        span = max(o.end for o in ops)
    # the norm's sum of squares: each stage's float64 lanes over the part it counts, passed
    # on to the next stage (blocking, in flat order: the one-piece sum's bits)
    sq_dtype = "fp64" if "fp64" in profile.scalar_flops else None
    hop = link_seconds(profile, link_class, 8 * LANES)  # the float64 lanes
    relay = 0.0
    for s in range(P):
        a, bb = plan.flat[s]
        bounds = np.clip(layout.bounds - a, 0, bb - a)
        n = float(bounds[1] - bounds[0])
        try:
            t_sq = cost.compute_time(2 * n, 4 * n, "vector", sq_dtype, serial_flops=2 * n)
        except ProfileError as err:
            notes.append(f"compute not modelled: {err}")
            t_sq = 0.0
        start = max(stage_end[s], relay + hop if s > 0 else 0.0)
        tail[s].append(("gradient norm", start, t_sq, "compute"))
        relay = start + t_sq
    check = coll("allreduce_scalars", (8 * AGREEMENT_VALUES,) * (D * P), D * P, "native")
    t_check = relay  # the last stage holds the sum once every stage has added its part
    t_upd = t_check + check
    ends = []
    for s in range(P):
        tail[s].append(("step check", t_check, check, "comm"))
        tail[s].append(("optimizer", t_upd, opt[s], "compute"))
        if gather[s] > 0:
            tail[s].append(("params.allgather", t_upd + opt[s], gather[s], "comm"))
        ends.append(t_upd + opt[s] + gather[s])
    numel = {sp.name: sp.numel for sp in layout.specs}
    tied_bytes = sum(elem * numel[n] for n, _, _ in plan.tied)
    if zero == 3:  # replica 0's slice of each tied group
        tied_bytes = elem * sum(hi - lo for lo, hi in tied_group_slices(model, layout, plan, 0))
    tied = link_seconds(profile, link_class, tied_bytes) if tied_bytes else 0.0
    if tied > 0:  # the owner (stage 0) sends once it has updated; the copy receives
        t0 = ends[0]
        tail[0].append(("send tied parameters", t0, tied, "comm"))
        tail[P - 1].append(("recv tied parameters", t0, tied, "comm"))
        ends[P - 1] = max(ends[P - 1], t0 + tied)
    step = max(ends)
    return PipelineStep(
        ops=ops,
        forward_backward_s=span,
        bubble_fraction=1.0 - sum(busy) / (P * span) if span > 0 else 0.0,
        stage_compute_s=[x + y for x, y in zip(fwd, bwd, strict=True)],
        send_s=send,
        send_back_s=back,
        sync_s=sync,
        step_check_s=check,
        optimizer_s=opt,
        gather_s=gather,
        tied_s=tied,
        step_s=step,
        param_gathers=gathers,
        param_gather_s=gather_s,
        group_s=group_s,
        tail=tail,
        notes=notes,
    )


def tied_group_slices(model: Any, layout: Layout, plan: Any, replica: int) -> list[tuple[int, int]]:
    """ZeRO-3: the flat ranges [lo, hi) of the tied gradient groups (each group holding a
    tied parameter, once) in ``replica``'s slice: what stage 0 sends to the last stage
    after an update, and what the last stage keeps (``Pipeline._allocate_gathers``)."""
    groups = [tuple(g.names) for g in model.gradient_groups()]
    tied = {n for n, _, _ in plan.tied}
    lo_d, hi_d = int(layout.bounds[replica]), int(layout.bounds[replica + 1])
    out = []
    for names in groups:
        if tied & set(names):
            ga = layout.offsets[names[0]]
            gb = ga + sum(sp.numel for sp in layout.specs if sp.name in set(names))
            lo = max(ga, lo_d)
            out.append((lo, max(lo, min(gb, hi_d))))
    return out


def stage_memory(
    model: Any,
    layout: Layout,
    plan: Any,
    stage: int,
    *,
    kind: str,
    micro: int,
    micro_batch: int,
    zero: int,
    replica: int = 0,
    optimizer_type: str = "adamw",
    elem: int = 4,
) -> dict[str, int]:
    """Bytes the rank of ``stage`` (of replica ``replica``) accounts, by category: what
    ``Pipeline._allocate`` allocates (its flat range of parameters, ZeRO-3: its slice of
    it, the tied groups' slices and two gather windows; gradients, ZeRO-2/3's slice and
    micro-batch bucket, optimizer state over the range it updates, the tied copies and
    their gradient buffers, one activation arena per micro-batch in flight). ``elem``: bytes
    of a weight, gradient and activation (2 in mixed precision, whose optimizer state also
    holds the fp32 master)."""
    a, b = plan.flat[stage]
    P = len(plan.ranges)
    bounds = np.clip(layout.bounds - a, 0, b - a)
    own = int(bounds[replica + 1] - bounds[replica])
    numel = {sp.name: sp.numel for sp in layout.specs}
    copies = sum(numel[n] for n, _, user in plan.tied if user == stage)
    users = sum(numel[n] for n, own_s, _ in plan.tied if own_s == stage)
    nslots = slots_needed(kind, P, stage, micro)
    out = {"parameters": elem * ((b - a) + copies), "gradients": 0, "buckets": 0}
    if zero == 3:  # its slice, its slices of tied groups (last stage) and two windows
        k0, k1 = plan.ranges[stage]
        window = GatherPlan(layout, model.stages()[k0:k1], model.gradient_groups()).window
        tied = sum(hi - lo for lo, hi in tied_group_slices(model, layout, plan, replica))
        out["parameters"] = elem * (own + (tied if copies else 0) + 2 * window)
    if zero >= 2:
        out["gradients"] = elem * own
        out["buckets"] = elem * (b - a)
    else:
        out["gradients"] = elem * ((b - a) + ((b - a) if micro > 1 else 0))
    out["gradients"] += elem * (2 * copies + nslots * users)
    updated = own if zero >= 1 else b - a
    states = (2 if optimizer_type == "adamw" else 1) + (1 if elem == 2 else 0)  # + master
    out["optimizer_state"] = 4 * updated * states
    out["activations"] = nslots * int(model.activation_bytes(micro_batch)) * elem // 4
    return {k: v for k, v in out.items() if v}  # as DeviceAllocator.bytes lists them


def pipeline_trace(
    step: PipelineStep, P: int, T: int, world: int, steps: int
) -> list[list[dict[str, Any]]]:
    """Chrome-trace events (``simdist.device.write_chrome_trace``) of ``steps`` simulated
    steps, one list per world rank (rank r is stage (r // T) % P; every replica runs its
    stage's ops at the same simulated times): each forward and backward per micro-batch
    on the compute track, each activation / gradient send and receive on the
    communication track, then the gradient sync, agreement and update."""
    per_stage: list[list[dict[str, Any]]] = [[] for _ in range(P)]

    def ev(s: int, name: str, start: float, dur: float, track: str, cat: str, **args: Any):
        per_stage[s].append(
            {"name": name, "cat": cat, "track": track, "start": start, "dur": dur, "args": args}
        )

    for k in range(steps):
        t0 = k * step.step_s
        for o in step.ops:
            what = "forward" if o.op == "F" else "backward"
            # ZeRO-3: the op's parameter gathers on the communication track, its model
            # stages' compute between them; else one compute event
            for part, start, dur in o.segments or [("compute", o.start, o.end - o.start)]:
                if part == "gather":
                    ev(o.stage, "params.allgather", t0 + start, dur, "comm", "gather",
                       phase=what, micro_batch=o.micro, step=k + 1)  # fmt: skip
                    continue
                if part == "group":  # weight mode: a model stage's group collectives
                    ev(o.stage, f"{what}.group_collectives", t0 + start, dur, "comm", "tp",
                       micro_batch=o.micro, step=k + 1)  # fmt: skip
                    continue
                ev(o.stage, f"{o.op}{o.micro}", t0 + start, dur, "compute", what,
                   stage=o.stage, micro_batch=o.micro, step=k + 1)  # fmt: skip
            if o.sent is None or o.arrived is None:
                continue
            src = o.stage - 1 if o.op == "F" else o.stage + 1
            msg = "activations" if o.op == "F" else "activation gradients"
            ev(src, f"send {msg} {o.micro} -> stage {o.stage}", t0 + o.sent,
               o.arrived - o.sent, "comm", "send", micro_batch=o.micro, step=k + 1)  # fmt: skip
            ev(o.stage, f"recv {msg} {o.micro} <- stage {src}", t0 + o.sent,
               o.arrived - o.sent, "comm", "recv", micro_batch=o.micro, step=k + 1)  # fmt: skip
        for s, events in enumerate(step.tail):
            for name, start, dur, track in events:
                ev(s, name, t0 + start, dur, track, name.split(" ")[0], step=k + 1)
    return [per_stage[(r // T) % P] for r in range(world)]
