"""BERT's configuration, presets and sizes, without allocating anything.

What ``simdist.models.bert`` (the model), its cost list (``bert_costs``), the memory plan
and ``python -m simdist.plan`` need to know of a BERT before it exists: ``BertConfig`` with
its presets, the parameter list in Hugging Face ``BertForPreTraining`` names, the
activation arena's layout and the shapes plan mode looks up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simdist.config import ConfigError

from .base import ParamSpec
from .presets import resolve_preset
from .saved_words import aligned_layout

F32 = np.float32
INT_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
    "vocab_size",
    "type_vocab_size",
    "max_seq_length",
    "max_predictions_per_seq",
)
FLOAT_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "layer_norm_eps")


@dataclass(frozen=True)
class BertConfig:
    num_hidden_layers: int
    num_attention_heads: int
    hidden_size: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int
    type_vocab_size: int
    max_seq_length: int  # T of every training sequence (<= max_position_embeddings)
    max_predictions_per_seq: int  # P masked positions per sequence
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0
    layer_norm_eps: float = 1e-12  # Hugging Face BertConfig's default (and Devlin et al.'s)

    def __post_init__(self) -> None:
        for key in INT_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.max_seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"model.max_seq_length ({self.max_seq_length}) exceeds "
                f"model.max_position_embeddings ({self.max_position_embeddings})"
            )
        if self.max_seq_length < 8:
            raise ConfigError(f"model.max_seq_length must be >= 8, got {self.max_seq_length}")
        if self.max_predictions_per_seq > self.max_seq_length - 3:
            raise ConfigError(
                f"model.max_predictions_per_seq ({self.max_predictions_per_seq}) must leave "
                f"room for [CLS] and two [SEP] in max_seq_length ({self.max_seq_length})"
            )
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            p = getattr(self, key)
            if not isinstance(p, int | float) or not 0.0 <= p < 1.0:
                raise ConfigError(f"model.{key} must lie in [0, 1), got {p!r}")
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0.0 < eps < 1.0:
            raise ConfigError(f"model.layer_norm_eps must lie in (0, 1), got {eps!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(
                f"model.pad_token_id must lie in [0, vocab_size), got {self.pad_token_id}"
            )

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _preset(L: int, H: int, A: int, P: int, V: int, T: int) -> dict:
    return dict(
        num_hidden_layers=L,
        num_attention_heads=A,
        hidden_size=H,
        intermediate_size=4 * H,
        max_position_embeddings=P,
        vocab_size=V,
        type_vocab_size=2,
        max_seq_length=T,
        max_predictions_per_seq=max(1, round(0.15 * T)),
    )


# bert-mini: Turc et al.'s BERT-Mini shape (L4 H256 A4) on simdist's byte vocabulary
# (simdist.data.bert: 4 special tokens + 256 bytes); base and large: Devlin et al.'s shapes
# with the WordPiece vocabulary size, sequence 512 (for simulation and plan mode).
PRESETS: dict[str, dict] = {
    "bert-mini": _preset(4, 256, 4, 128, 260, 128),
    "bert-base": _preset(12, 768, 12, 512, 30522, 512),
    "bert-large": _preset(24, 1024, 16, 512, 30522, 512),
}
PRESETS["bert-base"]["max_predictions_per_seq"] = 80  # Devlin et al.: 20 at 128, 80 at 512
PRESETS["bert-large"]["max_predictions_per_seq"] = 80


def resolve_config(preset: str | None = None, **overrides) -> BertConfig:
    """A preset with some fields replaced (None = keep); without a preset all are needed.
    A given max_seq_length without max_predictions_per_seq masks 15 % of it."""
    fields = INT_FIELDS + FLOAT_FIELDS + ("pad_token_id",)
    seq = overrides.get("max_seq_length")
    if seq is not None and overrides.get("max_predictions_per_seq") is None:
        overrides["max_predictions_per_seq"] = max(1, round(0.15 * seq))
    return BertConfig(**resolve_preset("BERT", PRESETS, fields, INT_FIELDS, preset, overrides))


# ------------------------------------------------------------------ sizes without allocating
LAYER_PARAMS = (
    "attention.self.query.weight",
    "attention.self.query.bias",
    "attention.self.key.weight",
    "attention.self.key.bias",
    "attention.self.value.weight",
    "attention.self.value.bias",
    "attention.output.dense.weight",
    "attention.output.dense.bias",
    "attention.output.LayerNorm.weight",
    "attention.output.LayerNorm.bias",
    "intermediate.dense.weight",
    "intermediate.dense.bias",
    "output.dense.weight",
    "output.dense.bias",
    "output.LayerNorm.weight",
    "output.LayerNorm.bias",
)
EMBED_PARAMS = (
    "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight",
    "bert.embeddings.LayerNorm.weight",
    "bert.embeddings.LayerNorm.bias",
)
HEAD_PARAMS = (
    "bert.pooler.dense.weight",
    "bert.pooler.dense.bias",
    "cls.predictions.bias",
    "cls.predictions.transform.dense.weight",
    "cls.predictions.transform.dense.bias",
    "cls.predictions.transform.LayerNorm.weight",
    "cls.predictions.transform.LayerNorm.bias",
    "cls.seq_relationship.weight",
    "cls.seq_relationship.bias",
)


def parameter_specs(cfg: BertConfig) -> list[ParamSpec]:
    """BertForPreTraining's state-dict order, names and shapes (tied decoder omitted);
    weight decay for matrices and embeddings (ndim >= 2), not biases or LayerNorms."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = dict(
        zip(
            EMBED_PARAMS,
            [(V, H), (cfg.max_position_embeddings, H), (cfg.type_vocab_size, H), (H,), (H,)],
            strict=True,
        )
    )
    layer = [(H, H), (H,)] * 4 + [(H,), (H,), (I, H), (I,), (H, I), (H,), (H,), (H,)]
    for i in range(cfg.num_hidden_layers):
        for p, s in zip(LAYER_PARAMS, layer, strict=True):
            shapes[f"bert.encoder.layer.{i}.{p}"] = s
    head = [(H, H), (H,), (V,), (H, H), (H,), (H,), (H,), (2, H), (2,)]
    shapes.update(zip(HEAD_PARAMS, head, strict=True))
    return [ParamSpec(n, s, len(s) >= 2) for n, s in shapes.items()]


