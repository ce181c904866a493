"""Move weights between simdist checkpoints and the PyTorch / Hugging Face ecosystem.

simdist's GPT-2 uses Hugging Face's GPT-2 state-dict names and layouts (``wte.weight``,
``h.{i}.attn.c_attn.weight`` as [C, 3C], ...), so conversion is a change of container:
- safetensors, through the ``safetensors`` package (its NumPy API: no torch needed);
- a PyTorch state dict file (``torch.save``; export only, needs torch: import reads
  safetensors alone, since simdist never unpickles what it reads from disk).
Hugging Face checkpoints of ``GPT2LMHeadModel`` prefix names with ``transformer.`` and carry
``lm_head.weight`` (tied to ``wte.weight``) and attention mask buffers: import strips the
prefix, checks the tie, and drops the buffers.

    python -m simdist.interop export CHECKPOINT.h5 OUT.safetensors|OUT.pt
    python -m simdist.interop import IN.safetensors OUT.h5 [--model gpt2]

An imported file is a simdist checkpoint at global_step 0 without optimizer state: pass it
as ``--runconfig.checkpoint_path`` to start training from those weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

from simdist import checkpoint
from simdist.model_config import MODEL_CONFIGS


class InteropError(ValueError):
    pass


def _umask_mode() -> int:
    """The mode a new file gets from open() under this process's umask (read by setting it)."""
    mask = os.umask(0o22)
    os.umask(mask)
    return 0o666 & ~mask


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """Write ``tensors`` (and string ``metadata``, values converted with str) to ``path``:
    through a temporary file in its directory, renamed when complete."""
    path = Path(path)
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    meta = {k: str(v) for k, v in metadata.items()} if metadata else None
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        safetensors.numpy.save_file(arrays, name, metadata=meta)
        os.chmod(tmp, _umask_mode())  # mkstemp's 0600 would make the export private
        os.replace(tmp, path)
    except (SafetensorError, ValueError, TypeError) as e:
        raise InteropError(f"{path}: cannot write safetensors: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file, as NumPy arrays (the header is checked by the
    library: lengths, offsets and dtypes)."""
    try:
        return safetensors.numpy.load_file(str(path))
    except SafetensorError as e:
        raise InteropError(
            f"{path}: malformed safetensors file (header length or JSON header): {e}"
        ) from None
    except (ValueError, TypeError) as e:  # e.g. a dtype NumPy has no type for (BF16)
        raise InteropError(f"{path}: cannot read safetensors: {e}") from None


def normalize_hf(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face GPT2Model / GPT2LMHeadModel names -> simdist's."""
    out = {}
    for name, value in tensors.items():
        key = name.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) and key.count(".") == 3:
            continue  # causal-mask buffers, not parameters
        out[key] = value
    head = out.pop("lm_head.weight", None)
    if head is not None and "wte.weight" in out and not np.array_equal(head, out["wte.weight"]):
        raise InteropError("lm_head.weight differs from wte.weight: simdist's GPT-2 ties them")
    return out


def normalize_hf_bert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face BertForPreTraining names are simdist's; drop what simdist ties or
    derives: the MLM decoder (tied to the word embeddings, its bias to
    ``cls.predictions.bias``) and the ``position_ids`` / ``token_type_ids`` buffers."""
    out = dict(tensors)
    for tied, owner in (
        ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
        ("cls.predictions.decoder.bias", "cls.predictions.bias"),
    ):
        value = out.pop(tied, None)
        if value is not None and owner in out and not np.array_equal(value, out[owner]):
            raise InteropError(f"{tied} differs from {owner}: simdist's BERT ties them")
    for name in list(out):
        if name.endswith(("embeddings.position_ids", "embeddings.token_type_ids")):
            del out[name]
    return out


def normalize_hf_t5(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face T5ForConditionalGeneration names are simdist's; drop the stacks' copies
    of ``shared.weight`` and, when it equals it (tied embeddings), ``lm_head.weight``."""
    out = dict(tensors)
    for tied in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        value = out.get(tied)
        if value is None or "shared.weight" not in out:
            continue
        if np.array_equal(value, out["shared.weight"]):
            del out[tied]
        elif tied != "lm_head.weight":
            raise InteropError(f"{tied} differs from shared.weight: T5 shares them")
    return out


# model -> HF names to simdist's (else GPT-2's)
HF_NORMALIZERS = {"bert": normalize_hf_bert, "t5": normalize_hf_t5}
MODELS = tuple(MODEL_CONFIGS)  # the models simdist builds (model.name's choices)


def _template(name: str) -> str:
    return re.sub(r"\d+", "#", name)  # h.11.attn.c_attn.weight -> h.#.attn.c_attn.weight


def _configs(model: str) -> list:
    """Every preset of ``model`` (and, for T5, its gated-FFN / untied-head variants): the
    names a file of that model may hold are the union of theirs."""
    if model == "gpt2":
        from simdist.models import gpt2 as m

        return list(m.PRESETS.values())
    if model == "bert":
        from simdist.models import bert_shapes as m
    elif model == "t5":
        from simdist.models import t5_shapes as m

        return [
            m.resolve_config(p, feed_forward_proj=ff, tie_word_embeddings=tie)
            for p in m.PRESETS
            for ff in ("relu", "gated-gelu")
            for tie in (True, False)
        ]
    else:
        from simdist.models import transformer_shapes as m
    return [m.resolve_config(p) for p in m.PRESETS]


