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
