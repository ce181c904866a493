"""Execution modes as schedules that ``simdist.run.Run`` drives (see ``base``)."""

from simdist.schedules.base import Schedule, StateShard, StepResult
from simdist.schedules.data_parallel import DataParallel
from simdist.schedules.input_workers import InputWorkers
from simdist.schedules.pipeline import Pipeline
from simdist.schedules.weight_streaming import WeightStreaming

__all__ = [
    "DataParallel",
    "InputWorkers",
    "Pipeline",
    "Schedule",
    "StateShard",
    "StepResult",
    "WeightStreaming",
]
