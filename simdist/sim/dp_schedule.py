"""The events of one data-parallel / ZeRO 0-3 step, predicted from a model's shapes.

What ``simdist.train``'s loop records on a rank (``simdist.sim.rank``'s hooks) when it runs
``GradientSync`` at ``zero_opt_level`` 0, 1, 2 or 3, written down from the shapes alone so that
plan mode can hand the same list to the same ``StepModel`` a run uses. Per micro-batch: the
input fetch, forward, backward (ZeRO-2/3: one reduce-scatter per gradient group, in the
order the backward finishes them, each over the group's range cut at the ZeRO slice
boundaries; ZeRO-3: the parameter all-gathers of every stage, forward and backward, as
``simdist.param_gather``'s window cache issues them, replayed on the same object the run
uses), gradient accumulation. Then the sync (level 0: the all-reduce of the whole padded buffer;
level 1: its reduce-scatter to the slices), the loop's per-step agreement (3 float64 values,
``allreduce_scalars``), clipping, the optimizer over the range this rank updates, and the
parameter all-gather (levels 1 and 2; level 3 has none: the next step's stages gather).
Measured intervals are zero: a plan has no host time.

``tests/test_simulate.py`` runs the same configurations and checks that the run's simulated
step time equals the plan's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from simdist.arena import Layout
from simdist.comm.partition import partition
from simdist.param_gather import BACKWARD, FORWARD, GatherPlan, WindowCache, stage_gathers

from .step import Coll, Span

AGREEMENT_VALUES = 3  # the loop's per-step check: sum of squares, loss, stop signal (float64)


def _blocks(bounds: np.ndarray, elem: int = 4) -> tuple[int, ...]:
    return tuple(int(x) for x in elem * np.diff(bounds))


def _coll(op: str, algorithm: str, blocks: tuple[int, ...], staged: bool, phase: str | None):
    return Coll(op, algorithm, blocks, staged, phase, 0.0, 0.0)


def group_reduce_scatters(
    layout: Layout, model: Any, micro_batch: int, seq: int | None, elem: int = 4
):
    """ZeRO-2's reduce-scatter blocks, one per gradient group, in the backward's order."""
    ranges = {}
    for g in model.gradient_groups():
        a = layout.offsets[g.names[0]]
        b = a + sum(s.numel for s in layout.specs if s.name in set(g.names))
        ranges[g.names[0]] = (a, b)
    first_of = {n: g.names[0] for g in model.gradient_groups() for n in g.names}
    out = []
    for k in model.kernel_costs(micro_batch, seq):
        if k.phase == "backward" and k.done:
            a, b = ranges[first_of[k.done[0]]]
            out.append(_blocks(np.clip(layout.bounds - a, 0, b - a), elem))
    return out


def dp_step_events(
    model: Any,
    *,
    world: int,
    level: int,
    micro_batch: int,
    seq: int | None,
    accum: int = 1,
    optimizer_type: str = "adamw",
    algorithm: str = "ring",
    staged: bool = False,
    clip_scales: bool = False,
    grad_bytes: int = 4,
    param_bytes: int = 4,
) -> list[Span | Coll]:
    """One step of rank 0 as the run records it (see the module docstring).

    ``model``: anything with ``parameter_specs``, ``gradient_groups`` and ``kernel_costs``
    (a simdist model built from its config; nothing is allocated). ``clip_scales``: the
    gradient norm exceeds ``max_gradient_norm`` this step, so clipping scales the gradients
    (data-dependent: a run decides it per step). ``grad_bytes`` / ``param_bytes``: bytes
    per element of the gradient collectives and of the parameter all-gather (2 in mixed
    precision's half-precision wire)."""
    if level not in (0, 1, 2, 3):
        raise ValueError(f"zero level must be 0, 1, 2 or 3 for a simdist step, got {level}")
    layout = Layout(model.parameter_specs(), world)
    padded, bounds = layout.padded, layout.bounds
    group_rs = (
        group_reduce_scatters(layout, model, micro_batch, seq, grad_bytes) if level >= 2 else []
    )
    if level == 3:
        plan = GatherPlan(layout, model.stages(), model.gradient_groups())
        cache = WindowCache(plan)  # empty at the start of every step, as in the run
    n_stages = len(plan.stages) if level == 3 else 0

    def gathers(phase: str, order) -> list[Coll]:
        out = []
        for k in order:
            for g in stage_gathers(plan, cache, k, phase, True)[1]:
                blocks = _blocks(plan.block_bounds(g.group), param_bytes)
                out.append(_coll("allgather", algorithm, blocks, staged, phase))
        return out

    events: list[Span | Coll] = []
    for micro in range(accum):
        events.append(Span("input", 0.0, 0.0, {}))
        if level == 3:
            events += gathers(FORWARD, range(n_stages))
        events.append(Span("forward", 0.0, 0.0, {"shape": (micro_batch, seq)}))
        if level == 3:
            events += gathers(BACKWARD, range(n_stages - 1, -1, -1))
        for blocks in group_rs:
            events.append(_coll("reduce_scatter", algorithm, blocks, staged, "backward"))
        events.append(Span("backward", 0.0, 0.0, {}))
        held_apart = level < 2 and accum > 1  # micro-batch gradients, added into the sum
        info = {"elements": padded, "first": micro == 0} if held_apart else {}
        events.append(Span("accumulate", 0.0, 0.0, info))
    sumsq = False
    if level == 0:
        events.append(
            _coll(
                "allreduce",
                algorithm,
                _blocks(partition(padded, world), grad_bytes),
                staged,
                "sync",
            )
        )
        sumsq = bool(np.array_equal(partition(padded, world), bounds))
    elif level == 1:
        events.append(
            _coll("reduce_scatter", algorithm, _blocks(bounds, grad_bytes), staged, "sync")
        )
    events.append(Span("sync", 0.0, 0.0, {"sumsq": sumsq}))
    scalars = (8 * AGREEMENT_VALUES,) * world
    events.append(_coll("allreduce_scalars", "native", scalars, False, None))
    events.append(Span("clip", 0.0, 0.0, {"norm": False}))
    updated = layout.shard_size if level > 0 else padded
    info = {"elements": updated, "type": optimizer_type, "scaled": clip_scales}
    events.append(Span("optimizer", 0.0, 0.0, info))  # clipping's scale in the update's pass
    if level in (1, 2):
        events.append(_coll("allgather", algorithm, _blocks(bounds, param_bytes), staged, "gather"))
    events.append(Span("gather", 0.0, 0.0, {}))
    return events


__all__ = ["AGREEMENT_VALUES", "dp_step_events", "group_reduce_scatters"]
