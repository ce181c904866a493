"""A model's configuration from a named preset and the params file's overrides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from simdist.config import ConfigError


def resolve_preset(
    model: str,
    presets: Mapping[str, Mapping[str, Any]],
    fields: tuple[str, ...],
    required: tuple[str, ...],
    preset: str | None,
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
    """The preset's fields with the overrides laid over (None = keep the preset's); without
    a preset every ``required`` field must be given. Unknown keys, an unknown preset and a
    missing field are ConfigErrors that name what to write instead."""
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ConfigError(f"model: unknown {model} keys {sorted(unknown)}; known: {fields}")
    if preset is not None and preset not in presets:
        raise ConfigError(f"model.preset: unknown {preset!r}; choose from {sorted(presets)}")
    values = dict(presets[preset]) if preset is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    missing = [k for k in required if k not in values]
    if missing:
        raise ConfigError(
            f"model.{missing[0]} is required (set model.preset to one of {sorted(presets)} "
            f"or give all of {', '.join(required)})"
        )
    return values
