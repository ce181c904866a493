"""The report page: tables, figures written beside it, the HTML, and ``main``."""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from simdist.plots import (
    MatplotlibMissing,
    Plot,
    render,
    require_matplotlib,
)
from simdist.report.figures import (
    build_plots,
)
from simdist.report.inputs import (
    PlanData,
    ReportError,
    RunData,
    _unique_labels,
    device_memory,
    load_input,
    plan_devices,
    plan_layout,
    sim_breakdown,
    sim_samples_per_sec,
)

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
        prog="python -m simdist.report", description="An HTML page of plots for runs and plans."
    )
    ap.add_argument("paths", nargs="+", metavar="PATH", help="model_dir(s) and plan JSON file(s)")
    ap.add_argument(
        "--out", default="report", metavar="DIR", help="output folder (default: report)"
    )
    ap.add_argument("--title", default="simdist report")
    args = ap.parse_args(argv)
    out = Path(args.out)
    # checked before anything is read or written: mkdir would raise FileExistsError mid-way
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        print(
            f"simdist.report: error: --out {out}: {blocker} is an existing file, but --out is "
            "the folder the page and figures go in; give a folder (new or existing)",
            file=sys.stderr,
        )
        return 2
    try:
        paths = list(dict.fromkeys(Path(p) for p in args.paths))
        inputs = [load_input(p) for p in paths]
        for item, label in zip(inputs, _unique_labels(paths), strict=True):
            item.label = label
        runs = [x for x in inputs if isinstance(x, RunData)]
        plans = [x for x in inputs if isinstance(x, PlanData)]
        require_matplotlib()  # before anything is written
        path = write_report(runs, plans, out, args.title)
    except (ReportError, MatplotlibMissing) as e:
        print(f"simdist.report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
