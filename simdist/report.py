"""``python -m simdist.report PATH... [--out DIR]``: an HTML page of plots for runs and plans.

Each PATH is a ``model_dir`` a training run left (``performance.json`` required; the loss
comes from its TensorBoard event files, else from ``run.log``; ``eval.json``,
``params.yaml`` and ``timeline.json`` are used where present) or a JSON file written by
``python -m simdist.plan ... --json`` (one configuration, or any list of them: a ranked
search result renders as a ranked table). The page, ``DIR/report.html`` (default
``report/``), embeds every PNG as a data URI so it can be mailed on its own; each figure is
also written beside it as ``<name>.png`` plus ``<name>.json``, the exact series drawn (see
``simdist.plots``), and ``report.json`` indexes the inputs and figures.

For runs: loss (and validation) curves, measured vs simulated samples/s, the simulated step
split into compute / exposed communication / other, device memory by category against the
device's capacity. Runs of one model (same ``model`` params and device profile) at two or
more world sizes also get a scaling plot: throughput and efficiency against ranks, measured
and simulated. Plans: a table of the configurations in their given (ranked) order, their
memory and step breakdown, and a scaling curve of the best configuration per device count
when the plans span several.

Exit codes: 0 done, 2 bad input (a path that is neither, a model_dir without
performance.json, unreadable JSON) or matplotlib missing (``pip install simdist[report]``).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from simdist.events import EventFileError, read_events
from simdist.plots import (
    MatplotlibMissing,
    Panel,
    Plot,
    Series,
    bytes_unit,
    render,
    require_matplotlib,
)

__all__ = ["ReportError", "RunData", "PlanData", "load_input", "build_plots", "main"]


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
    if step and gb:  # weight streaming records the step only
        return gb / step, "global_batch_size/simulated_step_time_s"
    return None, ""


def sim_breakdown(perf: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """Simulated step parts in seconds: compute / exposed communication / other."""
    b = perf.get("est_step_time_breakdown_s")
    if isinstance(b, dict):
        return {
            "compute": (float(b.get("compute", 0.0)), "est_step_time_breakdown_s.compute"),
            "exposed communication": (
                float(b.get("exposed_comm", 0.0)),
                "est_step_time_breakdown_s.exposed_comm",
            ),
            "other": (float(b.get("other", 0.0)), "est_step_time_breakdown_s.other"),
        }
    step = perf.get("simulated_step_time_s")
    if step:  # weight streaming: compute, exposed streaming, and the rest of the step
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


# -- plots ---------------------------------------------------------------------------------------


def _bar_count(panel: Panel) -> int:
    return len({x for s in panel.series if s.kind == "bar" for x in s.x})


@dataclass
class MemoryBar:
    label: str
    bytes_by_category: dict[str, int]
    capacity: int | None
    profile: str
    source: str  # "<file>:<key>" of bytes_by_category


def _memory_panels(
    bars: list[MemoryBar], title: str, xlabel: str, capacity_source: str
) -> list[Panel]:
    """Stacked bytes by category, one panel per device capacity: on a shared axis a 13 MiB
    device's bars would stand against another device's 12 GiB line."""
    order = list(dict.fromkeys(c for b in bars for c, v in b.bytes_by_category.items() if v))
    by_capacity: dict[int | None, list[MemoryBar]] = {}
    for b in bars:
        by_capacity.setdefault(b.capacity, []).append(b)
    panels = []
    for cap, group in by_capacity.items():
        top = max(sum(b.bytes_by_category.values()) for b in group)
        div, unit = bytes_unit(max(top, cap or 0) if cap and cap < 20 * top else top)
        profiles = ", ".join(sorted({b.profile for b in group}))
        panel = Panel(f"{title} ({profiles})", xlabel, unit)
        for i, cat in enumerate(order):
            pts = [
                (b.label, b.bytes_by_category[cat] / div)
                for b in group
                if b.bytes_by_category.get(cat)
            ]
            if pts:
                panel.series.append(
                    Series(
                        cat,
                        [x for x, _ in pts],
                        [y for _, y in pts],
                        kind="bar",
                        stack="mem",
                        color=f"C{i}",  # a category keeps its colour across panels
                        source=f"{group[0].source}.{cat}",
                        scale=div,
                    )
                )
        if cap:
            panel.series.append(
                Series(
                    f"capacity ({profiles})",
                    [],
                    [cap / div],
                    kind="hline",
                    scale=div,
                    source=capacity_source,
                )
            )
        panels.append(panel)
    return panels


def _run_plots(runs: list[RunData]) -> list[Plot]:
    plots: list[Plot] = []
    labels = [r.label for r in runs]

    # loss and validation
    panels = []
    loss = Panel("training loss (mean over replicas)", "global step", "loss")
    for i, r in enumerate(runs):
        color = f"C{i % 10}"  # a run's curve and its validation point share a colour
        points = r.scalars.get("loss", [])
        if points:
            loss.series.append(
                Series(
                    r.label,
                    [s for s, _ in points],
                    [v for _, v in points],
                    marker="." if len(points) < 50 else None,
                    color=color,
                    source=f"{'run.log' if r.scalars_from == 'run.log' else 'events'}:loss",
                )
            )
        if r.eval and r.eval.get("loss") is not None:
            step = r.eval.get("global_step", r.perf.get("global_step"))
            loss.series.append(
                Series(
                    f"{r.label}: validation loss",
                    [step],
                    [float(r.eval["loss"])],
                    kind="points",
                    marker="*",
                    color=color,
                    source="eval.json:loss",
                )
            )
    if loss.series:
        panels.append(loss)
    extra_tags = sorted(
        {t for r in runs for t in r.scalars} - {"loss", "samples_per_sec", "learning_rate"}
    )
    for tag in ["learning_rate", *extra_tags]:
        panel = Panel(tag.replace("_", " "), "global step", tag)
        for i, r in enumerate(runs):
            points = r.scalars.get(tag, [])
            if points:
                panel.series.append(
                    Series(
                        r.label,
                        [s for s, _ in points],
                        [v for _, v in points],
                        color=f"C{i % 10}",
                        source=f"events:{tag}",
                    )
                )
        if panel.series:
            panels.append(panel)
    if panels:
        plots.append(
            Plot(
                "runs_loss",
                "Loss and validation",
                panels,
                caption="Training loss at each summary step (TensorBoard scalars, or run.log), "
                "the held-out loss of eval.json as a star at the step it was measured.",
            )
        )

    # measured vs simulated throughput
    series = [
        Series(
            "measured (training wall time)",
            labels,
            [float(r.perf["samples_per_sec"]) for r in runs],
            kind="bar",
            source="performance.json:samples_per_sec",
        )
    ]
    steps = [
        (r.label, r.perf.get("global_batch_size"), r.perf.get("measured_step_time_s")) for r in runs
    ]
    steps = [(lab, gb / t) for lab, gb, t in steps if gb and t]
    if steps:  # the same steps the simulation covers, summaries and checkpoints left out
        series.append(
            Series(
                "measured (steps only)",
                [lab for lab, _ in steps],
                [v for _, v in steps],
                kind="bar",
                source="performance.json:global_batch_size/measured_step_time_s",
            )
        )
    sims = [(r.label, *sim_samples_per_sec(r.perf)) for r in runs]
    sims = [s for s in sims if s[1] is not None]
    if sims:
        series.append(
            Series(
                "simulated",
                [lab for lab, _, _ in sims],
                [v for _, v, _ in sims],
                kind="bar",
                source=f"performance.json:{sims[0][2]}",
            )
        )
    plots.append(
        Plot(
            "runs_throughput",
            "Measured vs simulated training throughput",
            [Panel("samples per second (all replicas)", "run", "samples/s", series)],
            cols=1,
            panel_size=(max(5.2, 1.4 * len(runs) + 2), 3.8),
            caption="Measured: samples trained / training wall time (performance.json "
            "samples_per_sec, summaries and checkpoints included), and global batch / the "
            "measured step (the steps the simulation covers, slowest rank). Simulated: global "
            "batch / the simulated device's step time on the run's device profile.",
        )
    )

    # simulated step breakdown
    step_panel = Panel("simulated step (critical path, mean per step)", "run", "ms")
    parts: dict[str, tuple[list[str], list[float], str]] = {}
    for r in runs:
        for part, (value, key) in sim_breakdown(r.perf).items():
            xs, ys, _ = parts.setdefault(part, ([], [], key))
            xs.append(r.label)
            ys.append(1e3 * value)
    for part, (xs, ys, key) in parts.items():
        step_panel.series.append(
            Series(
                part, xs, ys, kind="bar", stack="sim", source=f"performance.json:{key}", scale=1e-3
            )
        )
    mx, my, mkey = [], [], ""
    for r in runs:
        value, key = measured_step(r.perf)
        if value is not None:
            mx.append(r.label)
            my.append(1e3 * value)
            mkey = mkey or key
    if mx:
        step_panel.series.append(
            Series(
                "measured step",
                mx,
                my,
                kind="bar",
                color="0.6",
                source=f"performance.json:{mkey}",
                scale=1e-3,
            )
        )
    if step_panel.series:
        plots.append(
            Plot(
                "runs_step",
                "Where the simulated step goes",
                [step_panel],
                cols=1,
                panel_size=(max(5.2, 1.4 * len(runs) + 2), 3.8),
                caption="Simulated step of the slowest rank per step: compute, communication "
                "not hidden behind compute, and other (host time the device waits for: input "
                "and the loop itself, measured). Grey: the measured step beside it.",
            )
        )

    # device memory against capacity
    entries = []
    for r in runs:
        cats, cap, key = device_memory(r.perf)
        if cats:
            entries.append(MemoryBar(r.label, cats, cap, r.profile, f"performance.json:{key}"))
    if entries:
        panels = _memory_panels(
            entries,
            "device memory at the peak (rank 0)",
            "run",
            "performance.json:device_memory_capacity_bytes",
        )
        plots.append(
            Plot(
                "runs_memory",
                "Simulated device memory by category",
                panels,
                cols=min(3, len(panels)),
                panel_size=(max(4.5, 1.3 * max(_bar_count(p) for p in panels) + 2.5), 3.8),
                caption="Bytes per category on rank 0's simulated device at the moment its total "
                "peaked, against the device profile's capacity (one panel per capacity).",
            )
        )
    return plots


def _scaling_panels(
    sizes: list[int], curves: dict[str, tuple[list[float], str]], what: str, unit: str
) -> list[Panel]:
    """Throughput and efficiency vs size for each curve (label -> (values, source))."""
    log = max(sizes) / min(sizes) >= 8
    values = [v for vs, _ in curves.values() for v in vs if v]
    spread = max(values) / min(values) if values else 1.0  # curves apart: log y keeps both
    thr = Panel(
        f"{what} throughput",
        "ranks" if what == "training" else "devices",
        unit,
        xscale="log" if log else "linear",
        yscale="log" if log or spread > 8 else "linear",
        xticks=sizes,
    )
    eff = Panel(
        "efficiency: (throughput / size) / (throughput / size at the smallest)",
        thr.xlabel,
        "efficiency",
        xscale=thr.xscale,
        xticks=sizes,
    )
    top = 1.0
    for i, (label, (values, source)) in enumerate(curves.items()):
        xs = [n for n, v in zip(sizes, values, strict=True) if v is not None]
        ys = [v for v in values if v is not None]
        if len(xs) < 2:
            continue
        color = f"C{i}"
        thr.series.append(Series(label, xs, ys, marker="o", color=color, source=source))
        thr.series.append(
            Series(
                f"_{label} ideal",
                xs,
                [ys[0] * n / xs[0] for n in xs],
                linestyle=":",
                color=color,
                source=f"{source} (linear from the smallest size)",
            )
        )
        effs = [(y / n) / (ys[0] / xs[0]) for n, y in zip(xs, ys, strict=True)]
        top = max(top, *effs)
        eff.series.append(
            Series(
                label,
                xs,
                effs,
                marker="o",
                color=color,
                source=f"{source} (per size, / the smallest's)",
            )
        )
    eff.series.append(Series("_ideal", [], [1.0], kind="hline", color="0.5"))
    eff.ylim = (0.0, 1.1 * top)  # from zero: a 1 % loss must look like one
    return [thr, eff]


def scaling_groups(runs: list[RunData]) -> list[tuple[str, list[RunData], str]]:
    """Runs of one model and device profile at >= 2 world sizes: (title, runs, batch note);
    at a world size run more than once, the fastest measured run stands for it."""
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        key = json.dumps([r.model, r.profile], sort_keys=True, default=str)
        groups.setdefault(key, []).append(r)
    out = []
    for members in groups.values():
        best: dict[int, RunData] = {}
        for r in members:
            if (
                r.world not in best
                or r.perf["samples_per_sec"] > best[r.world].perf["samples_per_sec"]
            ):
                best[r.world] = r
        if len(best) < 2:
            continue
        chosen = [best[n] for n in sorted(best)]
        gbs = [r.perf.get("global_batch_size") for r in chosen]
        if (
            all(g is not None for g in gbs)
            and len({g / r.world for g, r in zip(gbs, chosen, strict=True)}) == 1
        ):
            note = f"weak scaling: {gbs[0] // chosen[0].world} samples per replica per step"
        elif len(set(gbs)) == 1 and gbs[0] is not None:
            note = f"strong scaling: global batch {gbs[0]} at every size"
        else:
            note = f"global batch varies: {gbs}"
        out.append((f"{chosen[0].model_label} on {chosen[0].profile}", chosen, note))
    return out


def _scaling_plots(runs: list[RunData]) -> list[Plot]:
    plots = []
    for i, (title, chosen, note) in enumerate(scaling_groups(runs)):
        sizes = [r.world for r in chosen]
        curves = {
            "measured": (
                [float(r.perf["samples_per_sec"]) for r in chosen],
                "performance.json:samples_per_sec",
            ),
            "simulated": (
                [sim_samples_per_sec(r.perf)[0] for r in chosen],
                "performance.json:est_samples_per_sec",
            ),
        }
        panels = _scaling_panels(sizes, curves, "training", "samples/s")
        panels[0].note = note
        plots.append(
            Plot(
                f"scaling_{i + 1}",
                f"Scaling: {title}",
                panels,
                caption=f"{note}. Runs: "
                + ", ".join(f"{r.label} ({r.world})" for r in chosen)
                + ". Dotted: linear scaling from the smallest size.",
            )
        )
    return plots


def _plan_label(r: dict[str, Any], rank: int, many: bool) -> str:
    head = f"#{rank} " if many else ""
    return f"{head}{plan_devices(r)} dev {plan_layout(r)}"


TOP_PLOTTED = 12  # configurations per plan figure (the table lists all)


def _plan_plots(plans: list[PlanData]) -> list[Plot]:
    plots: list[Plot] = []
    for i, plan in enumerate(plans):
        shown: list[tuple[str, dict]] = []
        for where, results in plan.groups.items():
            many = len(results) > 1
            for rank, r in enumerate(results[:TOP_PLOTTED], 1):
                prefix = f"{where}: " if len(plan.groups) > 1 and where else ""
                shown.append((prefix + _plan_label(r, rank, many), r))
        size = (max(5.2, 1.2 * len(shown) + 2.5), 4.2)
        mem = [
            MemoryBar(
                lab,
                r["memory_bytes"],
                r.get("capacity_bytes"),
                str(r.get("profile")),
                "plan:memory_bytes",
            )
            for lab, r in shown
            if isinstance(r.get("memory_bytes"), dict)
        ]
        panels = (
            _memory_panels(mem, "memory per device", "configuration", "plan:capacity_bytes")
            if mem
            else []
        )
        step = Panel("predicted step", "configuration", "ms")
        parts: dict[str, tuple[list[str], list[float]]] = {}
        for lab, r in shown:
            for part, (value, _) in plan_parts(r).items():
                xs, ys = parts.setdefault(part, ([], []))
                xs.append(lab)
                ys.append(1e3 * value)
        for part, (xs, ys) in parts.items():
            if not any(ys):
                continue
            step.series.append(
                Series(
                    part, xs, ys, kind="bar", stack="step", source="plan:breakdown_s", scale=1e-3
                )
            )
        if step.series:
            panels.append(step)
        if panels:
            plots.append(
                Plot(
                    f"plan_{i + 1}",
                    f"Plan: {plan.label}",
                    panels,
                    cols=1,
                    panel_size=size,
                    caption="Memory per device by category against the profile's capacity, and "
                    "the predicted step split into compute, exposed communication, pipeline "
                    "bubble and other (the plan's breakdown_s)"
                    + (
                        f"; the first {TOP_PLOTTED} configurations of each list"
                        if any(len(g) > TOP_PLOTTED for g in plan.groups.values())
                        else ""
                    )
                    + ".",
                )
            )

    # scaling across plans: the fastest configuration that fits at each device count
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for plan in plans:
        for r in plan.results:
            if r.get("fits") is False or not r.get("samples_per_s"):
                continue
            key = (str(r.get("model") or r["config"].get("model")), str(r.get("profile")))
            best = groups.setdefault(key, {})
            n = plan_devices(r)
            if n not in best or r["samples_per_s"] > best[n]["samples_per_s"]:
                best[n] = r
    scaling = [(key, best) for key, best in sorted(groups.items()) if len(best) >= 2]
    for j, ((model, profile), best) in enumerate(scaling):
        sizes = sorted(best)
        curves = {
            "predicted (best that fits)": (
                [best[n]["samples_per_s"] for n in sizes],
                "plan:samples_per_s",
            )
        }
        panels = _scaling_panels(sizes, curves, "predicted", "samples/s")
        gbs = [best[n].get("global_batch") for n in sizes]
        if len(set(gbs)) == 1:
            panels[0].note = f"global batch {gbs[0]} at every size (strong scaling)"
        elif None not in gbs and len({g / n for g, n in zip(gbs, sizes, strict=True)}) == 1:
            panels[0].note = f"{gbs[0] // sizes[0]} samples per device (weak scaling)"
        else:
            panels[0].note = "global batch: " + ", ".join(f"{g}" for g in gbs)
        plots.append(
            Plot(
                f"plan_scaling_{j + 1}",
                f"Predicted scaling: {model} on {profile}",
                panels,
                caption="Per device count, the fastest planned configuration that fits: "
                + "; ".join(f"{n}: {plan_layout(best[n])}" for n in sizes)
                + ".",
            )
        )
    return plots


def build_plots(runs: list[RunData], plans: list[PlanData]) -> list[Plot]:
    plots: list[Plot] = []
    if runs:
        plots += _run_plots(runs)
        plots += _scaling_plots(runs)
    if plans:
        plots += _plan_plots(plans)
    return plots


# -- HTML ----------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return format(v, spec)
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _run_table(runs: list[RunData]) -> str:
    rows = []
    for r in runs:
        p = r.perf
        sim, _ = sim_samples_per_sec(p)
        parts = sim_breakdown(p)
        cats, cap, _ = device_memory(p)
        loss = r.scalars.get("loss")
        rows.append(
            [
                r.label,
                r.model_label,
                r.world,
                r.profile,
                p.get("steps"),
                p.get("global_batch_size"),
                p.get("samples_per_sec"),
                sim,
                sim / p["samples_per_sec"] if sim and p.get("samples_per_sec") else None,
                " / ".join(f"{1e3 * v:.3g}" for v, _ in parts.values()) if parts else None,
                f"{sum(cats.values()) / 2**20:,.1f} / {cap / 2**20:,.0f}" if cats and cap else None,
                loss[-1][1] if loss else None,
                (r.eval or {}).get("loss"),
                (r.eval or {}).get("accuracy"),
            ]
        )
    header = [
        "run",
        "model",
        "ranks",
        "profile",
        "steps",
        "global batch",
        "measured samples/s",
        "simulated samples/s",
        "simulated / measured",
        "simulated step ms: compute / comm / other",
        "device peak / capacity MiB",
        "final loss",
        "validation loss",
        "validation accuracy",
    ]
    return _table(header, rows)


def _plan_tables(plan: PlanData) -> str:
    out = []
    for where, results in plan.groups.items():
        rows = []
        for rank, r in enumerate(results, 1):
            c = r["config"]
            mem = r.get("total_bytes") or sum((r.get("memory_bytes") or {}).values()) or None
            rows.append(
                [
                    r.get("rank", rank),
                    r.get("model") or c.get("model"),
                    plan_devices(r),
                    plan_layout(r),
                    c.get("micro_batch") or c.get("batch"),
                    r.get("micro_batches"),
                    r.get("global_batch"),
                    c.get("recompute"),
                    c.get("precision"),
                    1e3 * r["step_s"] if r.get("step_s") else None,
                    r.get("samples_per_s"),
                    r.get("tokens_per_s"),
                    100 * r["mfu"] if r.get("mfu") else None,
                    mem / 1e9 if mem else None,
                    r["capacity_bytes"] / 1e9 if r.get("capacity_bytes") else None,
                    r.get("fits"),
                ]
            )
        header = [
            "rank",
            "model",
            "devices",
            "layout",
            "micro-batch",
            "micro-batches",
            "global batch",
            "recompute",
            "precision",
            "step ms",
            "samples/s",
            "tokens/s",
            "MFU %",
            "memory GB",
            "capacity GB",
            "fits",
        ]
        title = f"<h3>{html.escape(where)}</h3>" if where else ""
        out.append(title + _table(header, rows))
        notes = results[0].get("notes") or []
        if notes:
            items = "".join(f"<li>{html.escape(str(n))}</li>" for n in notes)
            out.append(f"<details><summary>notes of rank 1</summary><ul>{items}</ul></details>")
    return "\n".join(out)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; }
th { background: #f2f2f2; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1em 0 2em; } figcaption { font-size: 0.85em; color: #555; max-width: 70em; }
img { max-width: 100%; border: 1px solid #eee; } code { background: #f6f6f6; }
"""