def num_parameters(cfg: BertConfig) -> int:
    return sum(s.numel for s in parameter_specs(cfg))


ARENA_ALIGN = 16  # elements (64 bytes): every tensor on its own cache line


def activation_shapes(
    cfg: BertConfig, B: int, packed: bool = False
) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every arena tensor for micro-batch B, in arena order. int32 and
    uint64 tensors are carved from the float32 arena (aligned, so the views are legal).
    ``packed``: the ``PACKED`` tensors are float32 working copies of ``working_copies``
    layers, not of every layer (their L layers are in the uint16 store of ``saved_shapes``)."""
    shapes = _activation_shapes(cfg, B)
    if packed:
        for name in PACKED:
            shape, dtype = shapes[name]
            shapes[name] = ((working_copies(cfg, name), *shape[1:]), dtype)
    return shapes


# a layer's tensors that its backward reads, held as 16-bit words in mixed precision: its
# own (final when the layer ends) and its output h, packed by the next layer (the input it
# may have received from a pipeline stage); the last layer's h is read by no backward
OWN_PACKED = ("q", "k", "v", "ctx", "res1", "a1", "inter", "inter_g", "res2")
PACKED = (*OWN_PACKED, "h")


def working_copies(cfg: BertConfig, name: str) -> int:
    """Layers of float32 working copies of a packed tensor: two of the layers' output
    (layer i reads layer i - 1's h while it writes its own), one of the rest."""
    return min(cfg.num_hidden_layers, 2 if name == "h" else 1)


def saved_shapes(cfg: BertConfig, B: int) -> dict[str, tuple[int, ...]]:
    """The uint16 store of mixed precision: every layer's ``PACKED`` tensors."""
    shapes = _activation_shapes(cfg, B)
    return {name: shapes[name][0] for name in PACKED}


def _activation_shapes(cfg: BertConfig, B: int) -> dict[str, tuple[tuple[int, ...], str]]:
    L, H, I, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    T, P, NH, hs = (
        cfg.max_seq_length,
        cfg.max_predictions_per_seq,
        cfg.num_attention_heads,
        cfg.head_size,
    )
    N, M = B * T, B * P
    f, i = "f4", "i4"
    return {
        "tokens": ((B, T), i),
        "types": ((B, T), i),
        "rows": ((M,), i),  # flat row (b * T + position) of each masked position
        "labels": ((M,), i),
        "nsp_labels": ((B,), i),
        "cls_rows": ((B,), i),
        "keys": ((B,), "u8"),  # dropout keys: 2 float32 slots each
        "keep": ((B, T), f),  # 1 for real keys, 0 for padding
        "emb": ((N, H), f),  # word + position + segment: the embedding LayerNorm's input
        "emb_mean": ((N,), f),
        "emb_rstd": ((N,), f),
        "x0": ((N, H), f),  # dropout(LayerNorm(emb)): the encoder's input
        "q": ((L, N, H), f),
        "k": ((L, N, H), f),
        "v": ((L, N, H), f),
        "att": ((L, B, NH, T, T), f),  # softmax before dropout
        "ctx": ((L, N, H), f),
        "res1": ((L, N, H), f),  # x + dropout(attention output dense): LayerNorm 1 input
        "a1": ((L, N, H), f),
        "a1_mean": ((L, N), f),
        "a1_rstd": ((L, N), f),
        "inter": ((L, N, I), f),
        "inter_g": ((L, N, I), f),
        "res2": ((L, N, H), f),  # a1 + dropout(output dense): LayerNorm 2 input
        "h": ((L, N, H), f),  # the layer's output
        "h_mean": ((L, N), f),
        "h_rstd": ((L, N), f),
        # masked-LM head on the M masked rows
        "mlm_in": ((M, H), f),
        "t_dense": ((M, H), f),
        "t_gelu": ((M, H), f),
        "t_ln": ((M, H), f),
        "t_mean": ((M,), f),
        "t_rstd": ((M,), f),
        "logits": ((M, V), f),
        "probs": ((M, V), f),  # backward overwrites with dlogits
        "mlm_losses": ((M,), f),
        # pooler + NSP head on the [CLS] rows
        "cls": ((B, H), f),
        "pooled_pre": ((B, H), f),
        "pooled": ((B, H), f),
        "nsp_logits": ((B, 2), f),
        "nsp_probs": ((B, 2), f),
        "nsp_losses": ((B,), f),
        # gradients of activations, reused layer after layer
        "dres": ((N, H), f),
        "dln": ((N, H), f),
        "dctx": ((N, H), f),
        "dq": ((N, H), f),
        "dk": ((N, H), f),
        "dv": ((N, H), f),
        "dinter_g": ((N, I), f),
        "dinter": ((N, I), f),
        "dm1": ((M, H), f),
        "dm2": ((M, H), f),
        "db1": ((B, H), f),
        "db2": ((B, H), f),
        "att_scratch": ((7, T, hs), f),
        "att_dscores": ((T, T), f),
    }


def arena_layout(cfg: BertConfig, B: int, packed: bool = False) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total float32 elements) of the arena (``packed``: with
    working copies of the packed tensors, ``activation_shapes``)."""
    sizes = {
        name: math.prod(shape) * (2 if dtype == "u8" else 1)
        for name, (shape, dtype) in activation_shapes(cfg, B, packed).items()
    }
    return aligned_layout(sizes, ARENA_ALIGN)


def store_layout(cfg: BertConfig, B: int) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total uint16 words) of mixed precision's 16-bit store."""
    return aligned_layout({n: math.prod(s) for n, s in saved_shapes(cfg, B).items()}, ARENA_ALIGN)


