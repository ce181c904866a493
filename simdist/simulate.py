"""The simulated accelerator inside a real training run (issue #5): the run's entry points.

``simdist.run`` calls ``create_device`` and ``attach``; the bodies live in
``simdist.sim.rank`` (recording hooks, report, timeline) and ``simdist.sim.step`` (the step
time model plan mode shares). Kept so the run's call sites and this import path stay as
they were.
"""

from __future__ import annotations

from simdist.sim.rank import (
    INPUT_BOTTLENECK_SHARE,
    TIMELINE,
    RankDevice,
    RecordingCollectives,
    Simulation,
    attach,
    compute_dtype,
    create_device,
)
from simdist.sim.step import COMPUTE_PHASES, Coll, Span

__all__ = [
    "COMPUTE_PHASES",
    "INPUT_BOTTLENECK_SHARE",
    "TIMELINE",
    "Coll",
    "RankDevice",
    "RecordingCollectives",
    "Simulation",
    "Span",
    "attach",
    "compute_dtype",
    "create_device",
]
