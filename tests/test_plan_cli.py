"""Plan mode's command line: how --model resolves, flag ranges, layouts the search refuses,
and the plain-CLI manners (a closed pipe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from simdist.plan import main

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _plan_cli(args: list[str], cwd: os.PathLike | str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simdist.plan", *args],
        cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


# -- --model: presets from the package, files by path ------------------------------------------


def test_files_in_the_cwd_named_like_presets_do_not_shadow_them(tmp_path, monkeypatch):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2-mini").write_text("x: 1\n")
    # a fresh interpreter in that directory: import (and --help) read nothing from the cwd
    run = _plan_cli(["--help"], tmp_path)
    assert run.returncode == 0 and "./NAME" in run.stdout, run.stderr
    run = _plan_cli(["--model", "gpt2", "--json"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["model"] == "gpt2"
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "gpt2-mini", "--json"]) == 0
    # the file is read when named as a path, and its error names it
    assert main(["--model", "./gpt2-mini"]) == 2


def test_path_rule_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel").write_text("layers: 1\n")
    assert main(["--model", "mymodel"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'mymodel'" in err and "./mymodel" in err
    assert main(["--model", "gpt2/"]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- flag ranges ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("--tp", "0", "an integer >= 1"),
        ("--pp", "0", "an integer >= 1"),
        ("--micro-batch", "0", "an integer >= 1"),
        ("--seq", "0", "an integer >= 1"),
        ("--seq", "-5", "an integer >= 1"),
        ("--interleave", "0", "an integer >= 1"),
        ("--devices-per-node", "0", "an integer >= 1"),
        ("--batch", "0", "an integer >= 1"),
        ("--top", "0", "an integer >= 1"),
        ("--top", "-1", "an integer >= 1"),
        ("--max-tp", "0", "an integer >= 1"),
        ("--prefetch-depth", "-1", "an integer >= 0"),
        ("--bucket-mb", "-1", "a number > 0"),
        ("--bucket-mb", "0", "a number > 0"),
        ("--params-count", "-5", "a whole number >= 1"),
        ("--params-count", "1.5", "a whole number >= 1"),
    ],
)
def test_out_of_range_flags_are_refused_by_name(capsys, flag, value, allowed):
    model = [] if flag == "--params-count" else ["--model", "gpt2-mini"]
    with pytest.raises(SystemExit) as exc:
        main([*model, flag, value])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"argument {flag}: expected {allowed}, got '{value}'" in lines[0]


def test_params_count_and_model_exclude_each_other(capsys):
    for extra in (["--model", "gpt2-mini"], ["--model.layers=2"]):
        with pytest.raises(SystemExit) as exc:
            main(["--params-count", "1e9", *extra])
        assert exc.value.code == 2
        out, err = capsys.readouterr()
        assert out == "" and "--params-count: not with --model" in err
    assert main(["--params-count", "1.5e9", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == 1_500_000_000


# -- layouts the search refuses ---------------------------------------------------------------


HEADS = "does not divide gpt2-mini's 4 attention heads"


@pytest.mark.parametrize(
    "args, why",
    [
        (["--model", "gpt2-mini", "--devices", "8", "--tp", "8"], HEADS),
        (["--model", "gpt2-mini", "--devices", "3", "--tp", "3"], HEADS),
        (["--model", "gpt3-175b", "--devices", "16", "--tp", "16", "--devices-per-node", "8"],
         "tp 16 exceeds 8 devices per node"),
        (["--model", "fc-mnist", "--devices", "2", "--tp", "2"], "fc-mnist is not one"),
    ],
)  # fmt: skip
def test_single_plan_refuses_what_the_search_refuses(capsys, args, why):
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --tp: ") and why in err
    assert main([*args, "--search"]) == 2  # the search names the same rule
    out, err = capsys.readouterr()
    assert out == "" and "satisfies the constraints" in err and why in err


def test_allowed_layouts_still_plan(capsys):
    # the same model at a tp it divides, a node as large as the group, batch mode
    assert main(["--model", "gpt2-mini", "--devices", "4", "--tp", "2"]) == 0
    big = ["--model", "gpt3-175b", "--devices", "16", "--tp", "16", "--devices-per-node", "16"]
    assert main(big) == 0
    assert main(["--model", "fc-mnist", "--devices", "2", "--tp", "2", "--tp-mode", "batch"]) == 0
    capsys.readouterr()


def test_scaling_table_keeps_sizes_some_layout_is_left_at(capsys):
    # 3 devices leave no layout at --tp 2; 4 do: the table is printed, the empty row named
    assert main(["--model", "gpt2-mini", "--devices", "3,4", "--tp", "2"]) == 0
    assert "no configuration fits" in capsys.readouterr().out


# -- weight streaming on a device without a weight store --------------------------------------


def test_streaming_error_names_the_precision_as_the_cause(capsys):
    args = ["--model", "gpt2-mini", "--execution", "weight_streaming", "--devices", "2"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and "has no weight store" in err
    assert "--precision fp32, bf16 or fp16" in err and "--tp" not in err
    for precision in ("fp32", "bf16", "fp16"):
        assert main([*args, "--precision", precision]) == 0
    capsys.readouterr()
    # with a split too, each cause is named
    assert main([*args, "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--precision fp32" in err and "no --pp 2" in err


# -- plain-CLI manners ------------------------------------------------------------------------


def test_closed_pipe_ends_quietly(tmp_path):
    # a search's JSON is far larger than a pipe's buffer: the reader leaves after one line
    cmd = [sys.executable, "-m", "simdist.plan", "--model", "gpt2-mini", "--devices", "8",
           "--search", "--json"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().startswith("{")
    proc.stdout.close()
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(timeout=120) == 1
    assert err == ""


def test_help_lists_every_shape_key(capsys):
    from simdist.sim.plan_shapes import SHAPE_KEYS

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    listed = text.split("(keys: ")[1].split(")")[0].split(", ")
    assert listed == list(SHAPE_KEYS) and {"norm", "kind", "sizes"} <= set(listed)


def test_small_steps_keep_their_digits(capsys):
    assert main(["--model", "gpt2-mini", "--devices", "1,2", "--json"]) == 0
    steps = [s["configurations"][0]["step_s"] for s in json.loads(capsys.readouterr().out)["sizes"]]
    assert all(s < 0.01 for s in steps)  # a small model: milliseconds
    assert main(["--model", "gpt2-mini", "--devices", "1,2"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[2:4]]
    shown = [float(row[row.index("none") + 1]) for row in rows]
    assert shown == [pytest.approx(s, rel=1e-3) for s in steps]  # four digits, not 0.001
    assert main(["--model", "gpt2-mini", "--devices", "2", "--search", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"step {steps[1]:#.4g} s" in out
