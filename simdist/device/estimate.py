"""performance.json's simulated-device fields, the same in every execution mode.

Every run reports what it measured (``samples_per_sec``) beside what its simulated step on
the device profile predicts (Cerebras style ``est_samples_per_sec``). Each mode simulates
its step its own way (data parallelism: ``simdist.sim.rank``'s replay of the hooked calls;
a pipeline: ``simdist.sim.pp_schedule``; weight streaming: ``simdist.sim.streaming_step``)
and hands the result here, so the documented keys mean the same everywhere:

- ``device_profile``, ``device_profile_sha256``, ``device_profile_path``;
- ``est_step_time_s``: the simulated step (the critical path), plus the measured host time
  the device waits for where the mode measures it (``other``);
- ``est_samples_per_sec`` = global batch / ``est_step_time_s``;
- ``est_step_time_breakdown_s``: ``compute`` / ``exposed_comm`` / ``other`` (and, in a
  pipeline, ``bubble``), summing to ``est_step_time_s``;
- ``device_memory_peak_bytes`` (per category, the largest over the ranks) and
  ``device_memory_capacity_bytes``.

``simulated_line`` is the ``Simulated on ...`` line each mode logs. Nothing here imports MPI.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .profile import DeviceProfile


def est_fields(
    profile: DeviceProfile,
    global_batch: int,
    step_s: float,
    breakdown: dict[str, float],
) -> dict[str, Any]:
    """The profile and the estimate: ``step_s`` the simulated step (seconds; its parts in
    ``breakdown``, which sum to it), ``est_samples_per_sec`` the global batch over it (None
    when the step is not positive: a profile that models nothing)."""
    step = float(step_s)
    return {
        "device_profile": profile.name,
        "device_profile_sha256": profile.sha256,
        "device_profile_path": profile.path,
        "est_samples_per_sec": global_batch / step if step > 0 else None,
        "est_step_time_s": step,
        "est_step_time_breakdown_s": {k: float(v) for k, v in breakdown.items()},
    }


def peak_by_category(summaries: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Per category (and ``total``), the largest peak over ranks' ``DeviceMemory.summary()``."""
    peaks: dict[str, int] = {}
    for s in summaries:
        for cat, b in s["peak_bytes"].items():
            peaks[cat] = max(peaks.get(cat, 0), int(b))
    return peaks


def memory_fields(summaries: list[dict[str, Any]], capacity: int) -> dict[str, Any]:
    """``device_memory_peak_bytes``, ``device_memory_capacity_bytes`` and rank 0's summary
    (``device_memory_rank0``) from the ranks' ``DeviceMemory.summary()``, rank 0's first."""
    return {
        "device_memory_peak_bytes": peak_by_category(summaries),
        "device_memory_capacity_bytes": int(capacity),
        "device_memory_rank0": summaries[0],
    }


def busy_split(
    compute: Iterable[tuple[float, float]], comm: Iterable[tuple[float, float]], total: float
) -> tuple[float, float, float]:
    """One timeline of ``total`` seconds: (time computing, time communicating while not
    computing, the rest: idle), from (start, duration) spans that may overlap."""
    comp = _ends(compute)
    c = _length(_merge(comp))
    b = _length(_merge(comp + _ends(comm)))
    return c, b - c, max(0.0, total - b)


def _ends(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(float(a), float(a) + float(d)) for a, d in spans if d > 0]


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return math.fsum(b - a for a, b in spans)


def simulated_line(fields: dict[str, Any] | None) -> str | None:
    """The log line of a run's simulated throughput, or None without an estimate."""
    if not fields or not fields.get("est_samples_per_sec"):
        return None
    return (
        f"Simulated on {fields['device_profile']}: "
        f"{fields['est_samples_per_sec']:.2f} samples/second "
        f"({1e3 * fields['est_step_time_s']:.3f} ms per step)."
    )


__all__ = ["busy_split", "est_fields", "memory_fields", "peak_by_category", "simulated_line"]
