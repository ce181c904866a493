"""One rank's virtual clock: compute and communication streams, summed per step.

``VirtualClock`` accumulates one rank's simulated time per step: compute, exposed and
overlapped communication, and other time, and records events for the Chrome-trace timeline.
Kernel and collective *durations* come from the cost model (``simdist.device.cost``); the
clock only places them on its two streams. It imports nothing from simdist, so
``simdist.device.Device`` can hold one without the device package depending on the rest
of ``simdist.sim``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class Costs(Protocol):
    """What the clock needs of ``simdist.device.cost.CostModel`` (not imported: this module
    is a leaf, so ``simdist.device`` can build a clock)."""

    def compute_time(
        self,
        flops: float,
        bytes_moved: float,
        kind: str = ...,
        dtype: Any = ...,
        shape: tuple = ...,
        serial_flops: float = ...,
    ) -> float: ...

    def collective_time(
        self, op: str, algorithm: str, nbytes: float, world: int, link: str = ...
    ) -> float: ...


@dataclass
class StepSummary:
    """One step of one rank: ``total_s == compute_s + exposed_comm_s + other_s``."""

    step: int
    total_s: float
    compute_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    other_s: float
    flops: float
    bytes_moved: float
    comm_bytes: float
    by_name: dict[str, float] = field(default_factory=dict)

    @property
    def comm_s(self) -> float:
        return self.exposed_comm_s + self.overlapped_comm_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "comm_s": self.comm_s}


class VirtualClock:
    """Per-rank simulated time.

    The compute stream advances with every ``compute``/``advance`` call. Collectives run on
    one communication stream, in call order. ``overlappable_with`` (seconds) says how much
    compute already accounted on this clock ran *after* the collective's input was ready —
    e.g. the backward time that remained when a gradient bucket filled, for a loop that runs
    the real (blocking) MPI call after backward. The collective is placed on the comm stream
    at ``now - overlappable_with`` (not before the stream is free or the step began); the part
    that ends after ``now`` is exposed and advances the clock, the rest was overlapped.
    ``overlappable_with=0`` is a blocking collective: fully exposed.

    Not modelled: slowdown of compute by concurrent communication (SM/memory contention,
    arXiv 2507.03114 measures 18.9 % on average); the exposed/overlapped split is an ideal.
    """

    def __init__(self, cost: Costs, rank: int = 0, *, record_events: bool = True):
        self.cost = cost
        self.rank = rank
        self.record_events = record_events
        self.now = 0.0
        self.events: list[dict[str, Any]] = []
        self.steps: list[StepSummary] = []
        self._comm_free = 0.0
        self._step_start = 0.0
        self.wall_origin = time.perf_counter()
        self._reset_step()

    def _reset_step(self) -> None:
        self._compute = self._exposed = self._overlapped = self._other = 0.0
        self._flops = self._bytes = self._comm_bytes = 0.0
        self._by_name: dict[str, float] = {}

    def _event(self, name: str, cat: str, track: str, start: float, dur: float, **args) -> None:
        if self.record_events:
            self.events.append(
                {"name": name, "cat": cat, "track": track, "start": start, "dur": dur, "args": args}
            )

    def compute(
        self,
        name: str,
        flops: float,
        bytes_moved: float,
        kind: str = "matmul",
        dtype: str | None = None,
        count: int = 1,
        seconds: float | None = None,
        serial_flops: float = 0.0,
    ) -> float:
        """Advance by ``count`` identical kernels of ``flops`` and ``bytes_moved`` each (one
        event); returns the time. Efficiency is keyed by one kernel's size, not the sum.
        ``seconds``: the total time, already computed with ``CostModel.compute_time`` (a
        caller replaying the same kernels every step caches it)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if seconds is None:
            dur = count * self.cost.compute_time(
                flops, bytes_moved, kind, dtype, serial_flops=serial_flops
            )
        elif seconds < 0:
            raise ValueError("seconds must be >= 0")
        else:
            dur = float(seconds)
        args = {"flops": count * flops, "bytes": count * bytes_moved}
        if count > 1:
            args["calls"] = count
        self._event(name, kind, "compute", self.now, dur, **args)
        self.now += dur
        self._compute += dur
        self._flops += count * flops
        self._bytes += count * bytes_moved
        self._by_name[name] = self._by_name.get(name, 0.0) + dur
        return dur

    def advance(self, name: str, seconds: float, cat: str = "other") -> float:
        """Advance by time modelled elsewhere (input pipeline, host work, optimizer tail)."""
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        self._event(name, cat, "compute", self.now, seconds)
        self.now += seconds
        self._other += seconds
        self._by_name[name] = self._by_name.get(name, 0.0) + seconds
        return seconds

    def collective(
        self,
        name: str,
        op: str,
        algorithm: str,
        nbytes: float,
        world: int,
        link: str = "auto",
        overlappable_with: float = 0.0,
    ) -> float:
        """Account one collective; returns its full simulated duration."""
        dur = self.cost.collective_time(op, algorithm, nbytes, world, link)
        self.record_collective(name, dur, overlappable_with, nbytes, op=op, algorithm=algorithm)
        return dur

    def record_collective(
        self, name: str, duration: float, overlappable_with: float = 0.0, nbytes: float = 0, **args
    ) -> float:
        """Place a collective of known ``duration`` on the comm stream; returns exposed time."""
        if duration < 0 or overlappable_with < 0:
            raise ValueError("duration and overlappable_with must be >= 0")
        start = max(self.now - overlappable_with, self._comm_free, self._step_start)
        end = start + duration
        exposed = max(0.0, end - self.now)
        self._comm_free = end
        self._event(name, "comm", "comm", start, duration, nbytes=nbytes, exposed=exposed, **args)
        if exposed > 0:
            self._event(f"wait {name}", "exposed_comm", "compute", self.now, exposed)
        self.now += exposed
        self._exposed += exposed
        self._overlapped += duration - exposed
        self._comm_bytes += nbytes
        self._by_name[name] = self._by_name.get(name, 0.0) + duration
        return exposed

    def measured(
        self, name: str, start: float, end: float, cat: str = "measured", **args: Any
    ) -> None:
        """Record a host wall-clock interval (``time.perf_counter()`` stamps) for the timeline."""
        self._event(name, cat, "measured", start - self.wall_origin, end - start, **args)

    def end_step(self) -> StepSummary:
        """Close the step: all communication is complete before the next step starts."""
        if self._comm_free > self.now:  # cannot happen via record_collective; kept for safety
            self._exposed += self._comm_free - self.now
            self.now = self._comm_free
        summary = StepSummary(
            step=len(self.steps),
            total_s=self.now - self._step_start,
            compute_s=self._compute,
            exposed_comm_s=self._exposed,
            overlapped_comm_s=self._overlapped,
            other_s=self._other,
            flops=self._flops,
            bytes_moved=self._bytes,
            comm_bytes=self._comm_bytes,
            by_name=dict(self._by_name),
        )
        self.steps.append(summary)
        self._step_start = self.now
        self._reset_step()
        return summary

    def totals(self) -> dict[str, float]:
        """Sums over finished steps and the mean step time (for performance.json)."""
        keys = ("total_s", "compute_s", "exposed_comm_s", "overlapped_comm_s", "other_s", "flops")
        out = {k: sum(getattr(s, k) for s in self.steps) for k in keys}
        out["steps"] = len(self.steps)
        out["mean_step_s"] = out["total_s"] / len(self.steps) if self.steps else 0.0
        return out


__all__ = ["StepSummary", "VirtualClock"]
