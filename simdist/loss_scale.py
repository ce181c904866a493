"""Loss scaling for float16 training: static, or dynamic as PyTorch's GradScaler and DeepSpeed.

float16 keeps 5 exponent bits: small gradients underflow to zero unless the loss is
multiplied by a scale S before backward (and the gradients divided by S before the update).
Too large an S overflows instead, so the dynamic scaler adapts it:

- start at ``initial_scale`` (2^16);
- a step whose gradients hold an Inf or NaN on ANY rank is skipped on every rank (the caller
  agrees ``found_inf`` across ranks before calling ``update``), and S is multiplied by
  ``backoff_factor`` (0.5), from the ``hysteresis``-th overflow since the scale last grew
  on (DeepSpeed's delayed shift; 1, the default, is GradScaler's behaviour);
- after ``growth_interval`` (2,000) clean steps in a row, S is multiplied by
  ``growth_factor`` (2);
- S never drops below ``min_scale`` (DeepSpeed's ``min_loss_scale``; GradScaler has none,
  which is the default 0).

A static scaler keeps S fixed; a step that overflows is still skipped (its update would
write Inf into the weights). The state is three numbers, checkpointed and resumed exactly
(S is a power of two times ``initial_scale``, exact in float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LossScaleConfig:
    dynamic: bool = True
    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 0.0

    def check(self, where: str = "runconfig.loss_scale") -> None:
        """Raise ValueError naming the key when the scaler could not work."""

        def bad(key: str, rule: str, v: object) -> ValueError:
            return ValueError(f"{where}.{key}: must be {rule}, got {v!r}")

        if not _finite(self.initial_scale) or self.initial_scale <= 0:
            raise bad("initial_scale", "a finite number > 0", self.initial_scale)
        if self.dynamic:
            if not _finite(self.growth_factor) or self.growth_factor <= 1:
                raise bad("growth_factor", "a finite number > 1", self.growth_factor)
            if not _finite(self.backoff_factor) or not 0 < self.backoff_factor < 1:
                raise bad("backoff_factor", "a number in (0, 1)", self.backoff_factor)
            if not isinstance(self.growth_interval, int) or self.growth_interval < 1:
                raise bad("growth_interval", "a whole number >= 1", self.growth_interval)
            if not isinstance(self.hysteresis, int) or self.hysteresis < 1:
                raise bad("hysteresis", "a whole number >= 1", self.hysteresis)
            if not _finite(self.min_scale) or not 0 <= self.min_scale <= self.initial_scale:
                raise bad("min_scale", "a finite number in [0, initial_scale]", self.min_scale)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class LossScaler:
    config: LossScaleConfig
    scale: float = field(init=False)
    clean_steps: int = field(init=False, default=0)  # clean steps since the last change
    overflows_left: int = field(init=False)  # overflows still tolerated before a backoff
    skipped_steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.config.check()
        self.scale = float(self.config.initial_scale)
        self.overflows_left = self.config.hysteresis

    def update(self, found_inf: bool) -> bool:
        """Account one step (``found_inf`` agreed across ranks); True when it is applied."""
        c = self.config
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            if c.dynamic:  # DeepSpeed: the tolerance is spent until the scale grows again
                if self.overflows_left <= 1:
                    self.scale = max(self.scale * c.backoff_factor, c.min_scale)
                else:
                    self.overflows_left -= 1
            return False
        if c.dynamic:
            self.clean_steps += 1
            if self.clean_steps == c.growth_interval:
                self.scale *= c.growth_factor
                self.clean_steps = 0
                self.overflows_left = c.hysteresis
        return True

    def state(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "overflows_left": self.overflows_left,
            "skipped_steps": self.skipped_steps,
        }

    def load(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows_left = int(state["overflows_left"])
        self.skipped_steps = int(state["skipped_steps"])


def describe_scaling(scaler: LossScaler | None) -> str:
    """The run's loss scaling as its log names it."""
    if scaler is None:
        return "no loss scaling"
    c = scaler.config
    return f"{'dynamic loss scale from' if c.dynamic else 'static loss scale'} {c.initial_scale:g}"


def scaler_report(scaler: LossScaler | None, skipped_at_start: int) -> dict[str, Any]:
    """performance.json's loss-scaling fields, for every schedule that scales the loss."""
    if scaler is None:
        return {}
    return {
        "loss_scale": scaler.scale,
        "skipped_steps": scaler.skipped_steps,  # since the run began (checkpointed)
        "skipped_steps_this_run": scaler.skipped_steps - skipped_at_start,
    }


def scaler_for(runconfig, precision: str) -> LossScaler | None:
    """The run's scaler from ``runconfig``: ``loss_scale`` null means dynamic in fp16 and
    none otherwise, "dynamic" dynamic, a number static at that scale."""
    r = runconfig
    if r.loss_scale is None and precision != "fp16":
        return None
    dynamic = r.loss_scale in (None, "dynamic")
    config = LossScaleConfig(
        dynamic=dynamic,
        initial_scale=float(r.initial_loss_scale if dynamic else r.loss_scale),
        growth_factor=float(r.loss_scale_growth_factor),
        backoff_factor=float(r.loss_scale_backoff_factor),
        growth_interval=int(r.loss_scale_growth_interval),
        hysteresis=int(r.loss_scale_hysteresis),
        min_scale=float(r.min_loss_scale) if dynamic else 0.0,
    )
    return LossScaler(config)
