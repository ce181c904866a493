"""The report's figures as data (``simdist.plots.Plot``): runs, scaling sets and plans."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from simdist.plots import (
    Panel,
    Plot,
    Series,
    bytes_unit,
)
from simdist.report.inputs import (
    PlanData,
    RunData,
    device_memory,
    measured_step,
    plan_devices,
    plan_layout,
    plan_parts,
    sim_breakdown,
    sim_samples_per_sec,
)

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
                "not hidden behind compute (weight streaming: weights in, gradients out), a "
                "pipeline's bubble (its busiest stage idle, waiting on the others) and other "
                "(host time the device waits for: input and the loop itself, measured). "
                "Grey: the measured step beside it.",
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
