"""HDF5 checkpoints: atomic, checksummed, readable at any world size and ZeRO level.

A checkpoint at step S is
- ``checkpoint_S.h5`` (rank 0): ``model/<name>`` every parameter as float32 of its real
  shape; attributes: global_step, model, world size and ZeRO level it was written with,
  optimizer type, the flat layout (names, shapes, offsets, padding), simdist version; with
  ZeRO-0 also ``optimizer/<state>/<name>`` (the whole state, per parameter);
- with ZeRO-1/2, one ``checkpoint_S.optim-R-of-N.h5`` per rank holding that rank's flat
  optimizer slice ``<state>`` with attributes lo, hi, padded, numel, rank, world — enough to
  rebuild the state at any other world size (``read_optimizer_range``).
Every file is written to a temporary name, fsync'ed and renamed. ``checkpoints.json`` is
the commit point: rank 0 replaces it (atomically) only after every file of the checkpoint
exists, and it records each file's SHA-256, verified on load. A kill during a save leaves
the previous checkpoint as "latest".

``python -m simdist.checkpoint consolidate CKPT OUT`` writes one file with the full
parameters and full optimizer state (ZeRO shards merged), loadable at any world size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

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


def _commit(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    _commit(tmp, path)


def read_index(model_dir: Path) -> list[dict]:
    path = Path(model_dir) / INDEX
    if not path.exists():
        return []
    try:
        return json.loads(path.read_text())["checkpoints"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); remove it to start fresh") from None


def uncommitted(model_dir: Path) -> list[str]:
    """Main checkpoint files in ``model_dir`` that its index does not list (none listed
    when there is no index), in step order."""
    listed = {e["file"] for e in read_index(model_dir)}
    found = []
    for p in Path(model_dir).glob("checkpoint_*.h5"):
        step = p.name[len("checkpoint_") : -len(".h5")]
        if step.isdigit() and p.name not in listed:
            found.append((int(step), p.name))
    return [name for _, name in sorted(found)]


def latest_checkpoint(model_dir: Path) -> Path | None:
    entries = read_index(model_dir)
    return Path(model_dir) / entries[-1]["file"] if entries else None


def shard_name(step: int, rank: int, world: int) -> str:
    return f"checkpoint_{step}.optim-{rank}-of-{world}.h5"


def save_optimizer_shard(
    model_dir: Path,
    step: int,
    rank: int,
    world: int,
    lo: int,
    hi: int,
    layout: dict,
    state: dict[str, np.ndarray],
) -> tuple[str, str]:
    """ZeRO: this rank's optimizer slice [lo, hi) of the flat buffer; returns (file, sha256)."""
    name = shard_name(step, rank, world)
    final, tmp = Path(model_dir) / name, Path(model_dir) / f".{name}.tmp"
    with h5py.File(tmp, "w") as f:
        for key, value in state.items():
            f.create_dataset(key, data=value, dtype=np.float32)
        attrs = {
            "lo": lo,
            "hi": hi,
            "rank": rank,
            "world": world,
            "global_step": step,
            "padded": layout["padded"],
            "numel": layout["numel"],
        }
        for key, value in attrs.items():
            f.attrs[key] = value
    _commit(tmp, final)
    return name, sha256(final)