def name_templates(model: str) -> tuple[set[str], set[str]]:
    """(known, required): parameter names of ``model`` with layer numbers as ``#``; known
    is any variant's, required every variant's."""
    if model == "fc_mnist":  # sizes only in params.yaml; names fc1.weight, fc1.bias, ...
        names = {"fc#.weight", "fc#.bias"}
        return names, names
    if model == "gpt2":
        from simdist.models.gpt2 import parameter_specs
    elif model == "bert":
        from simdist.models.bert_shapes import parameter_specs
    elif model == "t5":
        from simdist.models.t5_shapes import parameter_specs
    else:
        from simdist.models.transformer_shapes import parameter_specs
    sets = [{_template(s.name) for s in parameter_specs(c)} for c in _configs(model)]
    return set.union(*sets), set.intersection(*sets)


def check_names(src: Path, model: str, names: list[str]) -> None:
    """Imported names (after normalising) must be ``model``'s: else the file is another
    model's, and training would fail later on "lacks parameter" or, worse, not at all."""
    known, required = name_templates(model)
    got = {_template(n) for n in names}
    unknown = sorted(n for n in names if _template(n) not in known)
    missing = sorted(required - got)
    if not unknown and not missing:
        return
    fits = [m for m in MODELS if m != model and _fits(m, got)]
    hint = (
        f"it looks like a {fits[0]} file: pass --model {fits[0]}"
        if fits
        else ("is it a checkpoint of another model? pass --model " + "|".join(MODELS))
    )
    what = []
    if unknown:
        what.append(
            f"{len(unknown)} tensor(s) {model} has no parameter for ({', '.join(unknown[:3])})"
        )
    if missing:
        what.append(f"no {', '.join(sorted(missing)[:3])} (# = a layer number)")
    raise InteropError(f"{src} is not a {model} state dict: {'; '.join(what)}; {hint}")


def _fits(model: str, got: set[str]) -> bool:
    known, required = name_templates(model)
    return got <= known and required <= got


def export(ckpt: Path, out: Path) -> Path:
    attrs = checkpoint.verify(ckpt)
    with h5py.File(ckpt, "r") as f:
        tensors = {k: f["model"][k][...] for k in f["model"]}
    meta = {
        "format": "pt",
        "simdist_model": attrs.get("model"),
        "global_step": attrs.get("global_step"),
    }
    if out.suffix == ".safetensors":
        write_safetensors(out, tensors, meta)
    elif out.suffix in (".pt", ".pth", ".bin"):
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, out)
    else:
        raise InteropError(f"{out}: use a .safetensors or .pt file name")
    return out


def import_(src: Path, out: Path, model: str = "gpt2") -> Path:
    if model not in MODELS:
        raise InteropError(
            f"--model {model!r} is not a simdist model; use one of {', '.join(MODELS)}"
        )
    if src.suffix != ".safetensors":
        # A .pt file needs unpickling, which simdist never does on what it reads. Convert
        # with PyTorch yourself and save it with safetensors.torch.save_file.
        raise InteropError(f"{src}: import reads .safetensors files only (no pickles)")
    if out.is_dir():  # also "" (Path("") is "."): h5py would fail on the temp name
        raise InteropError(f"OUT {out} is a directory; give a file name such as start.h5")
    tensors = read_safetensors(src)
    normalize = HF_NORMALIZERS.get(model, normalize_hf)
    tensors = {k: v.astype(np.float32) for k, v in normalize(tensors).items()}
    check_names(src, model, list(tensors))
    names = list(tensors)
    shapes = [list(v.shape) for v in tensors.values()]
    offsets = np.concatenate([[0], np.cumsum([v.size for v in tensors.values()])[:-1]]).tolist()
    numel = int(sum(v.size for v in tensors.values()))
    layout = {
        "numel": numel,
        "padded": numel,
        "world": 1,
        "names": names,
        "shapes": shapes,
        "offsets": [int(o) for o in offsets],
    }
    attrs = {
        "model": model,
        "world_size": 1,
        "zero_opt_level": 0,
        "optimizer_type": "none",
        "layout": layout,
        "imported_from": str(src),
    }
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            g = f.create_group("model")
            for k, v in tensors.items():
                g.create_dataset(k, data=v)
            for k, v in {**attrs, "global_step": 0, "optimizer_shards": []}.items():
                f.attrs[k] = json.dumps(v) if isinstance(v, dict | list) else v
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simdist.interop")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="simdist checkpoint -> .safetensors or .pt")
    e.add_argument("checkpoint", type=Path)
    e.add_argument("out", type=Path)
    i = sub.add_parser("import", help=".safetensors -> simdist checkpoint (step 0)")
    i.add_argument("source", type=Path)
    i.add_argument("out", type=Path)
    i.add_argument("--model", default="gpt2")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "export":
            print(export(args.checkpoint, args.out))
        else:
            print(import_(args.source, args.out, args.model))
    except (InteropError, checkpoint.CheckpointError, OSError) as err:
        print(f"simdist.interop: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
