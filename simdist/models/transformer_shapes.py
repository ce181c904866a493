"""The AIAYN Transformer's configuration, presets, names and sizes: known without
allocating or compiling anything (``simdist.models.transformer`` describes the model).

Keys are ``torch.nn.Transformer``'s (d_model, nhead, num_encoder_layers,
num_decoder_layers, dim_feedforward, dropout) plus the vocabulary, the sequence lengths,
label smoothing and how many held-out pairs evaluation decodes greedily. Presets:
transformer-mini (tests and benchmarks, simdist's byte vocabulary), transformer-base and
transformer-big (Vaswani et al. 2017, table 3, with the paper's shared 37000-token
vocabulary; for simulation and plan mode). Also the activation arena's layout, the dropout
sites and ``plan_models()``, the presets as plan mode's shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simdist.config import ConfigError

from .base import ParamSpec
from .presets import resolve_preset
from .saved_words import aligned_layout

INT_FIELDS = (
    "num_encoder_layers",
    "num_decoder_layers",
    "nhead",
    "d_model",
    "dim_feedforward",
    "vocab_size",
    "max_seq_length",
    "target_length",
)
FIELDS = INT_FIELDS + ("dropout", "label_smoothing", "greedy_eval_samples")


@dataclass(frozen=True)
class TransformerConfig:
    num_encoder_layers: int
    num_decoder_layers: int
    nhead: int
    d_model: int
    dim_feedforward: int
    vocab_size: int
    max_seq_length: int  # encoder tokens per sample (source bytes, EOS, padding)
    target_length: int  # decoder tokens per sample (target bytes, EOS, padding)
    dropout: float = 0.1
    label_smoothing: float = 0.1
    greedy_eval_samples: int = 64  # held-out pairs evaluation decodes greedily (exact match)
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        for key in INT_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key} must be a positive integer, got {value!r}")
        if self.d_model % self.nhead:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be a multiple of model.nhead ({self.nhead})",
                "model.d_model",
            )
        for key in ("max_seq_length", "target_length"):
            if getattr(self, key) < 2:
                raise ConfigError(f"model.{key} must be >= 2 (a token and EOS)", f"model.{key}")
        if self.vocab_size < 4:
            raise ConfigError("model.vocab_size must be >= 4 (pad, bos, eos and a token)")
        for key in ("dropout", "label_smoothing"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"model.{key} must lie in [0, 1), got {getattr(self, key)}")
        g = self.greedy_eval_samples
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ConfigError(f"model.greedy_eval_samples must be >= 0, got {g!r}")

    @property
    def head_size(self) -> int:
        return self.d_model // self.nhead


def _preset(L: int, NH: int, D: int, F: int, V: int, T: int, p: float) -> dict:
    return dict(
        num_encoder_layers=L, num_decoder_layers=L, nhead=NH, d_model=D, dim_feedforward=F,
        vocab_size=V, max_seq_length=T, target_length=T, dropout=p, label_smoothing=0.1,
    )  # fmt: skip


# transformer-mini: simdist's byte vocabulary (simdist.data.transformer: pad, bos, eos and
# 256 bytes) and 32-token pairs; base and big: the paper's table 3 (big with dropout 0.3,
# its EN-DE setting), 37000 shared BPE tokens, sequences of 256 (simulation and plan mode).
PRESETS: dict[str, dict] = {
    "transformer-mini": _preset(3, 4, 128, 512, 259, 32, 0.1),
    "transformer-base": _preset(6, 8, 512, 2048, 37000, 256, 0.1),
    "transformer-big": _preset(6, 16, 1024, 4096, 37000, 256, 0.3),
}


def resolve_config(preset: str | None = None, **overrides) -> TransformerConfig:
    """A preset with some fields replaced (None = keep); without a preset all are needed."""
    values = resolve_preset("Transformer", PRESETS, FIELDS, INT_FIELDS, preset, overrides)
    return TransformerConfig(**values)


# ------------------------------------------------------------------ names and sizes
EMBED = "embedding.weight"
ATTN = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
FFN = ("linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias")


def layer_names(stack: str, i: int) -> tuple[str, ...]:
    """One layer's parameters, ``torch.nn.Transformer``'s state-dict names and order:
    attention(s), feed-forward, then the norms (two, or three in a decoder layer)."""
    p = f"{stack}.layers.{i}"
    attn = ["self_attn"] + (["multihead_attn"] if stack == "decoder" else [])
    names = [f"{p}.{a}.{n}" for a in attn for n in ATTN]
    names += [f"{p}.{n}" for n in FFN]
    norms = 3 if stack == "decoder" else 2
    names += [f"{p}.norm{k}.{w}" for k in range(1, norms + 1) for w in ("weight", "bias")]
    return tuple(names)


def final_norm_names(stack: str) -> tuple[str, str]:
    return (f"{stack}.norm.weight", f"{stack}.norm.bias")


def parameter_specs(cfg: TransformerConfig) -> list[ParamSpec]:
    """The shared embedding (also the output projection), then ``nn.Transformer``'s state
    dict: encoder layers, the encoder's final norm, decoder layers, the decoder's. Weight
    decay for matrices and the embedding, not biases or norms."""
    D, F = cfg.d_model, cfg.dim_feedforward
    shape = {
        "in_proj_weight": (3 * D, D), "in_proj_bias": (3 * D,), "out_proj.weight": (D, D),
        "out_proj.bias": (D,), "linear1.weight": (F, D), "linear1.bias": (F,),
        "linear2.weight": (D, F), "linear2.bias": (D,),
    }  # fmt: skip
    specs = [(EMBED, (cfg.vocab_size, D))]
    for stack, n in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(n):
            for name in layer_names(stack, i):
                key = name.split(".", 3)[-1].removeprefix("self_attn.")
                key = key.removeprefix("multihead_attn.")
                specs.append((name, (D,) if ".norm" in name else shape[key]))
        specs += [(n, (D,)) for n in final_norm_names(stack)]
    return [ParamSpec(n, s, len(s) >= 2) for n, s in specs]


def num_parameters(cfg: TransformerConfig) -> int:
    return sum(s.numel for s in parameter_specs(cfg))


def flops_per_sample(cfg: TransformerConfig) -> int:
    """Forward + backward matrix-product FLOPs of one sample (3x the forward's)."""
    D, F, V = cfg.d_model, cfg.dim_feedforward, cfg.vocab_size
    Te, Td = cfg.max_seq_length, cfg.target_length
    enc = Te * (2 * (4 * D * D + 2 * D * F) + 4 * Te * D)
    dec = Td * (2 * (6 * D * D + 2 * D * F) + 4 * Td * D + 4 * Te * D) + Te * 2 * 2 * D * D
    fwd = cfg.num_encoder_layers * enc + cfg.num_decoder_layers * dec + Td * 2 * D * V
    return 3 * fwd


def sites(cfg: TransformerConfig) -> dict:
    """Dropout sites: the encoder's embedding, 4 per encoder layer (attention
    probabilities, attention output, FFN activation, FFN output), the decoder's embedding,
    6 per decoder layer (self and cross attention's two each, the FFN's two)."""
    L, Ld = cfg.num_encoder_layers, cfg.num_decoder_layers
    return {
        "enc_emb": 0,
        "enc": [1 + 4 * i for i in range(L)],
        "dec_emb": 1 + 4 * L,
        "dec": [2 + 4 * L + 6 * j for j in range(Ld)],
    }


# ------------------------------------------------------------------ the activation arena
ARENA_ALIGN = 16  # elements (64 bytes): every tensor on its own cache line


def activation_shapes(
    cfg: TransformerConfig, B: int, packed: bool = False
) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every arena tensor for micro-batch B, in arena order. int32 and
    uint64 tensors are carved from the float32 arena (aligned, so the views are legal).
    A post-LN sublayer keeps its residual sum (the norm's input), the norm's mean and
    rstd, and the norm's output (the next sublayer's input). ``packed``: the
    ``packed_names`` tensors are float32 working copies of ``working_copies`` layers, not
    of every layer (all layers are in the uint16 store of ``saved_shapes``)."""
    shapes = _activation_shapes(cfg, B)
    if packed:
        for name in packed_names():
            shape, dtype = shapes[name]
            shapes[name] = ((working_copies(cfg, name), *shape[1:]), dtype)
    return shapes


def own_packed() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(encoder, decoder) layer tensors that the layer's backward reads, held as 16-bit
    words in mixed precision once the layer's forward ends (not the attention
    probabilities, which stay float32 as a fused kernel keeps them, nor the norms'
    statistics)."""
    enc = ("e_q", "e_k", "e_v", "e_ctx", "e_r1", "e_x1", "e_h", "e_a", "e_r2")
    dec = ("s_q", "s_k", "s_v", "s_ctx", "s_r", "s_x", "c_q", "c_k", "c_v", "c_ctx", "c_r",
           "c_x", "f_h", "f_a", "f_r")  # fmt: skip
    return enc, dec


def packed_names() -> tuple[str, ...]:
    """Every tensor of the 16-bit store: the layers' own and the residual streams entering
    them (``ex``, ``dy``: layer i packs its input; the last output, read by the final norm,
    stays in its working copy)."""
    enc, dec = own_packed()
    return (*enc, *dec, "ex", "dy")


def working_copies(cfg: TransformerConfig, name: str) -> int:
    """Layers of float32 working copies of a packed tensor: two of the residual streams
    (layer i reads its input while it writes its output), one of the rest."""
    if name == "ex":
        return min(cfg.num_encoder_layers + 1, 2)
    if name == "dy":
        return min(cfg.num_decoder_layers + 1, 2)
    return 1


def saved_shapes(cfg: TransformerConfig, B: int) -> dict[str, tuple[int, ...]]:
    """The uint16 store of mixed precision: every layer's packed tensors."""
    shapes = _activation_shapes(cfg, B)
    return {name: shapes[name][0] for name in packed_names()}


def _activation_shapes(cfg: TransformerConfig, B: int) -> dict[str, tuple[tuple[int, ...], str]]:
    L, Ld, NH = cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.nhead
    D, F, V = cfg.d_model, cfg.dim_feedforward, cfg.vocab_size
    Te, Td = cfg.max_seq_length, cfg.target_length
    Ne, Nd = B * Te, B * Td
    Nm, Tm = max(Ne, Nd), max(Te, Td)
    f, i = "f4", "i4"
    return {
        "enc_ids": ((Ne,), i),
        "dec_ids": ((Nd,), i),
        "labels": ((Nd,), i),
        "keys": ((B,), "u8"),
        "enc_keep": ((B, Te), f),
        "dec_keep": ((B, Td), f),
        "row_weight": ((Nd,), f),  # a label's share of its sample's loss (0: padding)
        "pe": ((Tm, D), f),
        # encoder: ex[i] is layer i's input, ex[0] the dropped-out embedding
        "ex": ((L + 1, Ne, D), f),
        "e_q": ((L, Ne, D), f),
        "e_k": ((L, Ne, D), f),
        "e_v": ((L, Ne, D), f),
        "e_att": ((L, B, NH, Te, Te), f),
        "e_ctx": ((L, Ne, D), f),
        "e_r1": ((L, Ne, D), f),  # x + attention branch: norm1's input
        "e_m1": ((L, Ne), f),
        "e_s1": ((L, Ne), f),
        "e_x1": ((L, Ne, D), f),  # norm1's output: the FFN's input
        "e_h": ((L, Ne, F), f),  # linear1's output
        "e_a": ((L, Ne, F), f),  # relu then dropout: linear2's input
        "e_r2": ((L, Ne, D), f),
        "e_m2": ((L, Ne), f),
        "e_s2": ((L, Ne), f),
        "e_mf": ((Ne,), f),
        "e_sf": ((Ne,), f),
        "enc_out": ((Ne, D), f),
        # decoder
        "dy": ((Ld + 1, Nd, D), f),
        "s_q": ((Ld, Nd, D), f),
        "s_k": ((Ld, Nd, D), f),
        "s_v": ((Ld, Nd, D), f),
        "s_att": ((Ld, B, NH, Td, Td), f),
        "s_ctx": ((Ld, Nd, D), f),
        "s_r": ((Ld, Nd, D), f),
        "s_m": ((Ld, Nd), f),
        "s_s": ((Ld, Nd), f),
        "s_x": ((Ld, Nd, D), f),
        "c_q": ((Ld, Nd, D), f),
        "c_k": ((Ld, Ne, D), f),
        "c_v": ((Ld, Ne, D), f),
        "c_att": ((Ld, B, NH, Td, Te), f),
        "c_ctx": ((Ld, Nd, D), f),
        "c_r": ((Ld, Nd, D), f),
        "c_m": ((Ld, Nd), f),
        "c_s": ((Ld, Nd), f),
        "c_x": ((Ld, Nd, D), f),
        "f_h": ((Ld, Nd, F), f),
        "f_a": ((Ld, Nd, F), f),
        "f_r": ((Ld, Nd, D), f),
        "f_m": ((Ld, Nd), f),
        "f_s": ((Ld, Nd), f),
        "d_mf": ((Nd,), f),
        "d_sf": ((Nd,), f),
        "dec_out": ((Nd, D), f),
        "logits": ((Nd, V), f),
        "probs": ((Nd, V), f),  # backward overwrites with dlogits
        "losses": ((Nd,), f),
        # gradients of activations, reused layer after layer
        "tD": ((Nm, D), f),  # a branch's output (forward), its gradient (backward)
        "ge": ((Ne, D), f),  # d(encoder residual stream)
        "gd": ((Nd, D), f),  # d(decoder residual stream)
        "g_enc": ((Ne, D), f),  # d(encoder output), summed over the cross-attentions
        "g_r": ((Nm, D), f),  # d(a norm's input)
        "g_x": ((Nm, D), f),  # d(a sublayer's input) through its branch
        "g_q": ((Nm, D), f),
        "g_k": ((Nm, D), f),
        "g_v": ((Nm, D), f),
        "g_ctx": ((Nm, D), f),
        "g_h": ((Nm, F), f),
        "scratch": ((7, Tm, cfg.head_size), f),
        "att_ds": ((Tm * Tm,), f),
    }


PER_LAYER = {
    "ex", "e_q", "e_k", "e_v", "e_att", "e_ctx", "e_r1", "e_m1", "e_s1", "e_x1", "e_h",
    "e_a", "e_r2", "e_m2", "e_s2", "dy", "s_q", "s_k", "s_v", "s_att", "s_ctx", "s_r", "s_m",
    "s_s", "s_x", "c_q", "c_k", "c_v", "c_att", "c_ctx", "c_r", "c_m", "c_s", "c_x", "f_h",
    "f_a", "f_r", "f_m", "f_s",
}  # fmt: skip


def _elements(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * (2 if dtype == "u8" else 1)


def arena_layout(
    cfg: TransformerConfig, B: int, packed: bool = False
) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total float32 elements) of the arena (``packed``: with
    working copies of the packed tensors)."""
    sizes = {n: _elements(s, d) for n, (s, d) in activation_shapes(cfg, B, packed).items()}
    return aligned_layout(sizes, ARENA_ALIGN)


def store_layout(cfg: TransformerConfig, B: int) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total uint16 words) of mixed precision's 16-bit store."""
    sizes = {n: math.prod(s) for n, s in saved_shapes(cfg, B).items()}
    return aligned_layout(sizes, ARENA_ALIGN)


def activation_bytes(cfg: TransformerConfig, B: int) -> int:
    return 4 * arena_layout(cfg, B)[1]


# ------------------------------------------------------------------ plan mode
def plan_shape(cfg: TransformerConfig) -> dict:
    """``TransformerSpec``'s fields for a config: encoder and decoder layers together as
    n_layer (a decoder layer's cross-attention is in ``param_count``), biases, LayerNorm,
    no learned positions (sinusoids), tied output projection."""
    return {
        "n_layer": cfg.num_encoder_layers + cfg.num_decoder_layers,
        "n_head": cfg.nhead,
        "d_model": cfg.d_model,
        "vocab": cfg.vocab_size,
        "seq_len": cfg.max_seq_length,
        "d_ff": cfg.dim_feedforward,
        "tied_head": True,
        "learned_pos": False,
        "attn_bias": True,
        "mlp_bias": True,
        "param_count": num_parameters(cfg),
    }


def plan_models() -> dict[str, dict]:
    """``plan_shape`` of every preset, by name (``simdist.plan --model transformer-big``)."""
    return {name: plan_shape(resolve_config(name)) for name in PRESETS}
