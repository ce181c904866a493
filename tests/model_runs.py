"""Run checks every trained model shares (BERT, T5, ...): launch a small preset under
mpiexec, ZeRO levels bit-identical at a world size, a resumed run equal to an uninterrupted
one. Each model's test file gives its own tiny preset arguments."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from mpi_launch import run_mpi
from test_train import final_state


def runner(preset_args: list[str]) -> Callable:
    """``train(n, model_dir, *args)``: simdist.train on n ranks; fails the test on error."""

    def train(n: int, model_dir: Path, *args: str, timeout: int = 400):
        cmd = ["-m", "simdist.train", *preset_args, f"--runconfig.model_dir={model_dir}", *args]
        out = run_mpi(n, cmd, timeout=timeout)
        assert out.returncode == 0, out.stdout
        return out

    return train


def assert_same_state(a: tuple[dict, dict], b: tuple[dict, dict], what: str) -> None:
    """(parameters, optimizer state) of two checkpoints, bit for bit."""
    for which in (0, 1):
        assert a[which].keys() == b[which].keys(), what
        for k, v in a[which].items():
            assert np.array_equal(b[which][k], v), f"{what}: {k}"


def assert_zero_levels_identical(train: Callable, tmp_path: Path, n: int) -> None:
    """ZeRO-1 and ZeRO-2 end 4 steps on n ranks with ZeRO-0's parameters and state."""
    states = {}
    for level in (0, 1, 2):
        d = tmp_path / f"z{level}"
        train(
            n, d, "--runconfig.max_steps=4", "--runconfig.mode=train", f"--zero_opt_level={level}"
        )
        states[level] = final_state(d)
    for level in (1, 2):
        assert_same_state(states[0], states[level], f"ZeRO-{level}")


def assert_resume_identical(train: Callable, tmp_path: Path, *args: str):
    """6 steps straight vs 3 + 3 resumed (checkpoint every 3 steps), on 2 ranks; returns the
    resumed run's output (it also evaluates) for model-specific checks of tmp_path / "res"."""
    args = ("--runconfig.save_checkpoints_steps=3", *args)
    train(2, tmp_path / "full", *args, "--runconfig.max_steps=6", "--runconfig.mode=train")
    train(2, tmp_path / "res", *args, "--runconfig.max_steps=3", "--runconfig.mode=train")
    out = train(2, tmp_path / "res", *args, "--runconfig.max_steps=6")
    assert "resumed from" in out.stdout
    assert_same_state(final_state(tmp_path / "full"), final_state(tmp_path / "res"), "resumed")
    return out
