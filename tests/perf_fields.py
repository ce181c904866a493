"""performance.json's simulated-device fields, as every execution mode must write them
(``simdist.device.estimate``; README "What a run leaves in model_dir")."""

from __future__ import annotations

import math
from typing import Any

import pytest


def assert_simulated_fields(perf: dict[str, Any], stdout: str, parts: set[str]) -> None:
    """The documented keys exist, are positive and finite, and agree: the throughput is
    the global batch over the step, the breakdown (keys ``parts``) sums to the step, and
    the run logged the ``Simulated on ...`` line with the same figures."""
    step, sps = perf["est_step_time_s"], perf["est_samples_per_sec"]
    for value in (step, sps):
        assert isinstance(value, float) and math.isfinite(value) and value > 0, perf
    assert sps == pytest.approx(perf["global_batch_size"] / step, rel=1e-12)
    breakdown = perf["est_step_time_breakdown_s"]
    assert set(breakdown) == parts, breakdown
    assert all(math.isfinite(v) and v >= 0 for v in breakdown.values()), breakdown
    assert breakdown["compute"] > 0
    assert math.fsum(breakdown.values()) == pytest.approx(step, rel=1e-9)
    assert isinstance(perf["device_profile"], str) and perf["device_profile"]
    assert len(perf["device_profile_sha256"]) == 64
    int(perf["device_profile_sha256"], 16)
    peaks = perf["device_memory_peak_bytes"]
    assert peaks["total"] > 0 and all(v >= 0 for v in peaks.values()), peaks
    assert peaks["total"] <= perf["device_memory_capacity_bytes"]
    assert isinstance(perf["suspected_input_bottleneck"], bool)
    line = (
        f"Simulated on {perf['device_profile']}: {sps:.2f} samples/second "
        f"({1e3 * step:.3f} ms per step)."
    )
    assert line in stdout, stdout[-2000:]
