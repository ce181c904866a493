"""ZeRO-3's parameter gathers: which groups, when, into which window (no MPI).

Under ``zero_opt_level: 3`` a rank keeps only its slice of the flat parameters
(``Layout.shard``). A model runs as stages (``simdist.models.stages``): before a stage's
forward, and again before its backward, the parameters it reads are all-gathered into a
window; the unit of a gather is a gradient group (one contiguous flat range, so each rank
contributes one block: its slice cut by the group's range, as ZeRO-2's reduce-scatter of the
same group receives it).

Two windows, each the size of the largest stage's groups (``GatherPlan.window``). While a
stage computes from one window, the next stage's groups are gathered into the other
(prefetch: issued just before the stage computes; on CPU ranks the call is synchronous,
so it is the same all-gather issued one stage early). A window is released when the next
gather needs it; a stage whose groups are all in a window already (the head's backward
right after its forward) gathers nothing. Parameters change only in the optimizer, so the
windows are invalidated once per step.

``WindowCache`` holds no buffers: the run (``simdist.parallel.PartitionedParameters``) and
plan mode (``simdist.sim.dp_schedule``) drive the same object through the same uses, so both
see the same gathers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simdist.arena import Layout

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Gather:
    """One all-gather: group ``group``'s flat range [a, b) into ``window`` at ``offset``."""

    group: int
    a: int
    b: int
    window: int
    offset: int


class GatherPlan:
    """Per stage, the gradient groups its forward and its backward read, and the window
    size; from the model's ``stages()`` and ``gradient_groups()`` on a ``Layout``."""

    def __init__(self, layout: Layout, stages: Sequence, groups: Sequence):
        self.layout = layout
        numel = {s.name: s.numel for s in layout.specs}
        self.ranges: list[tuple[int, int]] = []
        group_of: dict[str, int] = {}
        for i, g in enumerate(groups):
            a = b = layout.offsets[g.names[0]]
            for n in g.names:  # contiguous in layout order (ZeRO-2 requires the same)
                if layout.offsets[n] != b:
                    raise ValueError(f"gradient group {g.names} is not contiguous in the layout")
                b += numel[n]
                group_of[n] = i
            self.ranges.append((a, b))
        missing = sorted(set(numel) - set(group_of))
        if missing:
            raise ValueError(f"gradient_groups must name every parameter: {missing[:3]}")
        self.names = [tuple(g.names) for g in groups]

        def need(names: tuple[str, ...]) -> tuple[int, ...]:  # in flat order
            return tuple(sorted({group_of[n] for n in names}, key=lambda g: self.ranges[g][0]))

        self.stages = list(stages)
        self.forward = [need(st.forward_params) for st in self.stages]
        self.backward = [need(st.backward_params) for st in self.stages]
        self.window = max(
            (self.size(u) for u in self.forward + self.backward if u), default=0
        )  # elements of one window

    def size(self, groups: tuple[int, ...]) -> int:
        return sum(self.ranges[g][1] - self.ranges[g][0] for g in groups)

    def uses(self, k: int, phase: str) -> tuple[int, ...]:
        return (self.forward if phase == FORWARD else self.backward)[k]

    def next_use(self, k: int, phase: str, training: bool) -> tuple[int, ...]:
        """The groups of the next stage use that reads any (the prefetch target): forward
        0..n-1, then (training) backward n-1..0."""
        n = len(self.stages)
        seq = [(j, FORWARD) for j in range(n)]
        if training:
            seq += [(j, BACKWARD) for j in range(n - 1, -1, -1)]
        at = seq.index((k, phase))
        for j, ph in seq[at + 1 :]:
            if self.uses(j, ph):
                return self.uses(j, ph)
        return ()

    def block_bounds(self, group: int) -> np.ndarray:
        """Each rank's block of the group's range: the ZeRO slice boundaries cut by it."""
        a, b = self.ranges[group]
        return np.clip(self.layout.bounds - a, 0, b - a)


class WindowCache:
    """Which groups each of the two windows holds; ``acquire`` and ``prefetch`` return the
    gathers to run (in order), identical on every rank. ``count=1``: one window and no
    prefetch (loads that cost no communication: ``simdist.packed_params``)."""

    def __init__(self, plan: GatherPlan, count: int = 2):
        if count not in (1, 2):
            raise ValueError(f"a WindowCache has 1 or 2 windows, not {count}")
        self.plan, self.count = plan, count
        self.invalidate()

    def invalidate(self) -> None:
        self.held: list[dict[int, int]] = [{} for _ in range(self.count)]  # {group: offset}
        self.recent = self.count - 1  # the window used last (the other: the first victim)
        self.pinned: int | None = None  # the window the computing stage reads

    def find(self, groups: tuple[int, ...]) -> int | None:
        for w in (self.recent, 1 - self.recent)[: self.count]:
            if all(g in self.held[w] for g in groups):
                return w
        return None

    def _load(self, groups: tuple[int, ...], window: int) -> list[Gather]:
        out, off = [], 0
        self.held[window] = {}
        for g in groups:
            a, b = self.plan.ranges[g]
            out.append(Gather(g, a, b, window, off))
            self.held[window][g] = off
            off += b - a
        return out

    def acquire(self, groups: tuple[int, ...]) -> tuple[int, list[Gather]]:
        """The window holding ``groups`` for the stage about to compute (gathering them
        into the least recently used window if no window holds them all)."""
        w = self.find(groups)
        gathers: list[Gather] = []
        if w is None:
            w = 1 - self.recent if self.count == 2 else 0
            gathers = self._load(groups, w)
        self.recent = self.pinned = w
        return w, gathers

    def prefetch(self, groups: tuple[int, ...]) -> list[Gather]:
        """Gather the next use's groups into the window the computing stage does not read."""
        if self.count == 1 or not groups or self.find(groups) is not None:
            return []
        return self._load(groups, 1 - (self.pinned if self.pinned is not None else self.recent))


def stage_gathers(plan: GatherPlan, cache: WindowCache, k: int, phase: str, training: bool):
    """The gathers before stage ``k``'s ``phase`` computes: its own (if not resident), then
    the prefetch of the next use. Returns (window the stage reads, gathers in order)."""
    groups = plan.uses(k, phase)
    if not groups:
        w, gathers = None, []
    else:
        w, gathers = cache.acquire(groups)
    gathers = gathers + cache.prefetch(plan.next_use(k, phase, training))
    return w, gathers


__all__ = ["BACKWARD", "FORWARD", "Gather", "GatherPlan", "WindowCache", "stage_gathers"]
