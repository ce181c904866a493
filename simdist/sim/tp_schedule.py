"""The events of one tensor-parallel weight-mode step, predicted from a model's shapes.

What a ``runconfig.tensor_parallel_mode: weight`` run (``simdist.schedules.tensor_parallel``)
records on rank 0 of its T x D ranks, written down from the shapes so that plan mode can
hand the same list to the same ``StepModel`` the run uses: data parallelism's step over the
D replicas on the shard's flat layout (``dp_step_events`` on the shard model,
``simdist.models.gpt2_tp.GPT2TP``), with

* the group's collectives of every micro-batch (``gpt2_tp.group_collectives``) inside its
  forward and backward, over the T ranks of the group, each with its own blocks;
* with sequence parallelism, the row-share gradients' all-reduce over the group after the
  gradient sync (``row_share_sum``);
* the clipping norm's sum over the group (one float64 per rank, ``allreduce_scalars``)
  between the gradient sync and the loop's per-step agreement.

In bf16 / fp16 the data-parallel events move 2-byte gradients and parameters and the
group's activation collectives 16-bit words, as the run's half wires do; the
cross-entropy's sums stay float32 (``group_collectives`` marks which is which).

``StepModel`` places them as it places any recorded collective: a phase's all-gathers
before its kernels, the rest after them, exposed (Megatron's are blocking).
``tests/test_simulate.py`` runs the configuration and checks that the run's simulated step
equals the plan's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from simdist.arena import Layout
from simdist.comm.cost import choose_algorithm
from simdist.comm.partition import partition
from simdist.device.schedule import schedule
from simdist.models.gpt2_tp import group_collectives, stage_collectives

from .dp_schedule import dp_step_events
from .step import Coll, Span

TP_ALGORITHMS = ("ring", "rhd", "shm")  # the group's algorithm; any other request: auto


def group_algorithm(requested: str, op: str, nbytes: int, tp: int) -> str:
    """What the group's ``Collectives`` run for ``runconfig.collective_algorithm``: ring,
    rhd and shm as asked (they leave the same bits on every rank), anything else auto, here
    resolved without shared-memory buffers."""
    if requested in TP_ALGORITHMS:
        return requested
    return choose_algorithm(op, nbytes, tp)


def group_calls(
    model: Any, tp: int, micro_batch: int, seq: int, algorithm: str, act_bytes: int = 4
) -> dict[str, list[Coll]]:
    """Phase -> the group's collectives of one micro-batch, in issue order;
    ``act_bytes``: bytes per element of the activation collectives (2 on mixed
    precision's half wire; the cross-entropy's sums stay float32)."""
    out: dict[str, list[Coll]] = {"forward": [], "backward": []}
    sp = getattr(model, "sequence_parallel", False)
    for phase, op, n, activation in group_collectives(model.config, tp, micro_batch, seq, sp):
        elem = act_bytes if activation else 4
        blocks = tuple(int(x) for x in elem * np.diff(partition(n, tp)))
        alg = group_algorithm(algorithm, op, 4 * n, tp)
        out[phase].append(Coll(op, alg, blocks, False, phase, 0.0, 0.0))
    return out


def stage_group_calls(
    model: Any, tp: int, micro_batch: int, seq: int, algorithm: str, act_bytes: int = 4
) -> dict[str, list[list[Coll]]]:
    """``group_calls`` per model stage (``gpt2_tp.stage_collectives``): what a pipeline
    stage in weight mode issues around each of its model stages."""
    sp = getattr(model, "sequence_parallel", False)

    def coll(phase: str, op: str, n: int, activation: bool) -> Coll:
        elem = act_bytes if activation else 4
        blocks = tuple(int(x) for x in elem * np.diff(partition(n, tp)))
        alg = group_algorithm(algorithm, op, 4 * n, tp)
        return Coll(op, alg, blocks, False, phase, 0.0, 0.0)

    calls = stage_collectives(model.config, tp, micro_batch, seq, sp)
    return {ph: [[coll(ph, *c) for c in stage] for stage in st] for ph, st in calls.items()}


def tp_step_events(
    model: Any,
    *,
    tp: int,
    replicas: int,
    level: int,
    micro_batch: int,
    seq: int,
    accum: int = 1,
    optimizer_type: str = "adamw",
    algorithm: str = "ring",
    requested: str | None = None,
    grad_bytes: int = 4,
    param_bytes: int = 4,
    act_bytes: int = 4,
) -> tuple[list[Span | Coll], list[Coll]]:
    """(one step of rank 0 as the run records it, the group's collectives among them).

    ``model``: the shard (``GPT2TP``, nothing allocated); ``algorithm``: the
    data-parallel axis's, resolved (``dp_step_events``); ``requested``: the run's
    ``collective_algorithm`` as given (the group resolves it itself; default
    ``algorithm``); ``grad_bytes`` / ``param_bytes`` as ``dp_step_events``'s,
    ``act_bytes`` as ``group_calls``'s (mixed precision: 2)."""
    if level not in (0, 1, 2):
        raise ValueError(f"weight mode runs ZeRO 0-2 on the data-parallel axis, got {level}")
    events = dp_step_events(
        model, world=replicas, level=level, micro_batch=micro_batch, seq=seq, accum=accum,
        optimizer_type=optimizer_type, algorithm=algorithm, grad_bytes=grad_bytes,
        param_bytes=param_bytes,
    )  # fmt: skip
    calls = group_calls(model, tp, micro_batch, seq, requested or algorithm, act_bytes)
    norm = Coll("allreduce_scalars", "native", (8,) * tp, False, None, 0.0, 0.0)
    out: list[Span | Coll] = []
    group: list[Coll] = []
    for ev in events:
        if isinstance(ev, Span) and ev.kind in calls:  # recorded before their span closes
            out += calls[ev.kind]
            group += calls[ev.kind]
        out.append(ev)
        if isinstance(ev, Span) and ev.kind == "sync":
            shares = row_share_sum(model, tp, replicas, level, requested or algorithm, grad_bytes)
            out += shares
            group += [c for c in shares if isinstance(c, Coll)]
            out.append(norm)
            group.append(norm)
    return out, group


def row_share_sum(
    model: Any, tp: int, replicas: int, level: int, requested: str, grad_bytes: int
) -> list[Span | Coll]:
    """Sequence parallelism: the schedule's one all-reduce over the group of the row-share
    gradients (LayerNorms, ``wpe``) inside a replica's update range, with its span (the run
    hooks it as a sync); nothing without sequence parallelism or such gradients. Under
    ZeRO the replicas' slices hold different numbers of them: the step is the slowest
    rank's, the one with the most."""
    names = set(model.sequence_parallel_names()) if hasattr(model, "sequence_parallel") else ()
    if not names:
        return []
    layout = Layout(model.parameter_specs(), replicas)
    b = layout.bounds
    ranges = [(0, layout.padded)] if level == 0 else [(b[d], b[d + 1]) for d in range(replicas)]
    n = max(
        sum(seg.hi - seg.lo for seg in layout.segments(int(lo), int(hi)) if seg.name in names)
        for lo, hi in ranges
    )
    if n == 0:
        return []
    alg = group_algorithm(requested, "allreduce", 4 * n, tp)
    blocks = tuple(int(x) for x in grad_bytes * np.diff(partition(n, tp)))
    return [Coll("allreduce", alg, blocks, False, "sync", 0.0, 0.0), Span("sync", 0.0, 0.0, {})]


def group_bytes_sent(group: list[Coll], rank: int = 0) -> float:
    """Payload bytes ``rank`` of the group sends in ``group``'s collectives, as simdist's
    collectives count them (``Collectives.bytes_sent``): each ring / rhd / shm step's
    outgoing block (``simdist.device.schedule``), and ``allreduce_scalars``'s values to
    every other rank."""
    total = 0.0
    for c in group:
        if c.op == "allreduce_scalars":
            total += c.blocks[rank] * (len(c.blocks) - 1)
        else:
            total += sum(step[rank][1] for step in schedule(c.op, c.algorithm, c.blocks))
    return total


__all__ = [
    "TP_ALGORITHMS",
    "group_algorithm",
    "group_bytes_sent",
    "group_calls",
    "stage_group_calls",
    "tp_step_events",
]
