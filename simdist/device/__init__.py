"""The simulated accelerator: profiles, accounted memory, cost model and timeline.

What the training loop uses (one of each per rank)::

    profile = load_profile("a100-80gb")               # or a path to a profile YAML
    memory = DeviceMemory.from_profile(profile, hint="try zero_opt_level 2")
    flat = memory.allocate("parameters", "params.flat", (n,), np.float32)
    memory.reserve("optimizer_state", "adam.fp32_master", 4 * n)  # accounted, not allocated
    clock = VirtualClock(CostModel(profile, dtype="fp32"), rank)
    clock.compute("h.0.mlp.fc1", flops=2 * m * k * n, bytes_moved=4 * (m * k + k * n + m * n))
    clock.collective("grad.bucket0", "reduce_scatter", "ring", nbytes, world, link="auto",
                     overlappable_with=backward_seconds_after_bucket_ready)
    step = clock.end_step()                           # StepSummary: compute / exposed comm / other
    write_chrome_trace(path, gathered_events)         # rank 0, after gathering clock.events

Nothing here imports MPI; gathering per-rank events and summaries is the loop's job.
"""

from .cost import CostModel, StepSummary, VirtualClock, collective_time, efficiency
from .memory import CATEGORIES, DeviceMemory, SimulatedOutOfMemoryError, format_bytes
from .profile import DeviceProfile, Link, ProfileError, list_profiles, load_profile
from .timeline import chrome_trace, validate_chrome_trace, write_chrome_trace

__all__ = [
    "CATEGORIES",
    "CostModel",
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
    "format_bytes",
    "list_profiles",
    "load_profile",
    "validate_chrome_trace",
    "write_chrome_trace",
]
