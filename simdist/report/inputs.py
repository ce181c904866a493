"""Reading what a report draws: a run's ``model_dir`` or a plan's JSON, and the figures
both need from them (simulated samples/s, step breakdown, device memory)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from simdist.events import EventFileError, read_events


class ReportError(ValueError):
    """Bad input: the message names the path and what is wrong with it."""


# -- reading runs ------------------------------------------------------------------------------

_LOG_LOSS = re.compile(r"global_step = (\d+), loss = ([^,\s]+)")
_LOG_EVAL = re.compile(r"eval: accuracy = ([^,\s]+), loss = ([^,\s]+)")


@dataclass
class RunData:
    path: Path
    perf: dict[str, Any]
    params: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    scalars_from: str = ""  # "events" | "run.log" | ""
    notes: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def world(self) -> int:
        return int(self.perf.get("world_size") or 1)

    @property
    def model(self) -> dict[str, Any]:
        """What identifies the model: the params' model section, else the parameter count."""
        if self.params and isinstance(self.params.get("model"), dict):
            return self.params["model"]
        return {"parameters": self.perf.get("parameters")}

    @property
    def model_label(self) -> str:
        m = self.model
        name = str(m.get("preset") or m.get("name") or "model")
        if m.get("hidden_sizes"):
            name += " " + "-".join(str(h) for h in m["hidden_sizes"])
        n = self.perf.get("parameters")
        return f"{name} ({n:,} parameters)" if isinstance(n, int) else name

    @property
    def profile(self) -> str:
        return str(self.perf.get("device_profile") or _streaming_profile(self.perf) or "?")


def _streaming_profile(perf: dict[str, Any]) -> str | None:
    mem = perf.get("device_memory")
    if isinstance(mem, list) and mem and isinstance(mem[0], dict):
        return mem[0].get("profile")
    return None


def _event_file_order(path: Path) -> tuple[int, str]:
    # events.out.tfevents.<unix time>.<host>[...]: a resumed run's file sorts after the first
    parts = path.name.split(".")
    stamp = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
    return stamp, path.name


def read_scalars(model_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], str, list[str]]:
    """{tag: [(step, value)]} sorted by step, where they came from, and notes.

    All event files are merged (a resumed run adds one); where two record the same step of
    a tag, the later file wins, as TensorBoard shows it. Without readable event files the
    loss is parsed from run.log's ``global_step = N, loss = X`` lines.
    """
    notes: list[str] = []
    merged: dict[str, dict[int, float]] = {}
    files = sorted(model_dir.glob("events.out.tfevents.*"), key=_event_file_order)
    for f in files:
        try:
            for step, tag, value in read_events(f):
                merged.setdefault(tag, {})[step] = value
        except (EventFileError, OSError) as e:
            notes.append(f"{f.name} unreadable ({e}); its scalars are left out")
    source = "events" if merged else ""
    log = model_dir / "run.log"
    if not merged and log.is_file():
        for line in log.read_text(errors="replace").splitlines():
            m = _LOG_LOSS.search(line)
            if m:
                merged.setdefault("loss", {})[int(m.group(1))] = float(m.group(2))
        if merged:
            source = "run.log"
            notes.append("no readable event file: the loss comes from run.log")
    return {t: sorted(v.items()) for t, v in merged.items()}, source, notes


def load_run(path: Path) -> RunData:
    perf_path = path / "performance.json"
    if not perf_path.is_file():
        raise ReportError(
            f"{path}: a model_dir without performance.json (the run did not finish training, "
            "or this is not a model_dir)"
        )
    perf = _read_json(perf_path)
    if not isinstance(perf, dict) or "samples_per_sec" not in perf:
        raise ReportError(f"{perf_path}: not a simdist performance.json (no samples_per_sec)")
    run = RunData(path=path, perf=perf)
    params = path / "params.yaml"
    if params.is_file():
        try:
            loaded = yaml.safe_load(params.read_text())
            run.params = loaded if isinstance(loaded, dict) else None
        except yaml.YAMLError as e:
            run.notes.append(f"params.yaml unreadable ({e})")
    ev = path / "eval.json"
    if ev.is_file():
        loaded = _read_json(ev)
        run.eval = loaded if isinstance(loaded, dict) else None
    elif (path / "run.log").is_file():  # older runs: the eval line of run.log
        for line in (path / "run.log").read_text(errors="replace").splitlines():
            m = _LOG_EVAL.search(line)
            if m:
                run.eval = {"accuracy": float(m.group(1)), "loss": float(m.group(2))}
    run.scalars, run.scalars_from, notes = read_scalars(path)
    run.notes += notes
    return run


