"""SambaFlow's tensor-parallel batch mode (``runconfig.tensor_parallel``): N ranks of one
node act as one model instance whose batch is divided among them; the degree is fixed when a
run starts and changes only through ``python -m simdist.checkpoint reshard``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_launch import REPO, run_mpi

BASE = [
    "-m",
    "simdist.train",
    "--model.hidden_sizes=[64, 32]",
    "--runconfig.mode=train",
    "--runconfig.save_summary_steps=1",
    "--runconfig.progress_bar=false",
]


def train(np_: int, model_dir: Path, *args: str, ok: bool = True):
    out = run_mpi(np_, [*BASE, f"--runconfig.model_dir={model_dir}", *args], timeout=240)
    if ok:
        assert out.returncode == 0, out.stdout
    return out


def losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"global_step = \d+, loss = ([0-9.e+-]+)", stdout)]


def params_at(model_dir: Path) -> dict[str, np.ndarray]:
    import h5py

    from simdist.checkpoint import latest_checkpoint

    with h5py.File(latest_checkpoint(model_dir)) as f:
        return {k: f["model"][k][...] for k in f["model"]}


def test_batch_mode_divides_the_groups_batch(tmp_path):
    """Two groups of 2 ranks with batch 8 per group are data parallelism over 4 ranks with 4
    samples each: the same samples on the same ranks, so the same bits; one group of 2
    tracks one rank with the whole batch (its sums only regroup) to 1e-5 relative."""
    steps = ["--runconfig.max_steps=12", "--runconfig.save_checkpoints_steps=12"]
    tp = train(4, tmp_path / "tp", *steps, "--tensor-parallel", "2", "-b", "8")
    assert "tensor parallel (batch mode), 2 group(s) of 2 ranks" in tp.stdout
    assert "[0, 1] [2, 3]" in tp.stdout
    dp = train(4, tmp_path / "dp", *steps, "--train_input.batch_size=4")
    a, b = params_at(tmp_path / "tp"), params_at(tmp_path / "dp")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert losses(tp.stdout) == losses(dp.stdout)

    one_group = train(2, tmp_path / "tp1", *steps, "--tensor-parallel", "2", "-b", "8")
    one_rank = train(1, tmp_path / "np1", *steps, "--train_input.batch_size=8")
    got, want = losses(one_group.stdout), losses(one_rank.stdout)
    assert len(got) == len(want) == 12
    assert np.allclose(got, want, rtol=1e-5, atol=0), (got, want)


def test_the_degree_changes_only_through_an_explicit_reshard(tmp_path):
    d = tmp_path / "run"
    train(4, d, "--runconfig.max_steps=4", "--runconfig.save_checkpoints_steps=4",
          "--tensor-parallel", "2", "-b", "8")  # fmt: skip
    out = train(4, d, "--runconfig.max_steps=8", "--train_input.batch_size=4", ok=False)
    assert out.returncode == 2, out.stdout
    assert "written with runconfig.tensor_parallel=2, this run has 1" in out.stdout
    assert "python -m simdist.checkpoint reshard" in out.stdout
    src = d / "checkpoint_4.h5"
    resharded = tmp_path / "tp1.h5"
    cmd = [sys.executable, "-m", "simdist.checkpoint", "reshard", str(src), str(resharded),
           "--tensor-parallel", "1"]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    resume = f"--runconfig.checkpoint_path={resharded}"
    cont = train(4, tmp_path / "cont", "--runconfig.max_steps=8", "-b", "4", resume)
    assert "resumed from" in cont.stdout and "global_step = 8" in cont.stdout


@pytest.mark.parametrize(
    ("np_", "args", "message"),
    [
        (4, ["--tensor-parallel", "3", "-b", "6"], "tensor_parallel=3 must divide the 4 ranks"),
        (4, ["--tensor-parallel", "2", "-b", "8", "--runconfig.ranks_per_node=1"],
         "ranks [0, 1] span nodes [0, 1]"),
        (2, ["--tensor-parallel", "2", "-b", "7"], "train_input.batch_size=7 is the batch of one"),
        (2, ["--tensor-parallel", "2", "--runconfig.tensor_parallel_mode=weight"],
         "tensor_parallel_mode=weight (layers split Megatron-style) runs model.name gpt2 only"),
    ],
)  # fmt: skip
def test_bad_tensor_parallel_input_exits_2_and_writes_nothing(tmp_path, np_, args, message):
    d = tmp_path / "run"
    out = train(np_, d, "--runconfig.max_steps=2", *args, ok=False)
    assert out.returncode == 2, out.stdout
    assert message in out.stdout
    assert not d.exists()
