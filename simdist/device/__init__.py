"""The simulated accelerator: profiles, accounted memory, kernel and collective costs, timeline.

What the training loop uses (one of each per rank)::

    profile = load_profile("a100-80gb")               # or a path to a profile YAML
    memory = DeviceMemory.from_profile(profile, hint="try zero_opt_level 2")
    flat = memory.allocate("parameters", "params.flat", (n,), np.float32)
    memory.reserve("optimizer_state", "adam.fp32_master", 4 * n)  # accounted, not allocated
    clock = VirtualClock(CostModel(profile, dtype="fp32"), rank)
    clock.compute("h.0.mlp.fc1", *gemm_cost(m, k, n, itemsize=2))     # fp16 on the device
    clock.collective("grad.bucket0", "reduce_scatter", "ring", nbytes, world, link="auto",
                     overlappable_with=backward_seconds_after_bucket_ready)
    step = clock.end_step()                           # StepSummary: compute / exposed comm / other
    write_chrome_trace(path, gathered_events)         # rank 0, after gathering clock.events

or all of it at once: ``device = Device.create("a100-80gb", rank, dtype="fp32")`` and, at the
end, ``device.summary(samples_per_step=B)`` for performance.json.

Nothing here imports MPI; gathering per-rank events and summaries is the loop's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simdist.sim.clock import StepSummary, VirtualClock  # a leaf: imports nothing from simdist

from .cost import CostModel, collective_time, efficiency, elementwise_cost, gemm_cost
from .memory import CATEGORIES, DeviceMemory, SimulatedOutOfMemoryError, format_bytes
from .profile import DeviceProfile, Link, ProfileError, list_profiles, load_profile
from .timeline import chrome_trace, validate_chrome_trace, write_chrome_trace


@dataclass
class Device:
    """One rank's simulated accelerator: profile, accounted memory, cost model, clock."""

    profile: DeviceProfile
    memory: DeviceMemory
    cost: CostModel
    clock: VirtualClock

    @classmethod
    def create(
        cls,
        profile: str | Path | DeviceProfile,
        rank: int = 0,
        dtype: str = "fp32",
        hint: Any = None,
    ) -> Device:
        prof = profile if isinstance(profile, DeviceProfile) else load_profile(profile)
        cost = CostModel(prof, dtype)
        return cls(prof, DeviceMemory.from_profile(prof, hint), cost, VirtualClock(cost, rank))

    def summary(self, samples_per_step: int | None = None) -> dict[str, Any]:
        """JSON-ready simulated figures for performance.json (per rank)."""
        totals = self.clock.totals()
        out: dict[str, Any] = {
            "profile": self.profile.name,
            "profile_sha256": self.profile.sha256,
            "profile_unknown": list(self.profile.unknown),
            "memory": self.memory.summary(),
            "simulated": totals,
        }
        if samples_per_step and totals["mean_step_s"] > 0:
            out["est_samples_per_sec"] = samples_per_step / totals["mean_step_s"]
        return out


__all__ = [
    "CATEGORIES",
    "CostModel",
    "Device",
    "DeviceMemory",
    "DeviceProfile",
    "Link",
    "ProfileError",
    "SimulatedOutOfMemoryError",
    "StepSummary",
    "VirtualClock",
    "chrome_trace",
    "collective_time",
    "efficiency",
    "elementwise_cost",
    "format_bytes",
    "gemm_cost",
    "list_profiles",
    "load_profile",
    "validate_chrome_trace",
    "write_chrome_trace",
]