# -- what a run's performance.json says (pipelined and weight-streaming runs) ------------------


def sim_samples_per_sec(perf: dict[str, Any]) -> tuple[float | None, str]:
    if perf.get("est_samples_per_sec"):
        return float(perf["est_samples_per_sec"]), "est_samples_per_sec"
    step, gb = perf.get("simulated_step_time_s"), perf.get("global_batch_size")
    if step and gb:  # older weight-streaming runs recorded the step only
        return gb / step, "global_batch_size/simulated_step_time_s"
    return None, ""


def sim_breakdown(perf: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """Simulated step parts in seconds: compute / exposed communication / other."""
    b = perf.get("est_step_time_breakdown_s")
    if isinstance(b, dict) and "compute" in b:  # every mode writes it (simdist.device.estimate)
        out = {
            "compute": (float(b.get("compute", 0.0)), "est_step_time_breakdown_s.compute"),
            "exposed communication": (
                float(b.get("exposed_comm", 0.0)),
                "est_step_time_breakdown_s.exposed_comm",
            ),
        }
        if "bubble" in b:  # a pipeline's critical stage idling on the others
            out["pipeline bubble"] = (float(b["bubble"]), "est_step_time_breakdown_s.bubble")
        out["other"] = (float(b.get("other", 0.0)), "est_step_time_breakdown_s.other")
        return out
    step = perf.get("simulated_step_time_s")
    if step:  # older weight-streaming runs: compute, exposed streaming, the rest of the step
        compute = float(perf.get("simulated_compute_s_per_step") or 0.0)
        comm = float(perf.get("exposed_streaming_time_s") or 0.0)
        return {
            "compute": (compute, "simulated_compute_s_per_step"),
            "exposed communication": (comm, "exposed_streaming_time_s"),
            "other": (
                max(0.0, step - compute - comm),
                "simulated_step_time_s-simulated_compute_s_per_step-exposed_streaming_time_s",
            ),
        }
    return {}


def measured_step(perf: dict[str, Any]) -> tuple[float | None, str]:
    for key in ("measured_step_time_s", "step_time_s"):
        if perf.get(key):
            return float(perf[key]), key
    return None, ""


def device_memory(perf: dict[str, Any]) -> tuple[dict[str, int], int | None, str]:
    """(bytes by category at the peak, capacity, source key) of rank 0's device."""
    rank0 = perf.get("device_memory_rank0")
    if isinstance(rank0, dict) and isinstance(rank0.get("peak_breakdown_bytes"), dict):
        return (
            dict(rank0["peak_breakdown_bytes"]),
            perf.get("device_memory_capacity_bytes") or rank0.get("capacity_bytes"),
            "device_memory_rank0.peak_breakdown_bytes",
        )
    devs = perf.get("device_memory")
    if isinstance(devs, list) and devs and isinstance(devs[0].get("peak_breakdown_bytes"), dict):
        return (
            dict(devs[0]["peak_breakdown_bytes"]),
            perf.get("device_capacity_bytes") or devs[0].get("capacity_bytes"),
            "device_memory.0.peak_breakdown_bytes",
        )
    peaks = perf.get("device_memory_peak_bytes")
    if isinstance(peaks, dict):
        cats = {k: v for k, v in peaks.items() if k != "total"}
        return cats, perf.get("device_memory_capacity_bytes"), "device_memory_peak_bytes"
    return {}, None, ""


# -- reading plans -------------------------------------------------------------------------------


def _is_plan_result(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("config"), dict)
        and any(k in obj for k in ("memory_bytes", "step_s", "samples_per_s"))
    )


