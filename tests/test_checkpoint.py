"""Checkpoint files: resharding across world sizes, checksums, clear errors."""

import json

import h5py
import numpy as np
import pytest

from simdist import checkpoint
from simdist.arena import Layout
from simdist.models.base import ParamSpec

SPECS = [
    ParamSpec("w1", (37, 11), True),
    ParamSpec("b1", (11,), False),
    ParamSpec("w2", (11, 5), True),
    ParamSpec("b2", (5,), False),
]


def write_sharded(tmp_path, world: int, state: dict[str, np.ndarray], step: int = 7):
    """What a ZeRO run at ``world`` ranks writes: one optimizer shard per rank + main file."""
    layout = Layout(SPECS, world)
    desc = layout.describe()
    shards = []
    for r in range(world):
        lo, hi = layout.shard(r)
        padded = {k: np.pad(v, (0, layout.padded - v.size)) for k, v in state.items()}
        shards.append(
            checkpoint.save_optimizer_shard(
                tmp_path, step, r, world, lo, hi, desc, {k: v[lo:hi] for k, v in padded.items()}
            )
        )
    params = {s.name: np.full(s.shape, i, np.float32) for i, s in enumerate(SPECS)}
    attrs = {"model": "toy", "world_size": world, "zero_opt_level": 2, "layout": desc}
    return checkpoint.save(tmp_path, step, params, None, attrs, keep_max=2, shards=shards)


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (4, 3), (3, 5), (1, 8)])
def test_reshard_is_exact(tmp_path, old, new):
    numel = Layout(SPECS, 1).numel
    rng = np.random.default_rng(0)
    state = {k: rng.standard_normal(numel).astype(np.float32) for k in ("exp_avg", "exp_avg_sq")}
    path = write_sharded(tmp_path, old, state)
    _, _, attrs = checkpoint.load(path, {s.name: s.shape for s in SPECS}, "toy")
    layout = Layout(SPECS, new)
    for key, full in state.items():
        pieces = [
            checkpoint.read_optimizer_range(path, attrs, key, *layout.shard(r)) for r in range(new)
        ]
        joined = np.concatenate(pieces)
        assert np.array_equal(joined[:numel], full)  # bitwise, padding removed
        assert not joined[numel:].any()  # padding reads as zeros
    cons = checkpoint.consolidate(path, tmp_path / "cons.h5")
    with h5py.File(cons) as f:
        flat = np.concatenate(
            [f["optimizer"]["exp_avg"][n][...].ravel() for n in ("w1", "b1", "w2", "b2")]
        )
    assert np.array_equal(flat, state["exp_avg"])
    cattrs = checkpoint.verify(cons)
    got = checkpoint.read_optimizer_range(cons, cattrs, "exp_avg_sq", 3, 50)
    assert np.array_equal(got, state["exp_avg_sq"][3:50])


def test_corruption_and_missing_shards_are_detected(tmp_path):
    numel = Layout(SPECS, 1).numel
    path = write_sharded(tmp_path, 2, {"exp_avg": np.ones(numel, np.float32)})
    shard = tmp_path / checkpoint.shard_name(7, 1, 2)
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="does not match the SHA-256"):
        checkpoint.verify(path)
    shard.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="is missing"):
        checkpoint.verify(path)


def test_other_model_and_wrong_shapes_are_errors(tmp_path):
    numel = Layout(SPECS, 1).numel
    path = write_sharded(tmp_path, 1, {"exp_avg": np.ones(numel, np.float32)})
    shapes = {s.name: s.shape for s in SPECS}
    with pytest.raises(checkpoint.CheckpointError, match="is for model 'toy', not 'gpt2'"):
        checkpoint.load(path, shapes, "gpt2")
    with pytest.raises(checkpoint.CheckpointError, match="has shape"):
        checkpoint.load(path, {**shapes, "w1": (36, 11)}, "toy")
    with pytest.raises(checkpoint.CheckpointError, match="lacks parameter 'w3'"):
        checkpoint.load(path, {**shapes, "w3": (2,)}, "toy")
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not hdf5 at all")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read as HDF5"):
        checkpoint.load(garbage, shapes, "toy")


def test_keep_max_prunes_every_file_of_old_checkpoints(tmp_path):
    numel = Layout(SPECS, 1).numel
    for step in (1, 2, 3):
        write_sharded(tmp_path, 2, {"exp_avg": np.ones(numel, np.float32)}, step=step)
    names = sorted(p.name for p in tmp_path.glob("checkpoint_*"))
    assert names == sorted(
        [
            f"checkpoint_{s}{x}"
            for s in (2, 3)
            for x in (".h5", ".optim-0-of-2.h5", ".optim-1-of-2.h5")
        ]
    )
    index = json.loads((tmp_path / "checkpoints.json").read_text())["checkpoints"]
    assert [e["step"] for e in index] == [2, 3]
    assert checkpoint.latest_checkpoint(tmp_path).name == "checkpoint_3.h5"
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary files left behind
