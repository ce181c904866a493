"""The benchmarks' figures, drawn the way every simdist figure is (``simdist.plots``).

    python scripts/bench_plots.py RESULT.json [RESULT.json ...] --out DIR

Each ``RESULT.json`` is what ``bench_train.py --json`` or ``bench_collectives.py --json``
wrote (recognised by its rows); the same figures come from those scripts' own ``--plots
DIR``. Beside every PNG, ``<name>.json`` holds exactly the plotted series, each with the
row it came from (``source``), so a test can compare a figure with its benchmark's JSON.

- bench_train: samples/s of every implementation and world size, per model; DP efficiency
  at 2 ranks (simdist, PyTorch DDP, two independent runs as the machine's ceiling) against
  the 0.90 target; simdist at 1 rank over PyTorch eager against the 1.2x target.
- bench_collectives: bus bandwidth against message size per algorithm (log-log), one panel
  per operation, and simdist's best over MPI's native per size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simdist.plots import MatplotlibMissing, Panel, Plot, Series, render  # noqa: E402

DP_TARGET = 0.90  # issue #20: DP efficiency at 2 ranks
TORCH_TARGET = 1.2  # issue #20: simdist at 1 rank over PyTorch eager


def _cpu(result: dict[str, Any]) -> str:
    cpu = result.get("machine", {}).get("cpu", {})
    return str(cpu.get("model", "unknown CPU"))


def train_plot(result: dict[str, Any]) -> Plot:
    rows, summary = result["rows"], result.get("summary", [])
    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        idx = [i for i, r in enumerate(rows) if r["model"] == model]
        panels.append(
            Panel(
                f"{model}: throughput",
                "implementation, ranks",
                "samples/s",
                [
                    Series(
                        "median of repeats",
                        [f"{rows[i]['impl']} np{rows[i]['np']}" for i in idx],
                        [rows[i]["samples_per_sec"] for i in idx],
                        "bar",
                        source="rows[" + ",".join(map(str, idx)) + "].samples_per_sec",
                    )
                ],
                legend=False,
            )
        )
    models = [s["model"] for s in summary]
    eff = Panel("DP efficiency at 2 ranks", "model", "efficiency (np 2 / 2 x np 1)")
    for key, label in (
        ("dp_efficiency_np2", "simdist"),
        ("torch_ddp_efficiency_np2", "PyTorch DDP (gloo)"),
        ("ceiling_efficiency_np2", "2 independent runs (ceiling)"),
    ):
        if all(key in s for s in summary) and summary:
            eff.series.append(
                Series(label, models, [s[key] for s in summary], "bar", source=f"summary:{key}")
            )
    eff.series.append(Series(f"target {DP_TARGET}", [], [DP_TARGET], "hline", color="k"))
    panels.append(eff)
    if summary and all("vs_torch_eager_np1" in s for s in summary):
        panels.append(
            Panel(
                "simdist / PyTorch eager, 1 rank",
                "model",
                "speed-up",
                [
                    Series(
                        "simdist / torch eager",
                        models,
                        [s["vs_torch_eager_np1"] for s in summary],
                        "bar",
                        source="summary:vs_torch_eager_np1",
                    ),
                    Series(f"target {TORCH_TARGET}x", [], [TORCH_TARGET], "hline", color="k"),
                ],
            )
        )
    return Plot("bench_train", f"bench_train on {_cpu(result)}", panels, cols=3)


def collectives_plot(result: dict[str, Any]) -> Plot:
    rows = result["rows"]
    panels = []
    for op in dict.fromkeys(r["op"] for r in rows):
        panel = Panel(
            f"{op}, np {rows[0]['np']}",
            "message size (bytes)",
            "bus bandwidth (GB/s)",
            xscale="log",
            yscale="log",
        )
        for alg in dict.fromkeys(r["algorithm"] for r in rows if r["op"] == op):
            idx = [i for i, r in enumerate(rows) if r["op"] == op and r["algorithm"] == alg]
            panel.series.append(
                Series(
                    alg,
                    [rows[i]["bytes"] for i in idx],
                    [rows[i]["busbw_gbps"] for i in idx],
                    marker="o",
                    linestyle="--" if alg == "native" else None,
                    source="rows[" + ",".join(map(str, idx)) + "].busbw_gbps",
                )
            )
        panels.append(panel)
    ratios = result.get("ratios", [])
    if ratios:
        panel = Panel("best simdist / native", "message size (bytes)", "ratio", xscale="log")
        for op in dict.fromkeys(r["op"] for r in ratios):
            idx = [i for i, r in enumerate(ratios) if r["op"] == op]
            panel.series.append(
                Series(
                    op,
                    [ratios[i]["bytes"] for i in idx],
                    [ratios[i]["ratio_vs_native"] for i in idx],
                    marker="o",
                    source="ratios[" + ",".join(map(str, idx)) + "].ratio_vs_native",
                )
            )
        panel.series.append(Series("native", [], [1.0], "hline", color="k"))
        panels.append(panel)
    return Plot("bench_collectives", f"bench_collectives on {_cpu(result)}", panels, cols=2)


def plot_for(result: dict[str, Any]) -> Plot:
    rows = result.get("rows") or [{}]
    if "busbw_gbps" in rows[0]:
        return collectives_plot(result)
    if "samples_per_sec" in rows[0]:
        return train_plot(result)
    raise ValueError("not a bench_train or bench_collectives result (no rows recognised)")


def write_plots(result: dict[str, Any], directory: str | Path, suffix: str = "") -> list[Path]:
    """Render ``result``'s figure into ``directory`` (file stem + ``suffix``); [] with a
    note when matplotlib is missing."""
    plot = plot_for(result)
    plot.name += suffix
    try:
        png, _ = render(plot, directory, dpi=110)
    except MatplotlibMissing as e:
        print(f"(no plots: {e})")
        return []
    print(f"wrote {png}")
    return [png]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench_plots"))
    args = ap.parse_args(argv)
    for path in args.results:
        try:
            result = json.loads(path.read_text())
            plot_for(result)
        except (OSError, ValueError) as e:
            print(f"bench_plots: error: {path}: {e}", file=sys.stderr)
            return 2
        write_plots(result, args.out, f"-{path.stem}" if len(args.results) > 1 else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