def _collect_plans(obj: Any, where: str, out: dict[str, list[dict]], depth: int = 0) -> None:
    """Every plan result in ``obj`` by where it sits: a list keeps its (ranked) order.

    Unknown keys are walked, not rejected, so a search result that wraps its ranked list in
    an object with other fields (constraints, timings) reads as well as a bare plan.
    """
    if depth > 5:
        return
    if _is_plan_result(obj):
        out.setdefault(where, []).append(obj)
    elif isinstance(obj, list):
        for item in obj:
            _collect_plans(item, where, out, depth + 1)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, dict | list):
                _collect_plans(value, f"{where}.{key}" if where else str(key), out, depth + 1)


@dataclass
class PlanData:
    path: Path
    groups: dict[str, list[dict[str, Any]]]  # where in the file -> configurations, ranked
    label: str = ""

    @property
    def results(self) -> list[dict[str, Any]]:
        return [r for g in self.groups.values() for r in g]


def load_plan(path: Path, data: Any) -> PlanData:
    groups: dict[str, list[dict]] = {}
    _collect_plans(data, "", groups)
    if not groups:
        raise ReportError(
            f"{path}: no plan configuration in this JSON (expected the output of "
            "`python -m simdist.plan ... --json`: objects with config and memory_bytes), "
            "and not a model_dir"
        )
    return PlanData(path=path, groups=groups)


def plan_devices(r: dict[str, Any]) -> int:
    return int(r.get("devices") or r["config"].get("devices") or 1)


def plan_layout(r: dict[str, Any]) -> str:
    c = r["config"]
    dp = r.get("dp") or c.get("dp") or "?"
    return f"DP{dp} TP{c.get('tp', 1)} PP{c.get('pp', 1)} ZeRO-{c.get('zero', 0)}"


def plan_parts(r: dict[str, Any]) -> dict[str, tuple[float, list[str]]]:
    """A plan's step in seconds as compute / exposed communication / pipeline bubble / other,
    with the breakdown_s keys that make up each part.

    Keys ending in ``_total`` repeat a part already counted as exposed and are left out;
    what the keys do not account for of ``step_s`` is "other".
    """
    parts: dict[str, tuple[float, list[str]]] = {}

    def add(part: str, key: str, value: float) -> None:
        v, keys = parts.get(part, (0.0, []))
        parts[part] = (v + value, [*keys, key])

    for key, value in (r.get("breakdown_s") or {}).items():
        if key.endswith("_total") or not isinstance(value, int | float):
            continue
        if "bubble" in key:
            add("pipeline bubble", key, value)
        elif "comm" in key or "p2p" in key:
            add("exposed communication", key, value)
        elif "compute" in key or "optimizer" in key or "embedding" in key:
            add("compute", key, value)
        else:
            add("other", key, value)
    step = r.get("step_s")
    if step:
        rest = step - sum(v for v, _ in parts.values())
        if rest > 1e-9 * step:
            add("other", "step_s-sum", rest)
    return parts


# -- inputs --------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: unreadable JSON ({e})") from None


def load_input(path: Path) -> RunData | PlanData:
    """A model_dir (or its performance.json) or a plan JSON; anything else: ReportError."""
    if not path.exists():
        raise ReportError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / "performance.json").is_file():
            return load_run(path)
        if any(path.glob("events.out.tfevents.*")) or (path / "params.yaml").is_file():
            raise ReportError(
                f"{path}: a model_dir without performance.json (the run did not finish "
                "training; reports need what a finished run writes)"
            )
        raise ReportError(f"{path}: neither a model_dir (no performance.json) nor a plan JSON file")
    if path.name == "performance.json":
        return load_run(path.parent)
    return load_plan(path, _read_json(path))


def _unique_labels(paths: list[Path]) -> list[str]:
    """The shortest trailing path parts that tell the inputs apart."""
    for depth in range(1, 8):
        labels = ["/".join(p.resolve().parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]
