"""``python -m simdist.report``: real runs and plans in, HTML and PNGs out; every plotted
series checked against the artifact it came from (no pixels inspected).

FC-MNIST (hidden 64-32, 20 steps) is trained at 1, 2 and 4 ranks under mpiexec and planned
with ``python -m simdist.plan --json``; the report of all of them is rendered once per
module. Tests that draw need matplotlib (the ``report`` and ``test`` extras) and are
skipped without it; the input errors and the missing-matplotlib message are checked
without it.
"""

import base64
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_launch import REPO, run_mpi

from simdist import report
from simdist.events import read_events

SIZES = (1, 2, 4)
SMALL = [
    "--model.hidden_sizes=[64, 32]",
    "--runconfig.max_steps=20",
    "--runconfig.save_summary_steps=5",
    "--runconfig.progress_bar=false",
    "--eval_input.batch_size=100",
]


def _plan(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "simdist.plan", *args, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def mpl():
    """Skip (before any run is trained) where matplotlib is not installed."""
    return pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def inputs(mpl, tmp_path_factory) -> dict:
    """model_dirs at 1, 2, 4 ranks and plan JSON files (one config each, and a ranked list)."""
    base = tmp_path_factory.mktemp("report_inputs")
    runs = {}
    for n in SIZES:
        d = base / f"fc_np{n}"
        proc = run_mpi(n, ["-m", "simdist.train", *SMALL, f"--runconfig.model_dir={d}"], 240)
        assert proc.returncode == 0, proc.stdout
        runs[n] = d
    plans = {}
    for n in (8, 64):
        plans[n] = base / f"plan_gpt2_{n}.json"
        plans[n].write_text(
            json.dumps(_plan("--model", "gpt2", "--devices", str(n), "--zero", "1"))
        )
    # a search-shaped file: a ranked list wrapped with fields the reader has never seen
    ranked = [
        _plan("--model", "gpt2", "--devices", "16", "--zero", z, "--batch", "4") for z in "210"
    ]
    search = base / "search.json"
    search.write_text(json.dumps({"query": {"devices": 16}, "elapsed_s": 0.1, "ranked": ranked}))
    return {"runs": runs, "plans": plans, "search": search, "ranked": ranked}


@pytest.fixture(scope="module")
def rendered(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report_out")
    paths = [*inputs["runs"].values(), *inputs["plans"].values(), inputs["search"]]
    assert report.main([*map(str, paths), "--out", str(out)]) == 0
    return out


def _plot(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def _series(plot: dict, label: str, panel: int = 0) -> dict:
    found = [s for s in plot["panels"][panel]["series"] if s["label"] == label]
    assert len(found) == 1, (label, [s["label"] for s in plot["panels"][panel]["series"]])
    return found[0]


def _perf(d: Path) -> dict:
    return json.loads((d / "performance.json").read_text())


def test_html_and_every_png_exist_and_match(rendered):
    index = json.loads((rendered / "report.json").read_text())
    page = (rendered / index["html"]).read_text()
    embedded = dict(
        re.findall(r'<figure id="([^"]+)"[^>]*><img [^>]*src="data:image/png;base64,([^"]+)"', page)
    )
    expected = {"runs_loss", "runs_throughput", "runs_step", "runs_memory", "scaling_1"}
    expected |= {"plan_1", "plan_2", "plan_3", "plan_scaling_1"}
    assert set(index["plots"]) == expected
    for name, files in index["plots"].items():
        png = (rendered / files["png"]).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000, name
        assert (rendered / files["json"]).stat().st_size > 0
        assert base64.b64decode(embedded[name]) == png, f"{name}: HTML embeds another image"


def test_png_is_drawn_from_its_json_alone(rendered, tmp_path):
    """Re-drawing each figure from its JSON gives the same PNG, byte for byte, and the
    artists hold exactly the JSON's numbers: the JSON is what was plotted."""
    from simdist.plots import draw, load_plot, render

    for png in sorted(rendered.glob("*.png")):
        plot = load_plot(png.with_suffix(".json"))
        again, _ = render(plot, tmp_path)
        assert again.read_bytes() == png.read_bytes(), png.name
        fig, artists = draw(plot)
        for p, panel in enumerate(plot.panels):
            ax = fig.axes[p]
            ticks = [t.get_text() for t in ax.get_xticklabels()]
            for s, series in enumerate(panel.series):
                art = artists[(p, s)]
                if series.kind in ("line", "points"):
                    assert list(art.get_xdata()) == series.x, (png.name, series.label)
                    assert list(art.get_ydata()) == series.y, (png.name, series.label)
                elif series.kind == "bar":
                    # (matplotlib keeps a stacked bar as its two edges: height to 1 ulp)
                    heights = [b.get_height() for b in art.patches]
                    assert heights == pytest.approx(series.y, rel=1e-12, abs=0)
                    centres = [b.get_x() + b.get_width() / 2 for b in art.patches]
                    assert [ticks[round(c)] for c in centres] == [str(x) for x in series.x]
                elif series.kind == "hline" and hasattr(art, "get_ydata"):
                    assert list(art.get_ydata()) == [series.y[0]] * 2
                elif series.kind == "hline":  # off scale: written as a note with its value
                    assert f"{series.y[0]:,.0f}" in art.get_text()


def test_run_series_equal_their_artifacts(inputs, rendered):
    runs = inputs["runs"]
    labels = {n: d.name for n, d in runs.items()}
    loss = _plot(rendered, "runs_loss")
    for n, d in runs.items():
        (events,) = d.glob("events.out.tfevents.*")
        points = [(s, v) for s, tag, v in read_events(events) if tag == "loss"]
        assert len(points) == 4  # steps 5, 10, 15, 20
        s = _series(loss, labels[n])
        assert list(zip(s["x"], s["y"], strict=True)) == points
        ev = json.loads((d / "eval.json").read_text())
        v = _series(loss, f"{labels[n]}: validation loss")
        assert v["x"] == [ev["global_step"]] and v["y"] == [ev["loss"]]
    lr = _series(loss, labels[1], panel=1)
    assert lr["y"] == [pytest.approx(1e-3)] * 4

    order = [labels[n] for n in SIZES]
    perfs = [_perf(runs[n]) for n in SIZES]
    thr = _plot(rendered, "runs_throughput")
    measured = _series(thr, "measured (training wall time)")
    assert measured["x"] == order and measured["y"] == [p["samples_per_sec"] for p in perfs]
    steps = _series(thr, "measured (steps only)")
    assert steps["y"] == [p["global_batch_size"] / p["measured_step_time_s"] for p in perfs]
    sim = _series(thr, "simulated")
    assert sim["x"] == order and sim["y"] == [p["est_samples_per_sec"] for p in perfs]

    step = _plot(rendered, "runs_step")
    for label, key in (
        ("compute", "compute"),
        ("exposed communication", "exposed_comm"),
        ("other", "other"),
    ):
        s = _series(step, label)
        assert s["stack"] == "sim" and s["scale"] == 1e-3
        assert s["y"] == [1e3 * p["est_step_time_breakdown_s"][key] for p in perfs]
    assert _series(step, "measured step")["y"] == [1e3 * p["measured_step_time_s"] for p in perfs]

    mem = _plot(rendered, "runs_memory")
    for s in mem["panels"][0]["series"]:
        if s["kind"] == "hline":
            assert s["y"] == [perfs[0]["device_memory_capacity_bytes"] / s["scale"]]
            continue
        peaks = [p["device_memory_rank0"]["peak_breakdown_bytes"][s["label"]] for p in perfs]
        want = [
            (lab, b / s["scale"]) for lab, b in zip(order, peaks, strict=True) if b
        ]  # zero: no bar
        assert list(zip(s["x"], s["y"], strict=True)) == want
    bars = [s for s in mem["panels"][0]["series"] if s["kind"] == "bar"]
    stacked = sum(y for s in bars for x, y in zip(s["x"], s["y"], strict=True) if x == order[0])
    assert stacked * mem["panels"][0]["series"][0]["scale"] == pytest.approx(
        perfs[0]["device_memory_rank0"]["peak_bytes"]["total"]
    )


def test_scaling_plot_of_the_three_runs(inputs, rendered):
    perfs = [_perf(inputs["runs"][n]) for n in SIZES]
    plot = _plot(rendered, "scaling_1")
    thr, eff = plot["panels"]
    assert "weak scaling: 32 samples per replica" in thr["note"]
    for label, key in (("measured", "samples_per_sec"), ("simulated", "est_samples_per_sec")):
        values = [p[key] for p in perfs]
        s = _series(plot, label)
        assert s["x"] == list(SIZES) and s["y"] == values
        e = _series(plot, label, panel=1)
        assert e["y"] == pytest.approx(
            [(v / n) / values[0] for v, n in zip(values, SIZES, strict=True)]
        )
        ideal = _series(plot, f"_{label} ideal")
        assert ideal["y"] == pytest.approx([values[0] * n for n in SIZES])


def test_pipeline_and_weight_streaming_runs_get_the_simulated_bar_and_memory(mpl, tmp_path):
    """A pipeline run (FC-MNIST at P 2) and a weight-streaming one (1 server, 2 devices):
    both write est_samples_per_sec, so the throughput plot draws their simulated bars from
    it; the step plot stacks their breakdown (the pipeline's bubble included), and the
    memory plot has each one's device (the pipeline's rank 0, the first streaming device)."""
    args = ["-m", "simdist.train", *SMALL[:1], "--runconfig.max_steps=3",
            "--runconfig.save_summary_steps=1", "--runconfig.progress_bar=false",
            "--runconfig.mode=train"]  # fmt: skip
    pp, ws = tmp_path / "pp", tmp_path / "ws"
    cases = [
        (2, pp, ["--pipeline-parallel=2", "--optimizer.grad_accum_steps=2"]),
        (3, ws, ["--execution_mode=weight_streaming", "--weight_servers=1"]),
    ]
    for n, d, extra in cases:
        proc = run_mpi(n, [*args, *extra, f"--runconfig.model_dir={d}"], 240)
        assert proc.returncode == 0, proc.stdout
    out = tmp_path / "out"
    assert report.main([str(pp), str(ws), "--out", str(out)]) == 0
    perfs = [_perf(pp), _perf(ws)]
    sim = _series(_plot(out, "runs_throughput"), "simulated")
    assert sim["x"] == ["pp", "ws"] and sim["y"] == [p["est_samples_per_sec"] for p in perfs]
    assert sim["source"] == "performance.json:est_samples_per_sec"
    step = _plot(out, "runs_step")
    for label, key in (("compute", "compute"), ("exposed communication", "exposed_comm")):
        s = _series(step, label)
        assert s["y"] == [1e3 * p["est_step_time_breakdown_s"][key] for p in perfs]
    bubble = _series(step, "pipeline bubble")
    assert bubble["x"] == ["pp"] and bubble["y"] == [
        1e3 * perfs[0]["est_step_time_breakdown_s"]["bubble"]
    ]
    mem = _plot(out, "runs_memory")
    bars = [s for p in mem["panels"] for s in p["series"] if s["kind"] == "bar"]
    assert {x for s in bars for x in s["x"]} == {"pp", "ws"}
    for label, want in (
        ("pp", perfs[0]["device_memory_rank0"]["peak_bytes"]["total"]),
        ("ws", perfs[1]["device_memory"][0]["peak_bytes"]["total"]),
    ):
        got = sum(
            y * s["scale"] for s in bars for x, y in zip(s["x"], s["y"], strict=True) if x == label
        )
        assert got == pytest.approx(want)


def test_plan_series_and_ranked_table(inputs, rendered):
    page = (rendered / "report.html").read_text()
    plans = inputs["plans"]
    for i, n in enumerate((8, 64), 1):
        r = json.loads(plans[n].read_text())
        plot = _plot(rendered, f"plan_{i}")
        mem, step = plot["panels"]
        for s in mem["series"]:
            if s["kind"] == "hline":
                assert s["y"] == [r["capacity_bytes"] / s["scale"]]
            else:
                assert s["y"] == [r["memory_bytes"][s["label"]] / s["scale"]]
        assert sum(s["y"][0] for s in step["series"]) == pytest.approx(1e3 * r["step_s"])
        compute = _series(plot, "compute", panel=1)["y"][0]
        b = r["breakdown_s"]
        parts = ("forward_compute", "backward_compute", "recompute", "head_and_embedding")
        assert compute == pytest.approx(1e3 * (sum(b[k] for k in parts) + b["optimizer"]))
    # the ranked list: one row per configuration, in the file's order
    ranked = inputs["ranked"]
    plot = _plot(rendered, "plan_3")
    cats = _series(plot, "parameters")["x"]
    assert [c.split()[0] for c in cats] == ["#1", "#2", "#3"]
    assert [f"ZeRO-{r['config']['zero']}" in c for c, r in zip(cats, ranked, strict=True)] == [
        True
    ] * 3
    assert page.count("<td>DP16 TP1 PP1 ZeRO-") == 3
    # scaling across plans: devices 8, 16 (best of the ranked three that fit), 64
    scaling = _plot(rendered, "plan_scaling_1")
    s = _series(scaling, "predicted (best that fits)")
    best16 = max(r["samples_per_s"] for r in ranked if r["fits"])
    per8, per64 = (json.loads(plans[n].read_text())["samples_per_s"] for n in (8, 64))
    assert s["x"] == [8, 16, 64] and s["y"] == [per8, best16, per64]


def test_loss_from_run_log_without_event_files(inputs, tmp_path):
    d = tmp_path / "no_events"
    shutil.copytree(inputs["runs"][2], d)
    for f in d.glob("events.out.tfevents.*"):
        f.unlink()
    assert report.main([str(d), "--out", str(tmp_path / "out")]) == 0
    logged = re.findall(r"global_step = (\d+), loss = ([\d.]+)", (d / "run.log").read_text())
    s = _series(_plot(tmp_path / "out", "runs_loss"), "no_events")
    assert s["source"] == "run.log:loss"
    assert list(zip(s["x"], s["y"], strict=True)) == [(int(a), float(b)) for a, b in logged]


def test_truncated_event_file_is_noted_not_fatal(inputs, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(inputs["runs"][1], d)
    (f,) = d.glob("events.out.tfevents.*")
    f.write_bytes(f.read_bytes()[:-7])
    assert report.main([str(d), "--out", str(tmp_path / "out")]) == 0
    assert "unreadable" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p / "missing", ["no such file"]),
        (lambda p: (p / "empty").mkdir() or p / "empty", ["neither a model_dir", "plan JSON"]),
        (lambda p: _write(p / "x.json", '{"a": [1, 2]}'), ["no plan configuration"]),
        (lambda p: _write(p / "x.json", "not json"), ["unreadable JSON"]),
        (lambda p: _unfinished(p), ["without performance.json"]),
    ],
)
def test_bad_input_is_exit_2_naming_the_path(tmp_path, capsys, make, words):
    bad = make(tmp_path)
    assert report.main([str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _unfinished(base: Path) -> Path:
    d = base / "model_dir"
    d.mkdir()
    (d / "params.yaml").write_text("model: {name: fc_mnist}\n")
    return d


@pytest.mark.parametrize("below", ["", "sub"])
def test_out_that_is_a_file_is_one_line_exit_2(mpl, tmp_path, capsys, below):
    plan = _write(tmp_path / "plan.json", json.dumps(_plan("--model", "gpt2", "--devices", "8")))
    existing = _write(tmp_path / "out.txt", "mine\n")
    out = existing / below if below else existing
    assert report.main([str(plan), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{existing} is an existing file" in err, err
    assert "--out" in err and "folder" in err
    assert existing.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [existing, plan]


def test_missing_matplotlib_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    plan = _write(tmp_path / "plan.json", json.dumps(_plan("--model", "gpt2", "--devices", "8")))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert report.main([str(plan), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install simdist[report]" in err, err


def test_validate_sim_plots_through_the_helpers(mpl, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("validate_sim", REPO / "scripts/validate_sim.py")
    vs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "validate_sim", vs)  # its dataclasses look themselves up
    spec.loader.exec_module(vs)
    rows = [
        {"kind": "step time", "predicted": 1.1, "measured": 1.0, "unit": "s", "target": 0.15},
        {"kind": "step time", "predicted": 9.0, "measured": 10.0, "unit": "s", "target": 0.15},
        {"kind": "step time", "predicted": 3.0, "measured": 2.0, "unit": "s", "oversubscribed": 1},
        {"kind": "collective", "predicted": 5.0, "measured": 5.5, "unit": "us", "target": 0.1},
    ]
    (png,) = vs._plots(rows, tmp_path)
    assert png.name == "validate_sim.png" and png.stat().st_size > 1000
    plot = _plot(tmp_path, "validate_sim")
    scored = _series(plot, "scored")
    assert scored["x"] == [1.0, 10.0] and scored["y"] == [1.1, 9.0]
    assert _series(plot, "oversubscribed")["y"] == [3.0]
    assert _series(plot, "scored", panel=1)["x"] == [5.5]
