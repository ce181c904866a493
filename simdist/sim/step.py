"""The device time of one training step: the one function a run and a plan share.

A step is a list of events in the order they happened (or, in plan mode, would happen):

* ``Span(kind, t0, t1, info)``: a phase of the loop, with its measured host interval (plan
  mode: zero) and what the device model needs to know about it;
* ``Coll``: one collective call (``simdist.device.collective.CollectiveCall``) and the span
  it ran inside (``phase``; None: between the loop's phases, e.g. its per-step agreement).

``StepModel.play`` puts them on the rank's ``VirtualClock``:

=============  ===========================================================================
span           device time
=============  ===========================================================================
input          the measured fetch, as ``other`` time (plan: 0)
forward        the model's kernels for ``info["shape"]`` (``kernel_costs(B, T)``), each
backward       through ``CostModel.compute_time`` (roofline per kernel)
accumulate     copy (first micro-batch) or add over ``info["elements"]`` gradients
sync           the DP all-reduce's sum of squares of the owned slice, where it took it
clip           the norm's sum of squares (if clip computed it), the scaling pass
optimizer      one AdamW (14 FLOPs, 28 bytes per element) or SGD (6, 20) pass
gather         nothing of its own: its all-gather
=============  ===========================================================================

Overlap rules: ZeRO-2's per-group reduce-scatters (the backward's collectives, one per
gradient group) are placed at the point of the backward where their group was finished and
overlap the rest of it on the communication stream; every other collective is blocking and
exposed (DP's all-reduce and ZeRO-1's reduce-scatter after backward, the parameter
all-gather, the agreement and norm collectives). ZeRO-3's parameter all-gathers happen
inside forward and backward (each stage's groups, ``simdist.param_gather``): they are placed
before the phase's kernels, exposed (the run issues each prefetch synchronously one stage
early; its overlap with the stage's compute is not credited), and the backward's
reduce-scatters overlap as ZeRO-2's do. ``close(host_s)`` adds the loop's own host
time (measured by the run; 0 in plan mode) and ends the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from simdist.device.collective import CollectiveCall, Network, collective_seconds
from simdist.device.cost import CostModel
from simdist.device.profile import ProfileError
from simdist.models.base import KernelCost

from .clock import StepSummary, VirtualClock

COMPUTE_PHASES = ("forward", "backward", "optimizer")  # "compute alone" of a step
KernelCosts = Callable[[int, "int | None"], list[KernelCost]]  # (batch, seq) -> kernel calls


def compute_dtype(profile, half: str | None = None) -> tuple[str, list[str]]:
    """The dtype the kernels are timed at: a mixed-precision run's ``half`` (bf16 / fp16)
    where the profile publishes its matrix peak; else fp32 (simdist computes in float32)
    where the profile publishes an fp32 matrix peak, else its first published matrix dtype."""
    if half is not None:
        if profile.has_peak("matmul", half):
            return half, []
        note = f"{profile.name} publishes no {half} matrix peak: kernels are timed at fp32"
        dtype, notes = compute_dtype(profile)
        return dtype, [note, *notes]
    if profile.has_peak("matmul", "fp32"):
        return "fp32", []
    for dt in ("tf32", "bf16", "fp16"):
        if profile.has_peak("matmul", dt):
            note = f"{profile.name} publishes no fp32 matrix peak: kernels are timed at {dt}"
            return dt, [note]
    return "fp32", [f"{profile.name} publishes no matrix peak: compute is not modelled"]


@dataclass
class Span:
    kind: str  # input | forward | backward | accumulate | sync | clip | optimizer | gather
    t0: float
    t1: float
    info: dict[str, Any]


@dataclass
class Coll:
    op: str
    algorithm: str  # resolved: ring | rhd | hierarchical | native
    blocks: tuple[int, ...]  # bytes of each rank's block
    staged: bool
    phase: str | None  # the span it ran in (None: between the loop's hooked calls)
    t0: float
    t1: float

    @property
    def nbytes(self) -> int:
        return sum(self.blocks)

    @property
    def call(self) -> CollectiveCall:
        return CollectiveCall(self.op, self.algorithm, self.blocks, self.staged)


@dataclass
class TimedKernel:
    """A ``KernelCost`` with its simulated seconds (all ``count`` calls)."""

    name: str
    seconds: float
    flops: float
    bytes: float
    kind: str
    count: int
    done: tuple[str, ...]


@dataclass
class Played:
    """What ``StepModel.play`` saw of one step, for the run's report."""

    hooked_s: float  # measured seconds inside spans and between-span collectives
    input_s: float  # measured input fetch
    measured: dict[str, float]  # span kind -> measured seconds
    est: dict[str, float]  # span kind -> simulated seconds


def add_to(table: dict[str, float], key: str, seconds: float) -> None:
    table[key] = table.get(key, 0.0) + seconds


