"""Plan mode's model shapes and closed-form memory (ZeRO model states, Korthikanti activations).

The formulas are described in ``simdist.sim.plan``'s docstring; this module holds the
shapes of the models plan mode knows (``MODELS``) and the two memory formulas, with no
time model and no profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# -- model shapes ------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer's shapes (GPT-2 layout unless flags say otherwise)."""

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

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    def layer_params(self) -> int:
        h, f = self.d_model, self.ffn
        n_ln = 1 if self.parallel_block else 2
        attn = 4 * h * h + (4 * h if self.attn_bias else 0)
        mlp = 2 * h * f + ((f + h) if self.mlp_bias else 0)
        return n_ln * 2 * h + attn + mlp

    def param_count(self) -> int:
        h, v = self.d_model, self.vocab
        emb = v * h + (self.seq_len * h if self.learned_pos else 0)
        head = 0 if self.tied_head else h * v + (v if self.head_bias else 0)
        return emb + self.n_layer * self.layer_params() + 2 * h + head


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


_MEGATRON = "Narayanan et al. 2021 (arXiv 2104.04473) / Korthikanti et al. 2022 (arXiv 2205.05198)"
MODELS: dict[str, TransformerSpec | MLPSpec] = {
    # HF transformers GPT-2 configs (n_layer, n_head, n_embd, n_ctx 1024, vocab 50257)
    "gpt2-mini": TransformerSpec(
        "gpt2-mini", 4, 4, 256, 256, 128, source="simdist preset (L4 H4 E256 T128 V256, 3.26M)"
    ),
    "gpt2": TransformerSpec("gpt2", 12, 12, 768, 50257, 1024, source="HF gpt2 (124M)"),
    "gpt2-medium": TransformerSpec("gpt2-medium", 24, 16, 1024, 50257, 1024, source="HF (355M)"),
    "gpt2-large": TransformerSpec("gpt2-large", 36, 20, 1280, 50257, 1024, source="HF (774M)"),
    "gpt2-xl": TransformerSpec("gpt2-xl", 48, 25, 1600, 50257, 1024, source="HF (1.56B)"),
    # GPT-3 paper (Brown et al. 2020) Table 2.1: 1.3B, 24 layers, d_model 2048, d_head 128.
    # The table's 24 heads x 128 would not give 1.3B; d_model/128 = 16 heads does.
    "gpt3-xl": TransformerSpec("gpt3-xl", 24, 16, 2048, 50257, 2048, source="GPT-3 Table 2.1"),
    # EleutherAI GPT-J-6B (HF config): rotary (no learned positions), parallel block, no
    # attention biases, untied head with bias, vocab 50400, d_ff 16384. The model card says
    # 6,053,381,344 parameters; this count gives 6,050,882,784 (0.04 % fewer, not resolved).
    "gpt-j-6b": TransformerSpec(
        "gpt-j-6b",
        28,
        16,
        4096,
        50400,
        2048,
        d_ff=16384,
        tied_head=False,
        learned_pos=False,
        attn_bias=False,
        head_bias=True,
        parallel_block=True,
        source="HF EleutherAI/gpt-j-6b",
    ),
    "fc-mnist": MLPSpec("fc-mnist", (784, 512, 512, 10), source="simdist/params/fc_mnist.yaml"),
    # Models of the published Megatron runs used by scripts/validate_sim.py (V = 51200).
    "megatron-1.7b": TransformerSpec("megatron-1.7b", 24, 24, 2304, 51200, 2048, source=_MEGATRON),
    "megatron-22b": TransformerSpec("megatron-22b", 48, 64, 6144, 51200, 2048, source=_MEGATRON),
    "gpt3-175b": TransformerSpec("gpt3-175b", 96, 96, 12288, 51200, 2048, source=_MEGATRON),
    "turing-530b": TransformerSpec("turing-530b", 105, 128, 20480, 51200, 2048, source=_MEGATRON),
    "megatron-1t": TransformerSpec("megatron-1t", 128, 160, 25600, 51200, 2048, source=_MEGATRON),
}


@dataclass(frozen=True)
class CountedTransformerSpec(TransformerSpec):
    """An encoder-decoder preset as one stack of n_layer blocks, with its exact parameter
    count (each block's share: the blocks' mean)."""

    param_total: int = 0

    def param_count(self) -> int:
        return self.param_total

    def layer_params(self) -> int:
        embed = self.vocab * self.d_model * (1 if self.tied_head else 2)
        return (self.param_total - embed - 2 * self.d_model) // self.n_layer


from simdist.models.t5_shapes import plan_models as _t5_models  # noqa: E402

for _name, _shape in _t5_models().items():  # t5-mini, t5-small, t5-base
    _fields = {k: v for k, v in _shape.items() if k != "param_count"}
    MODELS[_name] = CountedTransformerSpec(
        _name, **_fields, param_total=_shape["param_count"], source="simdist.models.t5_shapes"
    )


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
) -> int:
    """Activation bytes one transformer layer stores for backward (Korthikanti §4)."""
    s, b, h, a, f, t = seq, micro_batch, spec.d_model, spec.n_head, spec.ffn, tp
    sbh, sbf, as2b = s * b * h, s * b * f, a * s * s * b
    if recompute == "full":
        return sbh * elem // (t if sequence_parallel else 1)
    # replicated across TP ranks unless sequence parallel: LN inputs, QKV and fc1 inputs, masks
    replicated = (4 * elem + 2) * sbh
    split = 4 * elem * sbh + 2 * elem * sbf  # Q, K, V, projection input, GELU in/out
    scores = 0 if recompute == "selective" else (2 * elem + 1) * as2b
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
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
    )


__all__ = [
    "MODELS",
    "CountSpec",
    "MLPSpec",
    "TransformerSpec",
    "is_gpt2_layout",
    "layer_activation_bytes",
    "model_state_bytes",
]