def save(
    model_dir: Path,
    step: int,
    tensors: dict[str, np.ndarray],
    optimizer_state: dict[str, dict[str, np.ndarray]] | None,
    attrs: dict,
    keep_max: int,
    shards: list[tuple[str, str]] = (),
) -> Path:
    """Rank 0, after every rank wrote its shard: the main file, then the index (commit)."""
    model_dir = Path(model_dir)
    name = f"checkpoint_{step}.h5"
    final, tmp = model_dir / name, model_dir / f".{name}.tmp"
    with h5py.File(tmp, "w") as f:
        g = f.create_group("model")
        for key, value in tensors.items():
            if hasattr(value, "write_to"):  # writes itself in blocks (16-bit words unpacked)
                value.write_to(g.create_dataset(key, shape=value.shape, dtype=np.float32))
            else:
                g.create_dataset(key, data=value, dtype=np.float32)
        if optimizer_state is not None:
            o = f.create_group("optimizer")
            for state, per_name in optimizer_state.items():
                s = o.create_group(state)
                for key, value in per_name.items():
                    s.create_dataset(key, data=value, dtype=np.float32)
        meta = {
            **attrs,
            "global_step": step,
            "simdist_version": simdist.__version__,
            "optimizer_shards": [f for f, _ in shards],
        }
        for key, value in meta.items():
            f.attrs[key] = json.dumps(value) if isinstance(value, dict | list) else value
    _commit(tmp, final)
    files = {name: sha256(final), **dict(shards)}
    entries = [e for e in read_index(model_dir) if e["file"] != name]
    entries.append({"step": step, "file": name, "sha256": files[name], "files": files})
    entries.sort(key=lambda e: e["step"])
    stale = entries[:-keep_max] if keep_max > 0 else []
    entries = entries[-keep_max:] if keep_max > 0 else entries
    _write_json_atomic(model_dir / INDEX, {"checkpoints": entries})
    for e in stale:
        for f in e.get("files", {e["file"]: None}):
            (model_dir / f).unlink(missing_ok=True)
    return final


def _attr(value):
    if isinstance(value, str) and value[:1] in "[{":
        return json.loads(value)
    return value.item() if isinstance(value, np.generic) else value


def _missing_error(path: Path, missing: list[str]) -> CheckpointError:
    """The one message for shard files that are not next to their main file (copied alone,
    or deleted): which ones, and the two ways out."""
    one = len(missing) == 1
    return CheckpointError(
        f"checkpoint {path}: file{'' if one else 's'} {', '.join(missing)} "
        f"{'is' if one else 'are'} missing (ZeRO optimizer shards travel with the main file); "
        f"copy {'it' if one else 'them'} into {str(path.parent) or '.'}, or run "
        f"python -m simdist.checkpoint consolidate {path.name} OUT where they are, for one "
        "self-contained file"
    )


def require_shards(path: Path, attrs: dict) -> None:
    """Every optimizer shard the main file lists must sit next to it (checked here, not
    left to h5py: a lone main file has no index to notice it)."""
    path = Path(path)
    missing = [f for f in attrs.get("optimizer_shards") or [] if not (path.parent / f).is_file()]
    if missing:
        raise _missing_error(path, missing)


SHARD_ATTRS = ("rank", "world", "lo", "hi")  # what save_optimizer_shard writes, a main file not