class StepModel:
    """One rank's step time from its events; the run and plan mode each hold one.

    ``kernel_costs(batch, seq)``: the model's kernel calls of one micro-batch (forward, then
    backward) — a live model's method in a run, the same method on a model built from
    shapes in plan mode. ``own``: the flat range of this rank's ZeRO slice (its share of
    the gradient norm). ``notes`` collects what the profile could not model, once each."""

    def __init__(
        self,
        clock: VirtualClock,
        cost: CostModel,
        dtype: str,
        net: Network,
        level: int,
        own: tuple[int, int],
        kernel_costs: KernelCosts,
        notes: list[str] | None = None,
        elem_bytes: int = 4,
    ):
        """``elem_bytes``: bytes of an activation element (2 in mixed precision: the
        kernels' traffic, counted in float32 elements by the models, scales with it)."""
        self.clock, self.cost, self.profile = clock, cost, cost.profile
        self.elem_bytes = elem_bytes
        self.dtype, self.net, self.level, self.own = dtype, net, level, own
        self.kernel_costs = kernel_costs
        self.notes = notes if notes is not None else []
        self._noted = set(self.notes)
        self._costs: dict[tuple[int, int | None], tuple[list[TimedKernel], list[TimedKernel]]] = {}

    def note(self, text: str) -> None:
        if text not in self._noted:
            self._noted.add(text)
            self.notes.append(text)

    # -- kernels ------------------------------------------------------------------------
    def kernel_seconds(self, k: KernelCost) -> float:
        """One kernel call (0 with a note where the profile publishes no rate for it)."""
        try:
            return self.cost.compute_time(
                k.flops, k.bytes, k.kind, self.dtype, k.shape, k.serial_flops
            )
        except ProfileError as err:
            self.note(f"compute not modelled: {err}")
            return 0.0

    def kernels(self, shape: tuple[int, int | None]) -> tuple[list[TimedKernel], list[TimedKernel]]:
        """(forward, backward) kernels of a micro-batch, timed once per shape."""
        hit = self._costs.get(shape)
        if hit is None:
            fwd: list[TimedKernel] = []
            bwd: list[TimedKernel] = []
            for k in self.kernel_costs(*shape):
                if self.elem_bytes != 4:
                    k = k._replace(bytes=k.bytes * self.elem_bytes / 4)
                prefix = "fwd " if k.phase == "forward" else "bwd "
                timed = TimedKernel(
                    prefix + k.name,
                    k.count * self.kernel_seconds(k),
                    k.flops,
                    k.bytes,
                    k.kind,
                    k.count,
                    k.done,
                )
                (fwd if k.phase == "forward" else bwd).append(timed)
            hit = self._costs[shape] = (fwd, bwd)
        return hit

    def _vector(
        self,
        name: str,
        flops: float,
        nbytes: float,
        dtype: str | None = None,
        serial_flops: float = 0.0,
        optimizer: bool = False,
    ) -> None:
        """One elementwise pass of the step (optimizer, accumulation, norm, scaling);
        ``optimizer``: AdamW's update, the pass the profile's optimizer sweep timed."""
        dtype = dtype or self.dtype
        try:
            seconds = self.cost.compute_time(
                flops,
                nbytes,
                "vector",
                dtype,
                serial_flops=serial_flops,
                optimizer=optimizer,
            )
            self.clock.compute(name, flops, nbytes, "vector", dtype, seconds=seconds)
        except ProfileError as err:
            self.note(f"compute not modelled: {err}")

    def _sum_of_squares(self) -> None:
        """This rank's share of the gradient norm: a float64 reduction (at the device's
        fp64 scalar rate where its profile publishes one)."""
        own = self.own[1] - self.own[0]
        dtype = "fp64" if "fp64" in self.profile.scalar_flops else None
        self._vector("grad.sum_of_squares", 2.0 * own, 4.0 * own, dtype, serial_flops=2.0 * own)

    def _run_kernels(self, kernels: list[TimedKernel], detail: bool) -> list[float]:
        """Advance the clock by ``kernels``; returns the clock time after each ``done``."""
        clock, marks = self.clock, []
        if detail:
            for k in kernels:
                clock.compute(
                    k.name, k.flops, k.bytes, k.kind, self.dtype, count=k.count, seconds=k.seconds
                )
                if k.done:
                    marks.append(clock.now)
            return marks
        # untraced steps: one clock call per run of kernels up to each done (same sums)
        acc = [0.0, 0.0, 0.0]
        label = kernels[0].name.split(" ")[0] + " kernels" if kernels else ""

        def flush() -> None:
            if acc[0] > 0:
                clock.compute(label, acc[1], acc[2], "vector", self.dtype, seconds=acc[0])
            acc[:] = [0.0, 0.0, 0.0]

        for k in kernels:
            acc[0] += k.seconds
            acc[1] += k.count * k.flops
            acc[2] += k.count * k.bytes
            if k.done:
                flush()
                marks.append(clock.now)
        flush()
        return marks

    # -- collectives --------------------------------------------------------------------
    def collective_seconds(self, c: CollectiveCall | Coll) -> float:
        """Simulated duration of one collective (0 with a note if unpublished)."""
        call = c.call if isinstance(c, Coll) else c
        try:
            return collective_seconds(self.cost, self.net, call)
        except ProfileError as err:
            self.note(f"communication not modelled: {err}")
            return 0.0

    def _place(self, c: Coll, overlappable: float, name: str) -> None:
        self.clock.record_collective(
            name,
            self.collective_seconds(c),
            overlappable,
            c.nbytes,
            op=c.op,
            algorithm=c.algorithm,
            link="host+" + self.net.link_class if c.staged else self.net.link_class,
        )

    # -- the step -----------------------------------------------------------------------
    def play(self, records: Iterable[Span | Coll], detail: bool = False) -> Played:
        """Put one step's events on the clock (``detail``: one trace event per kernel)."""
        clock = self.clock
        clock.record_events = detail
        pending: dict[str, list[Coll]] = {}
        shape: tuple[int, int | None] = (0, None)
        out = Played(0.0, 0.0, {}, {})
        for rec in records:
            before = clock.now
            if isinstance(rec, Coll):
                if rec.phase is None:  # e.g. the loop's per-step agreement
                    out.hooked_s += rec.t1 - rec.t0
                    self._place(rec, 0.0, f"{rec.op} (step check)")
                    add_to(out.est, "step_check", clock.now - before)
                else:
                    pending.setdefault(rec.phase, []).append(rec)
                continue
            colls = pending.pop(rec.kind, [])
            if detail:
                clock.measured(rec.kind, rec.t0, rec.t1)
            kind, info = rec.kind, rec.info
            out.hooked_s += rec.t1 - rec.t0
            add_to(out.measured, kind, rec.t1 - rec.t0)
            if kind == "input":
                out.input_s += rec.t1 - rec.t0
                clock.advance("input (measured)", rec.t1 - rec.t0, cat="input")
            elif kind == "forward":
                shape = info["shape"]
                colls = self._gathers_first(colls)
                self._run_kernels(self.kernels(shape)[0], detail)
            elif kind == "backward":
                colls = self._gathers_first(colls)
                marks = self._run_kernels(self.kernels(shape)[1], detail)
                if self.level >= 2 and len(colls) == len(marks):
                    for c, t_done in zip(colls, marks, strict=True):
                        self._place(c, clock.now - t_done, f"grad.{c.op}")
                else:
                    if colls:
                        self.note(
                            "backward collectives did not match the model's gradient "
                            "groups: placed after backward, exposed"
                        )
                    for c in colls:
                        self._place(c, 0.0, f"grad.{c.op}")
                colls = []
            elif kind == "accumulate" and info.get("elements"):
                n = info["elements"]
                if info["first"]:
                    self._vector("grad.accumulate.copy", 0.0, 8.0 * n)
                else:
                    self._vector("grad.accumulate.add", n, 12.0 * n)
            elif kind == "sync" and info.get("sumsq"):  # the DP sync's share of the norm
                self._sum_of_squares()
            elif kind == "clip" and info.get("norm"):  # the scale: in the optimizer's pass
                self._sum_of_squares()
            elif kind == "optimizer":
                n = info["elements"]
                scale = n if info.get("scaled") else 0.0  # clipping's multiply, in this pass
                if info["type"] == "adamw":  # reads p, g, m, v; writes p, m, v
                    self._vector("optimizer.adamw", 14.0 * n + scale, 28.0 * n, optimizer=True)
                else:  # reads p, g, buf; writes p, buf
                    self._vector("optimizer.sgd", 6.0 * n + scale, 20.0 * n)
            for c in colls:  # sync, gather and norm collectives: blocking, exposed
                name = {"sync": "grad", "gather": "params", "clip": "grad_norm"}.get(kind, kind)
                self._place(c, 0.0, f"{name}.{c.op}")
            add_to(out.est, kind, clock.now - before)
        for colls in pending.values():  # spans the replay does not know: exposed
            for c in colls:
                self._place(c, 0.0, c.op)
        return out

    def _gathers_first(self, colls: list[Coll]) -> list[Coll]:
        """Place a phase's parameter all-gathers (ZeRO-3) now, exposed; the rest remain.
        Below ZeRO-3 a phase's all-gathers are the model's own (tensor parallelism's
        vocab-parallel maxima, sequence parallelism's f): they stay with the others."""
        if self.level < 3:
            return colls
        for c in colls:
            if c.op == "allgather":
                self._place(c, 0.0, "params.allgather (stage)")
        return [c for c in colls if c.op != "allgather"]

    def close(self, host_s: float, played: Played | None = None) -> StepSummary:
        """End the step after the loop's own host work between the spans (measured, serial
        with the device work in this synchronous loop; 0 in plan mode)."""
        self.clock.advance("host (measured)", host_s, cat="host")
        if played is not None:
            add_to(played.est, "host", host_s)
            add_to(played.measured, "host", host_s)
        summary = self.clock.end_step()
        self.clock.record_events = False
        return summary


__all__ = [
    "COMPUTE_PHASES",
    "Coll",
    "Played",
    "Span",
    "StepModel",
    "TimedKernel",
    "add_to",
    "compute_dtype",
]
