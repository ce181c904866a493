"""Learning-rate schedules: ``optimizer.learning_rate`` as a number or a list of schedulers.

As in Cerebras params files, ``learning_rate`` is either a constant or a list of schedulers
run one after another; each runs for its ``total_iters`` steps (``steps`` is accepted too)
and counts its own steps from 0, and the last one may leave its length open::

    learning_rate:
      - {scheduler: Linear, initial_learning_rate: 0.0, end_learning_rate: 3.0e-4, total_iters: 100}
      - {scheduler: CosineDecay, initial_learning_rate: 3.0e-4, end_learning_rate: 3.0e-5,
         total_iters: 900}

``optimizer.warmup_steps: W`` is a shortcut that puts a linear ramp from 0 to the first
rate in front. The rate of a step is a pure function of the global step (the 0-based index
of the step being taken), computed in float64: a resumed run gets exactly the rates of an
uninterrupted one, with nothing to checkpoint.

Schedulers (``s`` = steps into this scheduler, ``T`` = its ``total_iters``):

- Constant (learning_rate): learning_rate.
- Linear (initial_learning_rate, end_learning_rate): initial + (end - initial) min(s, T) / T.
- CosineDecay (initial_learning_rate, end_learning_rate):
  end + (initial - end) (1 + cos(pi min(s, T) / T)) / 2.
- ExponentialDecay (initial_learning_rate, decay_rate, decay_steps = T by default, staircase):
  initial decay_rate^(s / decay_steps), the exponent floored with staircase.
- PiecewiseConstant (values, milestones): values[i], i = the number of milestones <= s.

Names match case-insensitively, with or without an ``LR`` suffix (``LinearLR``, ``cosinedecay``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ScheduleError(ValueError):
    """A schedule that cannot work; the message names the key, e.g. ``...learning_rate[1].x``."""


@dataclass(frozen=True)
class Phase:
    """One scheduler of the sequence: ``rate(s)`` for ``s`` steps into it, ``length`` or None."""

    name: str
    rate: Callable[[int], float]
    length: int | None


@dataclass(frozen=True)
class LRSchedule:
    phases: tuple[Phase, ...]

    def __call__(self, step: int) -> float:
        """The learning rate of the step with 0-based global index ``step``."""
        for phase in self.phases:
            if phase.length is None or step < phase.length:
                return phase.rate(step)
            step -= phase.length
        last = self.phases[-1]  # past the end of a closed schedule: the last rate holds
        return last.rate(last.length)

    @property
    def total_steps(self) -> int | None:
        """Steps the schedule describes, or None when its last scheduler is open-ended."""
        if self.phases[-1].length is None:
            return None
        return sum(p.length for p in self.phases)

    @property
    def is_constant(self) -> bool:
        return len(self.phases) == 1 and self.phases[0].name == "constant"


def _rate(where: str, spec: dict, key: str, default: float | None = None) -> float:
    if key not in spec:
        if default is not None:
            return default
        raise ScheduleError(f"{where}: missing '{key}'")
    v = spec[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ScheduleError(f"{where}.{key}: expected a number, got {v!r}")
    if not math.isfinite(v) or v < 0:
        raise ScheduleError(f"{where}.{key}: a learning rate must be finite and >= 0, got {v}")
    return float(v)


def _steps(where: str, key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ScheduleError(f"{where}.{key}: expected a whole number of steps >= 1, got {v!r}")
    return v


def _constant(where: str, spec: dict, length: int | None) -> Callable[[int], float]:
    lr = _rate(where, spec, "learning_rate")
    return lambda s: lr


def _linear(where: str, spec: dict, length: int | None) -> Callable[[int], float]:
    a, b, t = (
        _rate(where, spec, "initial_learning_rate"),
        _rate(where, spec, "end_learning_rate"),
        _need(where, length),
    )
    return lambda s: a + (b - a) * min(s, t) / t


def _cosine(where: str, spec: dict, length: int | None) -> Callable[[int], float]:
    a, b, t = (
        _rate(where, spec, "initial_learning_rate"),
        _rate(where, spec, "end_learning_rate"),
        _need(where, length),
    )
    return lambda s: b + (a - b) * 0.5 * (1.0 + math.cos(math.pi * min(s, t) / t))


def _exponential(where: str, spec: dict, length: int | None) -> Callable[[int], float]:
    a = _rate(where, spec, "initial_learning_rate")
    r = spec.get("decay_rate")
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
        raise ScheduleError(f"{where}.decay_rate: expected a finite number > 0, got {r!r}")
    period = spec.get("decay_steps", length)
    if period is None:
        raise ScheduleError(f"{where}: ExponentialDecay needs 'decay_steps' or 'total_iters'")
    period = _steps(where, "decay_steps", period)
    staircase = spec.get("staircase", False)
    if not isinstance(staircase, bool):
        raise ScheduleError(f"{where}.staircase: expected true or false, got {staircase!r}")
    if staircase:
        return lambda s: a * float(r) ** (s // period)
    return lambda s: a * float(r) ** (s / period)


def _piecewise(where: str, spec: dict, length: int | None) -> Callable[[int], float]:
    values, milestones = spec.get("values"), spec.get("milestones")
    if not isinstance(values, list) or not isinstance(milestones, list):
        raise ScheduleError(f"{where}: PiecewiseConstant needs lists 'values' and 'milestones'")
    if len(values) != len(milestones) + 1:
        raise ScheduleError(
            f"{where}: {len(values)} values for {len(milestones)} milestones "
            "(one more value than milestones)"
        )
    rates = [_rate(f"{where}.values[{i}]", {"v": v}, "v") for i, v in enumerate(values)]
    marks = [_steps(where, f"milestones[{i}]", m) for i, m in enumerate(milestones)]
    if any(b <= a for a, b in zip(marks, marks[1:], strict=False)):
        raise ScheduleError(f"{where}.milestones: must increase strictly, got {marks}")
    return lambda s: rates[sum(1 for m in marks if m <= s)]


def _need(where: str, length: int | None) -> int:
    if length is None:
        raise ScheduleError(f"{where}: missing 'total_iters' (the scheduler's number of steps)")
    return length


_SCHEDULERS = {
    "constant": (_constant, {"learning_rate"}),
    "linear": (_linear, {"initial_learning_rate", "end_learning_rate"}),
    "cosinedecay": (_cosine, {"initial_learning_rate", "end_learning_rate"}),
    "exponentialdecay": (
        _exponential,
        {"initial_learning_rate", "decay_rate", "decay_steps", "staircase"},
    ),
    "piecewiseconstant": (_piecewise, {"values", "milestones"}),
}
_NAMES = "Constant, Linear, CosineDecay, ExponentialDecay, PiecewiseConstant"


def _phase(where: str, spec: Any, last: bool) -> Phase:
    if not isinstance(spec, dict):
        raise ScheduleError(f"{where}: expected a mapping with a 'scheduler' key, got {spec!r}")
    name = spec.get("scheduler")
    key = str(name).lower().removesuffix("lr") if isinstance(name, str) else None
    if key not in _SCHEDULERS:
        raise ScheduleError(f"{where}.scheduler: unknown scheduler {name!r}; known: {_NAMES}")
    build, keys = _SCHEDULERS[key]
    unknown = sorted(set(spec) - keys - {"scheduler", "total_iters", "steps"})
    if unknown:
        raise ScheduleError(
            f"{where}: unknown key '{unknown[0]}' for {name}; "
            f"it takes {sorted(keys)} and total_iters"
        )
    if "total_iters" in spec and "steps" in spec:
        raise ScheduleError(f"{where}: give 'total_iters' or 'steps', not both")
    length = spec.get("total_iters", spec.get("steps"))
    if length is not None:
        length = _steps(where, "total_iters", length)
    elif not last:
        raise ScheduleError(f"{where}: only the last scheduler may leave 'total_iters' out")
    return Phase(key, build(where, spec, length), length)


def parse_schedule(
    learning_rate: Any,
    warmup_steps: int = 0,
    max_steps: int | None = None,
    where: str = "optimizer.learning_rate",
) -> LRSchedule:
    """The schedule ``learning_rate`` (a number or a list of schedulers) describes.

    ``max_steps``: the run's length; a closed schedule must cover it (steps that add up to
    less would leave the run on a rate nobody wrote down).
    """
    if isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
        if not math.isfinite(learning_rate) or learning_rate <= 0:
            raise ScheduleError(f"{where}: must be a finite number > 0, got {learning_rate}")
        phases = [Phase("constant", lambda s, lr=float(learning_rate): lr, None)]
    elif isinstance(learning_rate, list) and learning_rate:
        n = len(learning_rate)
        phases = [_phase(f"{where}[{i}]", spec, i == n - 1) for i, spec in enumerate(learning_rate)]
    else:
        raise ScheduleError(
            f"{where}: expected a number or a non-empty list of schedulers, got {learning_rate!r}"
        )
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ScheduleError(
            f"optimizer.warmup_steps: expected a whole number >= 0, got {warmup_steps!r}"
        )
    if warmup_steps:
        peak = phases[0].rate(0)
        phases.insert(0, Phase("linear", lambda s: peak * s / warmup_steps, warmup_steps))
    schedule = LRSchedule(tuple(phases))
    total = schedule.total_steps
    if max_steps is not None and total is not None and total < max_steps:
        raise ScheduleError(
            f"{where}: the schedulers' steps add up to {total}"
            f"{f' (with {warmup_steps} warmup steps)' if warmup_steps else ''}, fewer than "
            f"runconfig.max_steps = {max_steps}; lengthen the last one or drop its total_iters"
        )
    return schedule
