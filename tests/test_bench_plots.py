"""The benchmarks' figures (scripts/bench_plots.py): every plotted value is the benchmark
JSON's, traced through each series' ``source``; no pixels are inspected."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from mpi_launch import run_mpi

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def bench_plots(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_plots", SCRIPTS / "bench_plots.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_plots", mod)
    spec.loader.exec_module(mod)
    return mod


def traced(result: dict, source: str) -> list:
    """The values ``source`` (``rows[3,4].busbw_gbps`` or ``summary:key``) names."""
    m = re.fullmatch(r"(\w+)\[([\d,]+)\]\.(\w+)", source)
    if m:
        table, idx, key = m.groups()
        return [result[table][int(i)][key] for i in idx.split(",")]
    table, key = source.split(":")
    return [r[key] for r in result[table]]


def check_series(plot: dict, result: dict) -> int:
    n = 0
    for panel in plot["panels"]:
        for s in panel["series"]:
            if s["kind"] == "hline":
                continue
            assert s["source"], s["label"]
            assert s["y"] == traced(result, s["source"]), (panel["title"], s["label"])
            n += 1
    return n


def test_bench_collectives_plots_its_rows(tmp_path):
    pytest.importorskip("matplotlib")
    out, figs = tmp_path / "bc.json", tmp_path / "plots"
    args = [str(SCRIPTS / "bench_collectives.py"), "--ops", "allreduce,allgather"]
    args += ["--min", "4K", "--max", "64K", "--rounds", "2", "--json", str(out)]
    proc = run_mpi(2, [*args, "--plots", str(figs)], timeout=240)
    assert proc.returncode == 0, proc.stdout
    result = json.loads(out.read_text())
    png, data = figs / "bench_collectives.png", figs / "bench_collectives.json"
    assert png.stat().st_size > 0
    plot = json.loads(data.read_text())
    algorithms = {r["algorithm"] for r in result["rows"]}
    # one line per (op, algorithm), plus the ratio panel's line per op
    assert check_series(plot, result) == 2 * len(algorithms) + 2
    assert [p["title"] for p in plot["panels"]][:2] == ["allreduce, np 2", "allgather, np 2"]
    sizes = plot["panels"][0]["series"][0]["x"]
    assert sizes == [4096, 16384, 65536]


def test_bench_train_plot_maps_rows_and_summary(bench_plots, tmp_path):
    """The figure of a bench_train result (its JSON layout): throughput per model, the DP
    efficiencies and the speed-up over PyTorch, each value traced to its row."""
    rows, summary = [], []
    for m, model in enumerate(("fc_mnist", "gpt2-mini")):
        for k, (impl, n) in enumerate((("simdist", 1), ("simdist", 2), ("torch-eager", 1))):
            rows.append({"impl": impl, "model": model, "np": n, "samples_per_sec": 100.0 * m + k})
        summary.append(
            {
                "model": model,
                "dp_efficiency_np2": 0.9 + m / 100,
                "torch_ddp_efficiency_np2": 0.8,
                "ceiling_efficiency_np2": 0.99,
                "vs_torch_eager_np1": 1.1 + m,
            }  # fmt: skip
        )
    result = {"machine": {"cpu": {"model": "test CPU"}}, "rows": rows, "summary": summary}
    plot = bench_plots.plot_for(result)
    assert plot.name == "bench_train" and "test CPU" in plot.title
    d = plot.to_dict()
    assert check_series(d, result) == 2 + 3 + 1
    hlines = [s["y"][0] for p in d["panels"] for s in p["series"] if s["kind"] == "hline"]
    assert hlines == [bench_plots.DP_TARGET, bench_plots.TORCH_TARGET]
    with pytest.raises(ValueError, match="not a bench_train or bench_collectives"):
        bench_plots.plot_for({"rows": [{"x": 1}]})
