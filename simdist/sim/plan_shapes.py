"""Plan mode's model shapes and closed-form memory (ZeRO model states, Korthikanti activations).

The formulas are described in ``simdist.sim.plan``'s docstring; this module holds the
shapes of the models plan mode knows (``MODELS``) and the two memory formulas, with no
time model and no profile.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

# -- model shapes ------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerSpec:
    """A transformer's shapes (GPT-2 layout unless fields say otherwise).

    ``n_layer`` counts every block that pipelining splits: a decoder-only (or encoder-only)
    stack, or an encoder-decoder's encoder plus decoder layers, of which the last
    ``cross_layers`` (the decoder's) add a cross-attention block (T5, Raffel et al. 2020).
    ``n_kv_head`` < ``n_head`` is grouped-query attention (Ainslie et al. 2023); ``gated``
    is a GLU feed-forward (SwiGLU / GeGLU, Shazeer 2020: gate and up projections of
    ``d_ff`` each, then the down projection)."""

    name: str
    n_layer: int
    n_head: int
    d_model: int
    vocab: int
    seq_len: int
    d_ff: int = 0  # 0: 4 * d_model
    tied_head: bool = True
    learned_pos: bool = True
    attn_bias: bool = True
    mlp_bias: bool = True
    head_bias: bool = False
    parallel_block: bool = False  # GPT-J: one LayerNorm, attention and MLP side by side
    source: str = ""
    n_kv_head: int = 0  # 0: n_head (multi-head attention)
    gated: bool = False
    cross_layers: int = 0  # layers with a cross-attention block (an encoder-decoder's decoder)
    rms_norm: bool = False  # RMSNorm (a weight, no bias) instead of LayerNorm
    relative_pos: bool = False  # T5's relative position bias: 32 buckets x heads per stack
    extra_params: int = 0  # outside blocks, embeddings and head (BERT's pooler, MLM transform)

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def _attn_params(self) -> int:
        h = self.d_model
        if self.kv_heads == self.n_head:
            return 4 * h * h + (4 * h if self.attn_bias else 0)
        kv = 2 * (h // self.n_head) * self.kv_heads  # K and V projections' output width
        return 2 * h * h + h * kv + ((2 * h + kv) if self.attn_bias else 0)

    def layer_params(self) -> int:
        """Parameters of one block without cross-attention."""
        h, f = self.d_model, self.ffn
        n_ln = 1 if self.parallel_block else 2
        ln = self.d_model if self.rms_norm else 2 * self.d_model
        n_in = 2 if self.gated else 1  # gate and up projections
        mlp = (n_in + 1) * h * f + ((n_in * f + h) if self.mlp_bias else 0)
        return n_ln * ln + self._attn_params() + mlp

    def cross_params(self) -> int:
        """What a cross-attention block (its LayerNorm and attention) adds to a layer."""
        return (1 if self.rms_norm else 2) * self.d_model + self._attn_params()

    def param_count(self) -> int:
        cached = self.__dict__.get("_param_count")  # a search asks many times per spec
        if cached is None:
            cached = self._count()
            object.__setattr__(self, "_param_count", cached)  # not a field: eq/hash unchanged
        return cached

    def _count(self) -> int:
        h, v = self.d_model, self.vocab
        emb = v * h + (self.seq_len * h if self.learned_pos else 0)
        head = 0 if self.tied_head else h * v + (v if self.head_bias else 0)
        cross = self.cross_layers * self.cross_params()
        # an encoder-decoder has a final LayerNorm after each stack
        stacks = 2 if self.cross_layers else 1
        final_ln = (1 if self.rms_norm else 2) * h * stacks
        rel = 32 * self.n_head * stacks if self.relative_pos else 0  # T5's 32 buckets
        blocks = self.n_layer * self.layer_params() + cross
        return emb + blocks + final_ln + head + rel + self.extra_params


@dataclass(frozen=True)
class MLPSpec:
    """A fully connected network (ReLU, softmax cross-entropy)."""

    name: str
    sizes: tuple[int, ...]
    source: str = ""

    def param_count(self) -> int:
        return sum(a * b + b for a, b in zip(self.sizes, self.sizes[1:], strict=False))


@dataclass(frozen=True)
class CountSpec:
    """Only a parameter count: model states are planned, activations and time are not."""

    name: str
    params: int
    source: str = "--params-count"

    def param_count(self) -> int:
        return self.params


# -- model shape files ---------------------------------------------------------------------

# key -> (type, what it means); a shape file gives a transformer (or, kind: mlp, a network of
# fully connected layers) by its shapes. Presets ship in simdist/models/shapes/*.yaml.
SHAPE_KEYS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "name": (str, "the model's name (default: the file's stem)"),
    "kind": (str, "transformer (default) or mlp"),
    "source": (str, "where the shapes come from"),
    "layers": (int, "blocks of a decoder-only stack (same as decoder_layers)"),
    "encoder_layers": (int, "encoder blocks (with decoder_layers: an encoder-decoder)"),
    "decoder_layers": (int, "decoder blocks (cross-attention when encoder_layers is given)"),
    "hidden": (int, "model width d_model"),
    "heads": (int, "attention (query) heads"),
    "kv_heads": (int, "key/value heads (< heads: grouped-query attention; default heads)"),
    "ffn": (int, "feed-forward width (default 4 * hidden)"),
    "ffn_kind": (str, "gelu (two matrices) or gated (three: SwiGLU / GeGLU)"),
    "vocab": (int, "vocabulary size"),
    "seq_len": (int, "sequence length (context)"),
    "tied_embeddings": (bool, "output head shares the input embedding (default true)"),
    "position": (
        str,
        "learned (a table of seq_len x hidden), rotary, relative (T5's bias: 32 buckets x "
        "heads per stack) or none",
    ),
    "norm": (str, "layernorm (weight and bias, default) or rmsnorm (weight only)"),
    "attn_bias": (bool, "attention projections have biases (default true)"),
    "mlp_bias": (bool, "feed-forward projections have biases (default true)"),
    "head_bias": (bool, "an untied output head has a bias (default false)"),
    "parallel_block": (bool, "attention and MLP side by side after one LayerNorm (GPT-J)"),
    "extra_params": (int, "parameters outside the blocks, embeddings and head (default 0)"),
    "sizes": (list, "kind: mlp only: layer widths, input first"),
}


class ShapeError(ValueError):
    """A bad model shape file or override; the message names the key and where it was given."""


@cache
def shape_files() -> dict[str, Any]:
    """The shipped presets: name -> resource (``simdist/models/shapes/NAME.yaml``)."""
    root = resources.files("simdist") / "models" / "shapes"
    return {
        p.name[:-5]: p
        for p in sorted(root.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".yaml")
    }


def _read_shape(text: str, source: str) -> tuple[dict[str, Any], dict[str, int]]:
    from simdist.typed_yaml import ConfigError, read_yaml  # duplicate keys, line of each key

    try:
        data, lines = read_yaml(text, source)
    except ConfigError as e:
        raise ShapeError(str(e)) from None
    if not isinstance(data, dict):
        raise ShapeError(f"{source}: expected a mapping of shape keys, got {type(data).__name__}")
    return data, lines


def spec_from_shape(
    data: dict[str, Any], where: dict[str, str], default_name: str
) -> TransformerSpec | MLPSpec:
    """Build a spec from shape keys; ``where[key]`` says where each key was given."""

    def fail(key: str, msg: str) -> ShapeError:
        return ShapeError(f"{where.get(key, where.get('', ''))}: {key}: {msg}")

    for key, value in data.items():
        if key not in SHAPE_KEYS:
            close = difflib.get_close_matches(str(key), SHAPE_KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise fail(str(key), f"unknown key{hint}; known: {', '.join(SHAPE_KEYS)}")
        typ = SHAPE_KEYS[key][0]
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if not ok:
            raise fail(key, f"expected {typ.__name__}, got {value!r}")
        zero_ok = key.endswith("layers") or key == "extra_params"
        if typ is int and value < (0 if zero_ok else 1):
            raise fail(key, f"must be {'>= 0' if zero_ok else '>= 1'}, got {value}")
    name = data.get("name", default_name)
    kind = data.get("kind", "transformer")
    source = data.get("source", "")
    if kind == "mlp":
        for key in data:
            if key not in ("name", "kind", "source", "sizes"):
                raise fail(key, "not a key of kind: mlp (name, kind, source, sizes)")
        sizes = data.get("sizes")
        if not sizes or len(sizes) < 2 or not all(isinstance(n, int) and n > 0 for n in sizes):
            raise fail("sizes", f"expected a list of >= 2 positive widths, got {sizes!r}")
        return MLPSpec(name, tuple(sizes), source=source)
    if kind != "transformer":
        raise fail("kind", f"expected transformer or mlp, got {kind!r}")
    if "sizes" in data:
        raise fail("sizes", "only for kind: mlp")
    for key in ("hidden", "heads", "vocab", "seq_len"):
        if key not in data:
            raise fail(key, "missing (a transformer needs hidden, heads, vocab, seq_len, layers)")
    enc, dec = data.get("encoder_layers", 0), data.get("decoder_layers", 0)
    if "layers" in data:
        if "decoder_layers" in data or "encoder_layers" in data:
            raise fail("layers", "give layers, or encoder_layers and/or decoder_layers")
        dec = data["layers"]
    if enc + dec < 1:
        raise fail("layers", "missing (layers, or encoder_layers / decoder_layers >= 1)")
    h, a = data["hidden"], data["heads"]
    kv = data.get("kv_heads", a)
    if h % a:
        raise fail("heads", f"hidden ({h}) must be a multiple of heads ({a})")
    if a % kv:
        raise fail("kv_heads", f"heads ({a}) must be a multiple of kv_heads ({kv})")
    ffn_kind = data.get("ffn_kind", "gelu")
    if ffn_kind not in ("gelu", "gated"):
        raise fail("ffn_kind", f"expected gelu or gated, got {ffn_kind!r}")
    position = data.get("position", "learned")
    if position not in ("learned", "rotary", "relative", "none"):
        raise fail("position", f"expected learned, rotary, relative or none, got {position!r}")
    norm = data.get("norm", "layernorm")
    if norm not in ("layernorm", "rmsnorm"):
        raise fail("norm", f"expected layernorm or rmsnorm, got {norm!r}")
    parallel = data.get("parallel_block", False)
    if parallel and enc and dec:
        raise fail("parallel_block", "not with an encoder-decoder")
    ffn = data.get("ffn", 4 * h)
    return TransformerSpec(
        name,
        enc + dec,
        a,
        h,
        data["vocab"],
        data["seq_len"],
        d_ff=0 if ffn == 4 * h else ffn,
        tied_head=data.get("tied_embeddings", True),
        learned_pos=position == "learned",
        relative_pos=position == "relative",
        rms_norm=norm == "rmsnorm",
        attn_bias=data.get("attn_bias", True),
        mlp_bias=data.get("mlp_bias", True),
        head_bias=data.get("head_bias", False),
        parallel_block=parallel,
        source=source,
        n_kv_head=0 if kv == a else kv,
        gated=ffn_kind == "gated",
        cross_layers=dec if enc else 0,
        extra_params=data.get("extra_params", 0),
    )


def is_shape_path(model: str) -> bool:
    """Whether ``--model`` names a shape file rather than a preset: it has a path separator
    or a .yaml / .yml suffix. Anything else is a preset name, whatever the current directory
    holds (a folder ``gpt2/`` there must not shadow the preset)."""
    return "/" in model or "\\" in model or Path(model).suffix in (".yaml", ".yml")


def load_shape(model: str, overrides: dict[str, Any] | None = None) -> TransformerSpec | MLPSpec:
    """A preset name or a shape file's path (see ``is_shape_path``), with
    ``--model.KEY=VALUE`` overrides applied."""
    if is_shape_path(model):
        path = Path(model)
        if not path.is_file():
            raise ShapeError(
                f"--model {model!r}: model shape file does not exist (give a YAML file's path "
                "or a preset name)"
            )
        text, source, stem = path.read_text(), str(path), path.stem
    else:
        files = shape_files()
        if model not in files:
            hint = f" (a file here? give it as ./{model})" if Path(model).is_file() else ""
            raise ShapeError(
                f"--model: unknown model '{model}'{hint}; available: {', '.join(files)} "
                "(or a shape file's path: with a / or a .yaml suffix; or --params-count)"
            )
        text, source, stem = files[model].read_text(), f"preset {model}", model
    data, lines = _read_shape(text, source)
    where = {k: f"{source}:{n}" for k, n in lines.items()}
    where[""] = source
    for key, value in (overrides or {}).items():
        data[key] = value
        where[key] = f"--model.{key}={value}"
    if overrides and "name" not in overrides:
        data["name"] = (
            data.get("name", stem) + "+" + ",".join(f"{k}={v}" for k, v in overrides.items())
        )
    return spec_from_shape(data, where, stem)


class _Presets(Mapping[str, "TransformerSpec | MLPSpec"]):
    """The shipped presets by name, each read from the package on first use: importing plan
    mode (or printing its --help) reads no shape file."""

    def __init__(self) -> None:
        self._specs: dict[str, TransformerSpec | MLPSpec] = {}

    def __getitem__(self, name: str) -> TransformerSpec | MLPSpec:
        if name not in self._specs:
            if name not in shape_files():
                raise KeyError(name)
            self._specs[name] = load_shape(name)
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(shape_files())

    def __len__(self) -> int:
        return len(shape_files())


# the shipped presets in the order of simdist/models/shapes (alphabetical)
MODELS: Mapping[str, TransformerSpec | MLPSpec] = _Presets()


# -- memory formulas -----------------------------------------------------------------------


def model_state_bytes(
    params: int, dp: int, zero: int, precision: str = "mixed", optimizer: str = "adam"
) -> dict[str, int]:
    """Per-device parameters / gradients / optimizer state (ZeRO paper §5 notation)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if precision not in ("mixed", "fp32"):
        raise ValueError(f"precision must be mixed or fp32, got {precision!r}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be adam or sgd, got {optimizer!r}")
    w = g = 2 if precision == "mixed" else 4
    # K: fp32 master (mixed only) + Adam m, v (or one momentum buffer for SGD)
    k = (4 if precision == "mixed" else 0) + (8 if optimizer == "adam" else 4)
    shard = math.ceil(params / dp)
    return {
        "parameters": w * (shard if zero >= 3 else params),
        "gradients": g * (shard if zero >= 2 else params),
        "optimizer_state": k * (shard if zero >= 1 else params),
    }


def layer_activation_bytes(
    spec: TransformerSpec,
    micro_batch: int,
    seq: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    elem: int = 2,
    cross: bool = False,
) -> int:
    """Activation bytes one transformer layer stores for backward (Korthikanti §4).

    Grouped-query attention stores K and V at kv_heads/heads of the size; a gated MLP stores
    the gate and up outputs and their product (3 e·sbf instead of GELU's input and output,
    2 e·sbf); ``cross``: a decoder layer's cross-attention block stores what a
    self-attention block does (its LayerNorm input, Q/K/V, scores, projection input and
    dropout mask), the encoder output it attends to being held once per micro-batch."""
    s, b, h, a, f, t = seq, micro_batch, spec.d_model, spec.n_head, spec.ffn, tp
    sbh, sbf, as2b = s * b * h, s * b * f, a * s * s * b
    if recompute == "full":
        return sbh * elem // (t if sequence_parallel else 1)
    # replicated across TP ranks unless sequence parallel: LN inputs, QKV and fc1 inputs, masks
    replicated = (4 * elem + 2) * sbh
    if spec.kv_heads == a and not spec.gated:
        split = 4 * elem * sbh + 2 * elem * sbf  # Q, K, V, projection input, GELU in/out
    else:
        qkvo = elem * sbh * (2 + 2 * spec.kv_heads / a)  # Q, projection input, K, V
        split = int(qkvo) + (3 if spec.gated else 2) * elem * sbf
    scores = 0 if recompute == "selective" else (2 * elem + 1) * as2b
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if cross:  # LN input, Q/KV input, dropout mask; Q, K, V, projection input; scores
        replicated += (2 * elem + 1) * sbh
        split += int(elem * sbh * (2 + 2 * spec.kv_heads / a))
        scores *= 2
    if sequence_parallel:
        return (replicated + split + scores) // t
    return replicated + split // t + scores // t


def is_gpt2_layout(spec: TransformerSpec) -> bool:
    """A transformer simdist's own GPT-2 model can run (``simdist.models.gpt2``)."""
    return (
        spec.ffn == 4 * spec.d_model
        and spec.tied_head
        and spec.learned_pos
        and spec.attn_bias
        and spec.mlp_bias
        and not spec.head_bias
        and not spec.parallel_block
        and spec.kv_heads == spec.n_head
        and not spec.gated
        and not spec.cross_layers
        and not spec.rms_norm
        and not spec.relative_pos
    )


__all__ = [
    "MODELS",
    "SHAPE_KEYS",
    "ShapeError",
    "CountSpec",
    "MLPSpec",
    "TransformerSpec",
    "is_gpt2_layout",
    "is_shape_path",
    "layer_activation_bytes",
    "load_shape",
    "model_state_bytes",
    "shape_files",
    "spec_from_shape",
]
