"""YAML in, typed dataclasses out, with errors a user can act on.

PyYAML silently keeps the last of a key given twice and forgets where each key was; this
module refuses duplicates and records the line of every key (``read_yaml``), then checks
each value against its dataclass annotation (``build_dataclass``), so an error names the
file, the line and the key. Used by params files (``simdist.config``) and any other YAML a
user writes.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """Bad user input in params or flags; the message says what, where and what to do.

    ``key`` (e.g. ``optimizer.learning_rate``) is the setting at fault, when one is;
    ``load_params`` uses it to add where that value came from (file:line or the flag).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping, at any depth (PyYAML
    silently keeps the last), and records the line of every key: ``lines["optimizer.beta1"]``,
    ``lines["optimizer.learning_rate[0].scheduler"]``."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self.source = source
        self.lines: dict[str, int] = {}

    def check(self, node: yaml.Node, path: str = "") -> None:
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                name, line = str(key_node.value), key_node.start_mark.line + 1
                full = f"{path}.{name}" if path else name
                ident = (key_node.tag, name)
                if ident in seen:
                    raise ConfigError(
                        f"{self.source}:{line}: duplicate key {full} (first given on line "
                        f"{seen[ident]}); give each key once"
                    )
                seen[ident] = line
                self.lines[full] = line
                self.check(value_node, full)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.lines[f"{path}[{i}]"] = item.start_mark.line + 1
                self.check(item, f"{path}[{i}]")


def read_yaml(text: str, source: str) -> tuple[Any, dict[str, int]]:
    """(data, line of each key) of one YAML document; ``source`` names it in errors."""
    loader = StrictLoader(text, source)
    try:
        node = loader.get_single_node()
        data = None
        if node is not None:
            loader.check(node)
            data = loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: malformed YAML: {e}") from None
    finally:
        loader.dispose()
    return data, loader.lines


def check_type(value: Any, annotation: Any, key: str) -> Any:
    """Validate (and lightly coerce int->float) a value against a dataclass annotation."""
    if annotation is Any:  # checked where it is interpreted (e.g. simdist.lr_schedule)
        return value
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        for arm in typing.get_args(annotation):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return check_type(value, arm, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {type_name(annotation)}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            what = getattr(item, "__name__", str(item))
            raise ConfigError(f"{key}: expected a list of {what}, got {value!r}")
        return [check_type(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if annotation is float:
        if isinstance(value, str):
            # PyYAML reads "1e-2" (no dot) as a string; accept it as the number it spells
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:  # it travels as int64 (MPI, HDF5 attributes)
            raise ConfigError(f"{key}: {value} does not fit in a 64-bit integer")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {annotation!r} for {key}")


def type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is list:
        return "a list"
    args = typing.get_args(annotation)
    if args:
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def build_dataclass(
    cls: type, values: dict[str, Any], section: str, choices: dict[str, tuple] | None = None
) -> Any:
    """``cls(**values)`` with every value checked against its annotation; ``choices`` maps
    ``section.key`` to its allowed values. Errors name the key."""
    choices = choices or {}
    if not isinstance(values, dict):
        raise ConfigError(f"section {section!r} must be a mapping, got {values!r}", section)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown key {section}.{unknown[0]}; "
            f"valid keys in {section}: {', '.join(sorted(known))}",
            key=f"{section}.{unknown[0]}",
        )
    checked = {}
    for name, value in values.items():
        key = f"{section}.{name}"
        checked[name] = check_type(value, hints[name], key)
        if isinstance(checked[name], float) and not math.isfinite(checked[name]):
            raise ConfigError(f"{key} must be a finite number, got {checked[name]}", key=key)
        if key in choices and checked[name] not in choices[key]:
            options = ", ".join(str(c).lower() for c in choices[key])
            raise ConfigError(f"{key}: {value!r} is not one of {options}")
    return cls(**checked)
