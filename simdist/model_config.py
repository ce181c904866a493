"""The params file's ``model`` section: one frozen dataclass per model simdist trains,
chosen by ``model.name`` (``MODEL_CONFIGS``). ``simdist.config`` reads and checks them; each
model's module documents what its keys mean."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FCMNISTConfig:
    name: str = "fc_mnist"
    hidden_sizes: list[int] = field(default_factory=lambda: [512, 512])
    input_size: int = 784
    num_classes: int = 10


@dataclass(frozen=True)
class GPT2ModelConfig:
    name: str = "gpt2"
    preset: str | None = None  # gpt2-mini | gpt2 | gpt2-medium | gpt2-large | gpt2-xl
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None
    vocab_size: int | None = None


@dataclass(frozen=True)
class BertModelConfig:
    name: str = "bert"
    preset: str | None = None  # bert-mini | bert-base | bert-large
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    type_vocab_size: int | None = None
    max_seq_length: int | None = None  # tokens per training sequence
    max_predictions_per_seq: int | None = None  # masked positions per sequence
    hidden_dropout_prob: float | None = None
    attention_probs_dropout_prob: float | None = None
    layer_norm_eps: float | None = None  # LayerNorm's eps (null: 1e-12, Hugging Face's)


@dataclass(frozen=True)
class T5ModelConfig:  # simdist.models.t5 documents each key (Hugging Face T5Config's names)
    name: str = "t5"
    preset: str | None = None  # t5-mini | t5-small | t5-base
    num_layers: int | None = None
    num_decoder_layers: int | None = None
    num_heads: int | None = None
    d_model: int | None = None
    d_kv: int | None = None
    d_ff: int | None = None
    vocab_size: int | None = None
    relative_attention_num_buckets: int | None = None
    relative_attention_max_distance: int | None = None
    n_positions: int | None = None  # the longest encoder input the model accepts
    max_seq_length: int | None = None  # encoder tokens per training sequence
    dropout_rate: float | None = None
    feed_forward_proj: str | None = None  # relu (T5 v1.0) | gated-gelu (v1.1)
    tie_word_embeddings: bool | None = None


@dataclass(frozen=True)
class TransformerModelConfig:  # simdist.models.transformer (torch.nn.Transformer's names)
    name: str = "transformer"
    preset: str | None = None  # transformer-mini | transformer-base | transformer-big
    num_encoder_layers: int | None = None
    num_decoder_layers: int | None = None
    nhead: int | None = None
    d_model: int | None = None
    dim_feedforward: int | None = None
    vocab_size: int | None = None
    max_seq_length: int | None = None  # encoder tokens per sample (source, EOS, padding)
    target_length: int | None = None  # decoder tokens per sample (target, EOS, padding)
    dropout: float | None = None
    label_smoothing: float | None = None
    greedy_eval_samples: int | None = None  # held-out pairs decoded greedily (exact match)


GPT2_SIZES = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
BERT_SIZES = (
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "max_seq_length",
    "max_predictions_per_seq",
)
MODEL_CONFIGS: dict[str, type] = {
    "fc_mnist": FCMNISTConfig,
    "gpt2": GPT2ModelConfig,
    "bert": BertModelConfig,
    "t5": T5ModelConfig,
    "transformer": TransformerModelConfig,
}
T5_SIZES = (*(f.name for f in dataclasses.fields(T5ModelConfig)[2:12]),)
TRANSFORMER_SIZES = (*(f.name for f in dataclasses.fields(TransformerModelConfig)[2:10]),)
