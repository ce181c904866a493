"""HDF5 checkpoints: atomic, checksummed, readable at any world size.

A checkpoint ``model_dir/checkpoint_<step>.h5`` holds
- ``model/<name>``: every parameter as a float32 dataset of its real shape (no padding);
- ``optimizer/<state>/<name>``: optimizer state per parameter, consolidated (gathered from
  ZeRO shards), so it loads at any world size and ZeRO level;
- attributes: global_step, model name, world size and ZeRO level it was written with,
  the layout, and the simdist version.
It is written to a temporary file, fsync'ed and renamed; then ``checkpoints.json`` (also
replaced atomically) records its SHA-256, which ``load`` verifies. A kill during a save
leaves at most a stray temporary file, never a corrupt "latest".
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import h5py
import numpy as np

import simdist

INDEX = "checkpoints.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or belongs to another model."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(model_dir: Path) -> list[dict]:
    path = Path(model_dir) / INDEX
    if not path.exists():
        return []
    try:
        return json.loads(path.read_text())["checkpoints"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); remove it to start fresh") from None


def latest_checkpoint(model_dir: Path) -> Path | None:
    entries = read_index(model_dir)
    return Path(model_dir) / entries[-1]["file"] if entries else None


def save(
    model_dir: Path,
    step: int,
    tensors: dict[str, np.ndarray],
    optimizer_state: dict[str, dict[str, np.ndarray]],
    attrs: dict,
    keep_max: int,
) -> Path:
    """Write a checkpoint atomically (rank 0 only) and prune old ones beyond keep_max."""
    model_dir = Path(model_dir)
    name = f"checkpoint_{step}.h5"
    final, tmp = model_dir / name, model_dir / f".{name}.tmp"
    with h5py.File(tmp, "w") as f:
        g = f.create_group("model")
        for key, value in tensors.items():
            g.create_dataset(key, data=value, dtype=np.float32)
        o = f.create_group("optimizer")
        for state, per_name in optimizer_state.items():
            s = o.create_group(state)
            for key, value in per_name.items():
                s.create_dataset(key, data=value, dtype=np.float32)
        for key, value in {**attrs, "global_step": step, "simdist_version": simdist.__version__}.items():
            f.attrs[key] = json.dumps(value) if isinstance(value, dict | list) else value
        f.flush()
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(model_dir)
    entries = [e for e in read_index(model_dir) if e["file"] != name]
    entries.append({"step": step, "file": name, "sha256": sha256(final)})
    entries.sort(key=lambda e: e["step"])
    stale = entries[:-keep_max] if keep_max > 0 else []
    entries = entries[-keep_max:] if keep_max > 0 else entries
    _write_json_atomic(model_dir / INDEX, {"checkpoints": entries})
    for e in stale:
        (model_dir / e["file"]).unlink(missing_ok=True)
    return final


def load(path: Path, expected_names: dict[str, tuple[int, ...]], model_name: str):
    """Read and verify a checkpoint; returns (step, tensors, optimizer_state, attrs)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    recorded = {e["file"]: e["sha256"] for e in read_index(path.parent)}
    if path.name in recorded and sha256(path) != recorded[path.name]:
        raise CheckpointError(
            f"checkpoint {path} does not match the SHA-256 recorded in {INDEX}: the file is "
            "corrupt or was modified; resume from an earlier checkpoint with "
            "--runconfig.checkpoint_path"
        )
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: f.attrs[k] for k in f.attrs}
            if attrs.get("model") != model_name:
                raise CheckpointError(
                    f"checkpoint {path} is for model {attrs.get('model')!r}, not {model_name!r}"
                )
            tensors = {}
            for key, shape in expected_names.items():
                if key not in f["model"]:
                    raise CheckpointError(f"checkpoint {path} lacks parameter {key!r}")
                data = f["model"][key][...]
                if data.shape != tuple(shape):
                    raise CheckpointError(
                        f"checkpoint {path}: parameter {key!r} has shape {data.shape}, "
                        f"the model needs {tuple(shape)}"
                    )
                tensors[key] = data
            extra = sorted(set(f["model"]) - set(expected_names))
            if extra:
                raise CheckpointError(f"checkpoint {path} has unknown parameter {extra[0]!r}")
            state = {
                s: {k: f["optimizer"][s][k][...] for k in f["optimizer"][s]}
                for s in f.get("optimizer", {})
            }
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read as HDF5: {e}") from None
    return int(attrs["global_step"]), tensors, state, attrs
