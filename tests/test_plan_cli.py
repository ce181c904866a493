"""Plan mode's command line: how --model resolves, flag ranges, layouts the search refuses,
and the plain-CLI manners (a closed pipe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
