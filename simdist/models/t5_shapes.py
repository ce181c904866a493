"""T5's configuration, presets and sizes: known without allocating or compiling anything.

The keys are Hugging Face ``T5Config``'s (``simdist.models.t5`` describes the model).
Presets: t5-mini (tests and benchmarks), t5-small and t5-base (Raffel et al.'s shapes, for
simulation and plan mode). Also the pure functions the model, its costs and its data
share: the span-corruption lengths (T5's ``compute_input_and_target_lengths``) and the
dropout sites; and ``plan_models()``, the presets as plan mode's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from simdist.config import ConfigError

from .base import ParamSpec
from .presets import resolve_preset

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN = 3.0


def _lengths(raw: int) -> tuple[int, int, int, int, int]:
    """(raw, noise, spans, inputs length, targets length) of ``raw`` tokens."""
    noise = min(max(int(round(raw * NOISE_DENSITY)), 1), raw - 1)
    spans = max(int(round(noise / MEAN_NOISE_SPAN)), 1)
    return raw, noise, spans, raw - noise + spans + 1, noise + spans + 1


def span_lengths(inputs_length: int) -> tuple[int, int, int, int]:
    """(raw tokens, noise tokens, noise spans, target length) for encoder inputs of at most
    ``inputs_length`` tokens: the longest raw span whose corrupted form (kept tokens, one
    sentinel per noise span, EOS) fits, as T5's ``compute_input_and_target_lengths``."""
    raw = inputs_length
    while raw > 2 and _lengths(raw)[3] > inputs_length:
        raw -= 1
    while _lengths(raw + 1)[3] <= inputs_length:
        raw += 1
    r, noise, spans, _, targets = _lengths(raw)
    return r, noise, spans, targets


def sites(cfg) -> dict:
    """Dropout sites: the encoder's embedding, 4 per encoder block (attention
    probabilities, attention output, FFN activation, FFN output), its final norm, then the
    decoder's embedding, 6 per block (self and cross attention's two each, the FFN's two)
    and its final norm."""
    L, Ld = cfg.num_layers, cfg.num_decoder_layers
    dec0 = 3 + 4 * L
    return {
        "enc_emb": 0,
        "enc": [1 + 4 * i for i in range(L)],
        "enc_final": 1 + 4 * L,
        "dec_emb": 2 + 4 * L,
        "dec": [dec0 + 6 * j for j in range(Ld)],
        "dec_final": dec0 + 6 * Ld,
    }


INT_FIELDS = (
    "num_layers",
    "num_decoder_layers",
    "num_heads",
    "d_model",
    "d_kv",
    "d_ff",
    "vocab_size",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "n_positions",
    "max_seq_length",
)
FIELDS = INT_FIELDS + ("dropout_rate", "feed_forward_proj", "tie_word_embeddings")


@dataclass(frozen=True)
class T5Config:
    num_layers: int  # encoder blocks
    num_decoder_layers: int
    num_heads: int
    d_model: int
    d_kv: int  # per head: the attention's inner width is num_heads * d_kv
    d_ff: int
    vocab_size: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    n_positions: int  # the longest encoder input accepted (Hugging Face's n_positions)
    max_seq_length: int  # encoder tokens per sample; the decoder's follow (span_lengths)
    dropout_rate: float = 0.1
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for key in INT_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key} must be a positive integer, got {value!r}")
        if self.max_seq_length > self.n_positions:
            raise ConfigError(
                f"model.max_seq_length ({self.max_seq_length}) exceeds the positions the "
                f"model supports (model.n_positions = {self.n_positions})",
                "model.max_seq_length",
            )
        if self.max_seq_length < 8:
            raise ConfigError(f"model.max_seq_length must be >= 8, got {self.max_seq_length}")
        if self.relative_attention_num_buckets < 4:
            raise ConfigError("model.relative_attention_num_buckets must be >= 4")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ConfigError(f"model.dropout_rate must lie in [0, 1), got {self.dropout_rate}")
        if self.feed_forward_proj not in ("relu", "gated-gelu"):
            raise ConfigError(
                f"model.feed_forward_proj must be relu or gated-gelu, got "
                f"{self.feed_forward_proj!r}"
            )

    @property
    def inner(self) -> int:
        return self.num_heads * self.d_kv

    @property
    def gated(self) -> bool:
        return self.feed_forward_proj == "gated-gelu"

    @property
    def target_length(self) -> int:
        """Decoder tokens per sample: the span-corruption targets of max_seq_length inputs."""
        return span_lengths(self.max_seq_length)[3]


def _preset(L: int, NH: int, D: int, F: int, V: int, T: int) -> dict:
    return dict(
        num_layers=L, num_decoder_layers=L, num_heads=NH, d_model=D, d_kv=64, d_ff=F,
        vocab_size=V, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        n_positions=512, max_seq_length=T, dropout_rate=0.1, feed_forward_proj="relu",
        tie_word_embeddings=True,
    )  # fmt: skip


