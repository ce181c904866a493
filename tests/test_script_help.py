"""Every data-making and harness script answers --help with its usage (exit 0) and turns a
missing input into a one-line usage error (exit 2) instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

# script -> words its help must contain (what it does, its arguments)
HELP = {
    "make_mnist5k.py": ["mnist_5k.csv.gz", "MNIST_5K_CSV_GZ", "OUTPUT_DIR"],
    "make_austen_text.py": ["janeaustenr", "RDATA_RDB", "BOOK", "OUT"],
    "validate_published.py": ["term by term", "175B"],
    "multihost.py": ["network namespaces", "-- PROGRAM", "--hosts", "--rate", "--require-bytes"],
}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)


@pytest.mark.parametrize("script", sorted(HELP))
def test_help_prints_usage_and_exits_0(script):
    proc = _run(f"scripts/{script}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python scripts/{script}")
    for words in HELP[script]:
        assert words in proc.stdout, words
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["scripts/make_mnist5k.py", "nope.csv.gz"], "nope.csv.gz is not a file"),
        (["scripts/make_austen_text.py", "nope/Rdata.rdb"], "Rdata.rdb is not a file"),
        (["scripts/make_mnist5k.py"], "required"),
        (["scripts/validate_published.py", "--bogus"], "unrecognized arguments: --bogus"),
        (["scripts/multihost.py", "--hosts", "2"], "no program to run: put it after --"),
    ],
)
def test_bad_arguments_are_a_one_line_usage_error(tmp_path, args, words):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("python scripts/")


def test_make_mnist5k_still_converts_a_csv(tmp_path):
    """The argparse front keeps the conversion: 400/100 rows per digit, in OUTPUT_DIR."""
    import gzip

    import numpy as np

    rng = np.random.default_rng(0)
    table = np.hstack([rng.integers(0, 256, (5000, 784)), np.repeat(np.arange(10), 500)[:, None]])
    src = tmp_path / "mnist_5k.csv.gz"
    with gzip.open(src, "wt") as f:
        np.savetxt(f, table, fmt="%d", delimiter=",")
    out = tmp_path / "out"
    proc = _run("scripts/make_mnist5k.py", str(src), str(out))
    assert proc.returncode == 0, proc.stderr
    assert "train: 4000 images" in proc.stdout and "t10k: 1000 images" in proc.stdout
    assert len(list(out.glob("*-ubyte.gz"))) == 4


def test_calibrate_help_names_its_command_and_that_the_default_overwrites_host(capsys):
    from simdist.calibrate import main as calibrate

    with pytest.raises(SystemExit) as done:
        calibrate(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert text.startswith("usage: python -m simdist.calibrate [options]")
    assert "mpiexec -n 2 python -m simdist.calibrate" in text
    assert "simdist/device/profiles/host.yaml, which it OVERWRITES" in text
