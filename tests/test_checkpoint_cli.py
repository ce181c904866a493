"""``python -m simdist.checkpoint`` on user errors: exit 2, one line, nothing written."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from simdist import checkpoint
from simdist.arena import Layout
from simdist.models.base import ParamSpec

SPECS = [ParamSpec("w1", (37, 11), True), ParamSpec("b1", (11,), False)]
SHAPES = {s.name: s.shape for s in SPECS}


def write_zero(model_dir: Path, world: int = 2, step: int = 7) -> Path:
    """What a ZeRO-2 run at ``world`` ranks writes: one optimizer shard per rank, the main
    file, checkpoints.json."""
    model_dir.mkdir(exist_ok=True)
    layout = Layout(SPECS, world)
    desc = layout.describe()
    state = np.arange(layout.padded, dtype=np.float32)
    shards = []
    for r in range(world):
        lo, hi = layout.shard(r)
        part = {"exp_avg": state[lo:hi]}
        shards.append(
            checkpoint.save_optimizer_shard(model_dir, step, r, world, lo, hi, desc, part)
        )
    params = {s.name: np.full(s.shape, i, np.float32) for i, s in enumerate(SPECS)}
    attrs = {"model": "toy", "world_size": world, "zero_opt_level": 2, "layout": desc}
    return checkpoint.save(model_dir, step, params, None, attrs, keep_max=2, shards=shards)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    rc = checkpoint.main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}  # hidden temp files included


def test_main_file_without_its_shards_is_a_clear_error(tmp_path, capsys):
    src = write_zero(tmp_path / "run")
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(src, lone)  # the main file alone: no shards, no index
    rc, err = run_cli(capsys, "consolidate", str(lone / src.name), str(lone / "o.h5"))
    line = one_error_line(err)
    assert rc == 2
    for words in ("checkpoint_7.optim-0-of-2.h5", "checkpoint_7.optim-1-of-2.h5", "are missing"):
        assert words in line
    assert "copy them into" in line and "consolidate" in line
    assert listing(lone) == {src.name}
    # the resume path (simdist.run) reads through load: the same error, before any weights
    with pytest.raises(checkpoint.CheckpointError, match="are missing"):
        checkpoint.load(lone / src.name, SHAPES, "toy")
    with pytest.raises(checkpoint.CheckpointError, match="are missing"):
        checkpoint.optimizer_keys(lone / src.name, checkpoint.verify(lone / src.name))
    # a weights-only reader (eval) does not need them
    step, tensors, _ = checkpoint.load(lone / src.name, SHAPES, "toy", optimizer=False)
    assert step == 7 and np.array_equal(tensors["b1"], np.ones(11, np.float32))
    # one shard copied along, the other not: the same message, naming the one missing
    shutil.copy(src.parent / checkpoint.shard_name(7, 0, 2), lone)
    rc, err = run_cli(capsys, "consolidate", str(lone / src.name), str(lone / "o.h5"))
    line = one_error_line(err)
    assert rc == 2 and "file checkpoint_7.optim-1-of-2.h5 is missing" in line
    assert "optim-0-of-2" not in line


@pytest.mark.parametrize(
    "out,words",
    [
        (".", "is a directory"),
        ("run", "is a directory"),
        ("nodir/o.h5", "does not exist"),
        ("", "OUT is empty"),
    ],
)
def test_consolidate_refuses_an_unwritable_out(tmp_path, capsys, monkeypatch, out, words):
    src = write_zero(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path / "run")
    rc, err = run_cli(capsys, "consolidate", str(src), out)
    assert rc == 2 and words in one_error_line(err)
    assert listing(tmp_path / "run") == before  # no .tmp left
    assert listing(tmp_path) == {"run"}


@pytest.mark.parametrize(
    "name",
    ["checkpoint_7.h5", "checkpoint_7.optim-1-of-2.h5", "checkpoint_5.h5", "checkpoints.json"],
)
def test_consolidate_refuses_to_replace_a_checkpoint_file(tmp_path, capsys, name):
    run = tmp_path / "run"
    write_zero(run, step=5)
    src = write_zero(run, step=7)
    digests = {p.name: checkpoint.sha256(p) for p in run.iterdir()}
    rc, err = run_cli(capsys, "consolidate", str(src), str(run / name))
    line = one_error_line(err)
    assert rc == 2 and str(run / name) in line
    assert "another name" in line
    assert {p.name: checkpoint.sha256(p) for p in run.iterdir()} == digests
    checkpoint.verify(run / "checkpoint_5.h5")  # both still pass their SHA-256 check
    checkpoint.verify(src)


def test_consolidate_refuses_a_file_of_another_index(tmp_path, capsys):
    src = write_zero(tmp_path / "a")
    other = write_zero(tmp_path / "b", step=3)
    digest = checkpoint.sha256(other)
    rc, err = run_cli(capsys, "consolidate", str(src), str(other))
    assert rc == 2 and "checkpoints.json" in one_error_line(err)
    assert checkpoint.sha256(other) == digest
    # a name the index does not list is fine
    assert checkpoint.main(["consolidate", str(src), str(tmp_path / "b" / "c.h5")]) == 0


def test_an_optimizer_shard_is_not_a_checkpoint(tmp_path, capsys):
    src = write_zero(tmp_path / "run")
    shard = src.parent / checkpoint.shard_name(7, 1, 2)
    rc, err = run_cli(capsys, "consolidate", str(shard), str(tmp_path / "c.h5"))
    line = one_error_line(err)
    assert rc == 2
    assert "is an optimizer shard of checkpoint_7.h5" in line and f"pass {src}" in line
    assert not (tmp_path / "c.h5").exists()
    with pytest.raises(checkpoint.CheckpointError, match="optimizer shard of checkpoint_7.h5"):
        checkpoint.load(shard, SHAPES, "toy")  # what a resume from it reads


def test_a_failed_write_leaves_no_temp_file(tmp_path, capsys, monkeypatch):
    src = write_zero(tmp_path / "run")
    before = listing(src.parent)

    def full_disk(tmp, final):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_commit", full_disk)
    rc, err = run_cli(capsys, "consolidate", str(src), str(src.parent / "c.h5"))
    assert rc == 2 and "No space left" in one_error_line(err)
    assert listing(src.parent) == before