def activation_bytes(cfg: BertConfig, batch_size: int) -> int:
    """The arena in float32 words, every layer's tensors (the device's layout)."""
    return 4 * arena_layout(cfg, batch_size)[1]


def flops_per_sample(cfg: BertConfig) -> int:
    """Forward + backward matrix-product FLOPs of one sequence (3x the forward's):
    per token and layer 2 (4 H^2 + 2 H I) for the projections and feed-forward, plus
    4 T H for q k^T and p v; the pooler and NSP once per sequence, the MLM transform and
    decoder on the P masked positions."""
    L, H, I, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    T, P = cfg.max_seq_length, cfg.max_predictions_per_seq
    fwd = T * L * (2 * (4 * H * H + 2 * H * I) + 4 * T * H)
    fwd += 2 * (H * H + 2 * H) + P * 2 * (H * H + H * V)
    return 3 * fwd


def plan_shape(cfg) -> dict:
    """The shapes ``simdist.plan`` needs for a BERT config: its ``TransformerSpec`` fields
    (the encoder layer is GPT-2's: 4 H^2 attention and 2 H I feed-forward, all biased, two
    LayerNorms) plus the exact parameter count, which adds segment embeddings, pooler, MLM
    transform and decoder bias to the spec's tied-embedding count."""
    return {
        "n_layer": cfg.num_hidden_layers,
        "n_head": cfg.num_attention_heads,
        "d_model": cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "seq_len": cfg.max_seq_length,
        "d_ff": cfg.intermediate_size,
        "tied_head": True,
        "learned_pos": True,
        "param_count": num_parameters(cfg),
    }


def plan_models() -> dict[str, dict]:
    """``plan_shape`` of every BERT preset, by preset name (bert-mini, bert-base, bert-large):
    what ``python -m simdist.plan --model bert-large`` should look up."""
    return {name: plan_shape(resolve_config(name)) for name in PRESETS}