def verify(path: Path) -> dict:
    """Check every file of the checkpoint against the SHA-256 in the index; return attrs."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    entry = next((e for e in read_index(path.parent) if e["file"] == path.name), None)
    if entry is not None:
        files = entry.get("files", {entry["file"]: entry["sha256"]})
        missing = [f for f in files if not (path.parent / f).is_file()]
        if missing:
            raise _missing_error(path, missing)
        for fname, digest in files.items():
            fpath = path.parent / fname
            if sha256(fpath) != digest:
                raise CheckpointError(
                    f"checkpoint file {fpath} does not match the SHA-256 recorded in {INDEX}: "
                    "it is corrupt or was modified; resume from an earlier checkpoint with "
                    "--runconfig.checkpoint_path"
                )
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: _attr(f.attrs[k]) for k in f.attrs}
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read as HDF5: {e}") from None
    if all(k in attrs for k in SHARD_ATTRS) and "layout" not in attrs:
        # every reader (load, consolidate, export) would fail later with a KeyError or
        # "model None": say what the file is and which one to pass
        main = f"checkpoint_{attrs.get('global_step', '<step>')}.h5"
        raise CheckpointError(
            f"{path} is an optimizer shard of {main} (rank {attrs['rank']} of "
            f"{attrs['world']}), not a checkpoint; pass {path.parent / main}"
        )
    return attrs


def load(path: Path, expected: dict[str, tuple[int, ...]], model_name: str, optimizer: bool = True):
    """Verify and read parameters; returns (step, tensors, attrs). ``optimizer``: the caller
    will read the optimizer state too, so its shards must be there (checked before the
    parameters are read; False for a weights-only reader such as eval)."""
    path = Path(path)
    attrs = verify(path)
    if optimizer:
        require_shards(path, attrs)
    if attrs.get("model") != model_name:
        raise CheckpointError(
            f"checkpoint {path} is for model {attrs.get('model')!r}, not {model_name!r}"
        )
    with h5py.File(path, "r") as f:
        tensors = {}
        for key, shape in expected.items():
            if key not in f["model"]:
                raise CheckpointError(f"checkpoint {path} lacks parameter {key!r}")
            data = f["model"][key][...]
            if data.shape != tuple(shape):
                raise CheckpointError(
                    f"checkpoint {path}: parameter {key!r} has shape {data.shape}, "
                    f"the model needs {tuple(shape)} (a checkpoint of another model size?)"
                )
            tensors[key] = data
        extra = sorted(set(f["model"]) - set(expected))
        if extra:
            raise CheckpointError(f"checkpoint {path} has unknown parameter {extra[0]!r}")
    return int(attrs["global_step"]), tensors, attrs


def read_optimizer_range(path: Path, attrs: dict, key: str, lo: int, hi: int) -> np.ndarray:
    """Optimizer state ``key`` for flat elements [lo, hi) of the current layout.

    Works whatever world size or ZeRO level wrote the checkpoint: the flat order of the real
    elements is the same at every world size (only the padding after them differs), so the
    range is assembled from the consolidated per-parameter state or from the shards that
    overlap it. Padding reads as zeros.
    """
    path = Path(path)
    layout = attrs["layout"]
    numel = int(layout["numel"])
    out = np.zeros(hi - lo, np.float32)
    shards = attrs.get("optimizer_shards") or []
    if shards:
        require_shards(path, attrs)
        for fname in shards:
            with h5py.File(path.parent / fname, "r") as f:
                if key not in f:
                    raise CheckpointError(f"{fname} has no optimizer state {key!r}")
                a, b = int(f.attrs["lo"]), min(int(f.attrs["hi"]), numel)
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    out[s - lo : e - lo] = f[key][s - a : e - a]
        return out
    with h5py.File(path, "r") as f:
        if "optimizer" not in f or key not in f["optimizer"]:
            raise CheckpointError(
                f"checkpoint {path} has no optimizer state {key!r} "
                "(written with another optimizer_type?)"
            )
        group = f["optimizer"][key]
        for name, offset, shape in zip(
            layout["names"], layout["offsets"], layout["shapes"], strict=True
        ):
            n = int(np.prod(shape, dtype=np.int64))
            s, e = max(offset, lo), min(offset + n, hi)
            if s < e:
                out[s - lo : e - lo] = group[name][...].reshape(-1)[s - offset : e - offset]
    return out


def optimizer_keys(path: Path, attrs: dict) -> list[str]:
    shards = attrs.get("optimizer_shards") or []
    require_shards(path, attrs)
    with h5py.File(Path(path).parent / shards[0] if shards else path, "r") as f:
        return sorted(f.keys()) if shards else sorted(f.get("optimizer", {}).keys())


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def check_output(path: Path, out: Path, attrs: dict) -> None:
    """Refuse an OUT that cannot be written, or whose replacement would break a checkpoint:
    before any work, so nothing is written."""
    if out.is_dir():  # also "." (what Path("") becomes: main reports "" itself)
        raise CheckpointError(
            f"OUT {out} is a directory; give a file name in it, such as {out / 'consolidated.h5'}"
        )
    if not out.parent.is_dir():
        raise CheckpointError(
            f"OUT {out}: directory {out.parent} does not exist; create it or choose another OUT"
        )
    if out.name == INDEX:
        raise CheckpointError(f"OUT {out} would replace a checkpoint index; choose another name")
    # overwriting a file a checkpoints.json lists breaks that checkpoint's SHA-256 check (the
    # next resume refuses it); overwriting the input or its shards loses the original
    protected = [path, *(path.parent / f for f in attrs.get("optimizer_shards") or [])]
    for e in read_index(out.parent):
        protected += [out.parent / f for f in e.get("files", {e["file"]: None})]
    for p in protected:
        if _same_file(out, p):
            raise CheckpointError(
                f"OUT {out} is {p.name}, a file of a checkpoint (the input, or listed in "
                f"{out.parent / INDEX}); write to another name, e.g. "
                f"{out.with_name(out.stem + '.consolidated.h5')}"
            )


def consolidate(path: Path, out: Path, **set_attrs: Any) -> Path:
    """One self-contained file: full parameters and full optimizer state (shards merged);
    ``set_attrs`` replace attributes (``reshard``)."""
    path, out = Path(path), Path(out)
    attrs = verify(path)
    if "layout" not in attrs:
        raise CheckpointError(f"{path} has no flat layout attribute: not a simdist checkpoint")
    check_output(path, out, attrs)
    layout = attrs["layout"]
    numel = int(layout["numel"])
    state = {}
    for key in optimizer_keys(path, attrs):
        flat = read_optimizer_range(path, attrs, key, 0, numel)
        state[key] = {
            name: flat[o : o + int(np.prod(s, dtype=np.int64))].reshape(s)
            for name, o, s in zip(layout["names"], layout["offsets"], layout["shapes"], strict=True)
        }
    with h5py.File(path, "r") as f:
        tensors = {k: f["model"][k][...] for k in f["model"]}
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            g = f.create_group("model")
            for k, v in tensors.items():
                g.create_dataset(k, data=v)
            o = f.create_group("optimizer")
            for key, per_name in state.items():
                s = o.create_group(key)
                for k, v in per_name.items():
                    s.create_dataset(k, data=v)
            merged = {**attrs, "optimizer_shards": [], "consolidated_from": str(path), **set_attrs}
            for k, v in merged.items():
                f.attrs[k] = json.dumps(v) if isinstance(v, dict | list) else v
        _commit(tmp, out)
    except OSError as e:  # full disk, no permission, OUT replaced by a directory meanwhile
        raise CheckpointError(f"cannot write OUT {out}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)  # a failure (or Ctrl-C) leaves no half-written file
    return out


def reshard(path: Path, out: Path, tensor_parallel: int, mode: str | None = None) -> Path:
    """A checkpoint for another tensor-parallel degree (and, with ``mode``, mode). Both
    modes save whole tensors: in batch mode every device of a group holds the whole model,
    and in weight mode rank 0 gathers the shards (each rank takes its slice when it
    resumes). So the tensors stay as they are; the file records the new degree (a run
    refuses a checkpoint of another degree, so the change is always explicit)."""
    if tensor_parallel < 1:
        raise CheckpointError(f"--tensor-parallel must be >= 1, got {tensor_parallel}")
    if mode is None:
        mode = verify(path).get("tensor_parallel_mode", "batch")
    if mode not in ("batch", "weight"):
        raise CheckpointError(f"--tensor-parallel-mode must be batch or weight, got {mode!r}")
    return consolidate(
        path,
        out,
        tensor_parallel=tensor_parallel,
        tensor_parallel_mode=mode,
        resharded_from=str(Path(path)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simdist.checkpoint")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consolidate", help="merge ZeRO optimizer shards into one file")
    c.add_argument("checkpoint")
    c.add_argument("out")
    i = sub.add_parser("info", help="print a checkpoint's attributes")
    i.add_argument("checkpoint")
    r = sub.add_parser("reshard", help="rewrite a checkpoint for another tensor-parallel degree")
    r.add_argument("checkpoint")
    r.add_argument("out")
    r.add_argument("--tensor-parallel", type=int, required=True)
    r.add_argument("--tensor-parallel-mode", default=None, help="default: the recorded mode")
    args = parser.parse_args(argv)
    try:
        if args.cmd in ("consolidate", "reshard") and not args.out:  # Path("") is "."
            raise CheckpointError("OUT is empty; give a file name such as consolidated.h5")
        if args.cmd == "consolidate":
            print(consolidate(Path(args.checkpoint), Path(args.out)))
        elif args.cmd == "reshard":
            out = reshard(
                Path(args.checkpoint), Path(args.out), args.tensor_parallel,
                args.tensor_parallel_mode,
            )  # fmt: skip
            print(out)
        else:
            print(json.dumps(verify(Path(args.checkpoint)), indent=1, default=str))
    except CheckpointError as e:
        print(f"simdist.checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