def _figure(plot: Plot, png: Path, data: Path) -> str:
    uri = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")
    return (
        f'<figure id="{html.escape(plot.name)}" data-json="{html.escape(data.name)}">'
        f'<img alt="{html.escape(plot.title)}" src="{uri}">'
        f"<figcaption>{html.escape(plot.caption)} Data: <code>{html.escape(data.name)}</code>"
        "</figcaption></figure>"
    )


def write_report(
    runs: list[RunData], plans: list[PlanData], out: Path, title: str = "simdist report"
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plots = build_plots(runs, plans)
    rendered = {p.name: render(p, out) for p in plots}
    figs = {name: _figure(p, *rendered[name]) for name, p in ((p.name, p) for p in plots)}
    parts = [f"<h1>{html.escape(title)}</h1>"]
    parts.append(
        f"<p>Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by "
        "<code>python -m simdist.report</code> from: "
        + ", ".join(f"<code>{html.escape(str(x.path))}</code>" for x in [*runs, *plans])
        + "</p>"
    )
    if runs:
        parts.append("<h2>Runs</h2>" + _run_table(runs))
        notes = [(r.label, n) for r in runs for n in r.notes]
        notes += [
            (r.label, f"timeline {r.path / 'timeline.json'} (Chrome trace: open in Perfetto)")
            for r in runs
            if (r.path / "timeline.json").is_file()
        ]
        if notes:
            parts.append(
                "<ul>" + "".join(f"<li>{html.escape(f'{a}: {n}')}</li>" for a, n in notes) + "</ul>"
            )
        for name in ("runs_loss", "runs_throughput", "runs_step", "runs_memory"):
            if name in figs:
                parts.append(figs[name])
        scaling = [n for n in figs if n.startswith("scaling_")]
        if scaling:
            parts.append("<h2>Scaling</h2>" + "".join(figs[n] for n in scaling))
    for i, plan in enumerate(plans):
        parts.append(f"<h2>Plan: {html.escape(plan.label)}</h2>" + _plan_tables(plan))
        if f"plan_{i + 1}" in figs:
            parts.append(figs[f"plan_{i + 1}"])
    plan_scaling = [n for n in figs if n.startswith("plan_scaling_")]
    if plan_scaling:
        parts.append("<h2>Predicted scaling</h2>" + "".join(figs[n] for n in plan_scaling))
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>'
        f"{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )
    path = out / "report.html"
    path.write_text(page)
    index = {
        "runs": {r.label: str(r.path) for r in runs},
        "plans": {p.label: str(p.path) for p in plans},
        "plots": {
            name: {"png": png.name, "json": data.name} for name, (png, data) in rendered.items()
        },
        "html": path.name,
    }
    (out / "report.json").write_text(json.dumps(index, indent=1))
    return path


# -- CLI -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m simdist.report", description=__doc__.split("\n")[0]
    )
    ap.add_argument("paths", nargs="+", metavar="PATH", help="model_dir(s) and plan JSON file(s)")
    ap.add_argument(
        "--out", default="report", metavar="DIR", help="output folder (default: report)"
    )
    ap.add_argument("--title", default="simdist report")
    args = ap.parse_args(argv)
    try:
        paths = list(dict.fromkeys(Path(p) for p in args.paths))
        inputs = [load_input(p) for p in paths]
        for item, label in zip(inputs, _unique_labels(paths), strict=True):
            item.label = label
        runs = [x for x in inputs if isinstance(x, RunData)]
        plans = [x for x in inputs if isinstance(x, PlanData)]
        require_matplotlib()  # before anything is written
        path = write_report(runs, plans, Path(args.out), args.title)
    except (ReportError, MatplotlibMissing) as e:
        print(f"simdist.report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