# t5-mini: a small T5 v1.0 on simdist's byte vocabulary (simdist.data.t5: 3 special ids,
# 256 bytes, 100 sentinels); small and base: Raffel et al.'s shapes with the SentencePiece
# vocabulary as Hugging Face pads it (32128), inputs of 512 (simulation and plan mode).
PRESETS: dict[str, dict] = {
    "t5-mini": _preset(4, 4, 256, 1024, 359, 128),
    "t5-small": _preset(6, 8, 512, 2048, 32128, 512),
    "t5-base": _preset(12, 12, 768, 3072, 32128, 512),
}


def resolve_config(preset: str | None = None, **overrides) -> T5Config:
    """A preset with some fields replaced (None = keep); without a preset all are needed."""
    return T5Config(**resolve_preset("T5", PRESETS, FIELDS, INT_FIELDS, preset, overrides))


# ------------------------------------------------------------------ names and sizes
ATT = ("q", "k", "v", "o")
REL = "relative_attention_bias.weight"


def _ffn_names(cfg: T5Config, prefix: str) -> list[str]:
    wi = ("wi_0", "wi_1") if cfg.gated else ("wi",)
    return [f"{prefix}.DenseReluDense.{w}.weight" for w in (*wi, "wo")]


def block_names(cfg: T5Config, stack: str, i: int) -> tuple[str, ...]:
    """One block's parameter names in state-dict order."""
    p = f"{stack}.block.{i}.layer"
    names = [f"{p}.0.SelfAttention.{a}.weight" for a in ATT]
    names += [f"{p}.0.SelfAttention.{REL}"] if i == 0 else []
    names.append(f"{p}.0.layer_norm.weight")
    if stack == "decoder":
        names += [f"{p}.1.EncDecAttention.{a}.weight" for a in ATT]
        names.append(f"{p}.1.layer_norm.weight")
    f = 2 if stack == "decoder" else 1
    return (*names, *_ffn_names(cfg, f"{p}.{f}"), f"{p}.{f}.layer_norm.weight")


def head_names(cfg: T5Config) -> tuple[str, ...]:
    return ("decoder.final_layer_norm.weight",) + (
        () if cfg.tie_word_embeddings else ("lm_head.weight",)
    )


def parameter_specs(cfg: T5Config) -> list[ParamSpec]:
    """T5ForConditionalGeneration's state-dict order, names and shapes (the tied copies
    ``encoder.embed_tokens`` / ``decoder.embed_tokens`` / ``lm_head`` omitted); weight
    decay for matrices, embeddings and the bias tables (ndim >= 2), not layer norms."""
    D, C, F = cfg.d_model, cfg.inner, cfg.d_ff
    shape = {"q": (C, D), "k": (C, D), "v": (C, D), "o": (D, C), "wi": (F, D), "wo": (D, F)}
    shape |= {"wi_0": (F, D), "wi_1": (F, D)}
    specs = [("shared.weight", (cfg.vocab_size, D))]
    for stack, n in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(n):
            for name in block_names(cfg, stack, i):
                if name.endswith(REL):
                    s = (cfg.relative_attention_num_buckets, cfg.num_heads)
                elif name.endswith("layer_norm.weight"):
                    s = (D,)
                else:
                    s = shape[name.split(".")[-2]]
                specs.append((name, s))
        specs.append((f"{stack}.final_layer_norm.weight", (D,)))
    if not cfg.tie_word_embeddings:
        specs.append(("lm_head.weight", (cfg.vocab_size, D)))
    return [ParamSpec(n, s, len(s) >= 2) for n, s in specs]


def num_parameters(cfg: T5Config) -> int:
    return sum(s.numel for s in parameter_specs(cfg))


def flops_per_sample(cfg: T5Config) -> int:
    """Forward + backward matrix-product FLOPs of one sample (3x the forward's)."""
    D, C, F, V = cfg.d_model, cfg.inner, cfg.d_ff, cfg.vocab_size
    Te, Td = cfg.max_seq_length, cfg.target_length
    nf = 3 if cfg.gated else 2
    enc = Te * (2 * (4 * D * C + nf * D * F) + 4 * Te * C)
    dec = Td * (2 * (6 * D * C + nf * D * F) + 4 * Td * C + 4 * Te * C) + Te * 2 * 2 * D * C
    fwd = cfg.num_layers * enc + cfg.num_decoder_layers * dec + Td * 2 * D * V
    return 3 * fwd


def plan_shape(cfg: T5Config) -> dict:
    """The shapes ``simdist.plan`` needs for a T5 config, ``TransformerSpec``'s fields: the
    encoder and decoder blocks together as n_layer (a decoder block adds cross-attention,
    which ``param_count`` includes exactly), no biases, no learned positions."""
    return {
        "n_layer": cfg.num_layers + cfg.num_decoder_layers,
        "n_head": cfg.num_heads,
        "d_model": cfg.d_model,
        "vocab": cfg.vocab_size,
        "seq_len": cfg.max_seq_length,
        "d_ff": cfg.d_ff,
        "tied_head": cfg.tie_word_embeddings,
        "learned_pos": False,
        "attn_bias": False,
        "mlp_bias": False,
        "param_count": num_parameters(cfg),
    }


def plan_models() -> dict[str, dict]:
    """``plan_shape`` of every T5 preset, by name: what ``simdist.plan --model t5-small``
    looks up."""
    return {name: plan_shape(resolve_config(name)) for name in PRESETS}
