"""Execution modes as schedules that ``simdist.run.Run`` drives (see ``base``)."""

from simdist.schedules.base import Schedule, StateShard, StepResult
from simdist.schedules.data_parallel import DataParallel
from simdist.schedules.input_workers import InputWorkers
from simdist.schedules.weight_streaming import WeightStreaming

__all__ = [
    "DataParallel",
    "InputWorkers",
    "Schedule",
    "StateShard",
    "StepResult",
    "WeightStreaming",
]
