"""GPT-2, BERT, T5 and the Transformer in mixed precision hold their blocks' saved
activations as 16-bit words (``gpt2.PACKED``, ``bert_shapes.PACKED``,
``t5_arena.packed_names``, ``transformer_shapes.packed_names``; ``saved_words``): the same
bits as float32 words holding the half values, less host memory, and the same across a
pipeline boundary."""

from __future__ import annotations

import numpy as np
import pytest

from simdist.arena import Layout
from simdist.data.bert import BertData
from simdist.data.t5 import T5Data
from simdist.data.text import load_corpus_bytes
from simdist.models.base import GradientViews
from simdist.models.bert import Bert
from simdist.models.bert import resolve_config as bert_config
from simdist.models.gpt2 import GPT2, resolve_config
from simdist.models.t5 import T5
from simdist.models.t5 import resolve_config as t5_config
from simdist.precision import Precision

B = 2


def _model(precision: str, packs: bool):
    model = GPT2(resolve_config("gpt2-mini", n_layer=5))
    model.packs_saved_activations = packs
    model.set_precision(Precision(precision))
    model.allocate(B)
    return model


def _params_and_batch(model):
    layout = Layout(model.parameter_specs(), world=1)
    params = layout.views(np.zeros(layout.padded, np.float32))
    model.init_parameters(params, np.random.default_rng(0))
    for p in params.values():  # the weights a mixed-precision step computes with
        Precision("bf16").store(p)
    rng = np.random.default_rng(1)
    V, T = model.config.vocab_size, model.config.block_size
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    return layout, params, tokens, np.roll(tokens, -1, axis=1)


def _grads(layout):
    flat = np.zeros(layout.padded, np.float32)
    return flat, GradientViews(layout.views(flat))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_packed_store_gives_the_bits_of_float32_words_in_less_memory(precision):
    packed, plain = _model(precision, True), _model(precision, False)
    layout, params, x, y = _params_and_batch(packed)
    runs = []
    for model in (packed, plain):
        flat, grads = _grads(layout)
        loss = model.forward(params, x, y)
        model.backward(params, grads, 1.0 / B)
        runs.append((loss, flat))
    assert runs[0][0] == runs[1][0]
    assert np.array_equal(runs[0][1], runs[1][1])
    assert np.count_nonzero(runs[0][1]) > 0.9 * layout.numel
    # the host holds what host_activation_bytes says: the arena and the 16-bit store
    assert packed._words is not None and packed._words.dtype == np.uint16
    held = packed._arena.nbytes + packed._words.nbytes
    assert held == packed.host_activation_bytes(B)
    assert plain._words is None and plain._arena.nbytes == plain.host_activation_bytes(B)
    assert held < 0.8 * plain._arena.nbytes
    # the device's layout (and its accounting) is the model's, whatever the host holds
    assert packed.activation_bytes(B) == plain.activation_bytes(B) == plain._arena.nbytes


def test_packed_store_across_a_pipeline_boundary():
    """Blocks 0-1 on one model, blocks 2-4 and the head on another (a pipeline's two
    stages, their boundary tensors copied across): the gradients of one whole model."""
    whole, first, second = (_model("bf16", True) for _ in range(3))
    # embedding, h.0, h.1 | h.2 .. h.4, head
    _assert_split_equals_whole(whole, first, second, 3, *_params_and_batch(whole))


def _assert_split_equals_whole(whole, first, second, cut, layout, params, x, y):
    """Stages 0..cut-1 on ``first``, the rest on ``second`` (a pipeline's two stages, their
    boundary tensors copied across): the loss and gradients of ``whole``."""
    ref_flat, ref = _grads(layout)
    ref_loss = whole.forward(params, x, y)
    whole.backward(params, ref, 1.0 / B)

    flat, grads = _grads(layout)
    n_stages = len(whole.stages())
    first.begin(x, y)
    second.begin(x, y)
    for k in range(cut):
        first.forward_stage(k, params)
    first.hold_for_backward()
    for dst, src in zip(second.stage_input(cut), first.stage_input(cut), strict=True):
        np.copyto(dst, src)
    for k in range(cut, n_stages):
        loss = second.forward_stage(k, params)
    for k in range(n_stages - 1, cut - 1, -1):
        second.backward_stage(k, params, grads, 1.0 / B)
    np.copyto(first.stage_input_grad(cut), second.stage_input_grad(cut))
    for k in range(cut - 1, -1, -1):
        first.backward_stage(k, params, grads, 1.0 / B)
    assert loss == ref_loss
    assert np.array_equal(flat, ref_flat)


def test_few_blocks_keep_float32_words(monkeypatch):
    """With fewer than three blocks the working copies cost more than the store saves;
    SIMDIST_PACK_ACTIVATIONS=1 packs them anyway, 0 never packs, anything else is refused."""
    from simdist.config import ConfigError

    model = GPT2(resolve_config("gpt2-mini", n_layer=2))
    model.set_precision(Precision("bf16"))
    model.allocate(B)
    assert model._words is None
    assert model.host_activation_bytes(B) == model.activation_bytes(B)
    monkeypatch.setenv("SIMDIST_PACK_ACTIVATIONS", "1")
    model.set_precision(Precision("bf16"))
    assert model._words is not None and model._words.dtype == np.uint16
    assert model.host_activation_bytes(B) > model.activation_bytes(B)
    monkeypatch.setenv("SIMDIST_PACK_ACTIVATIONS", "0")
    more = _model("bf16", True)  # five blocks: auto would pack
    assert more._words is None
    monkeypatch.setenv("SIMDIST_PACK_ACTIVATIONS", "yes")
    with pytest.raises(ConfigError, match="SIMDIST_PACK_ACTIVATIONS='yes'"):
        model.set_precision(Precision("bf16"))


# ---------------------------------------------------------------- BERT
def _bert(precision: str, packs: bool, layers: int = 4):
    cfg = bert_config(
        None, num_hidden_layers=layers, num_attention_heads=2, hidden_size=32,
        intermediate_size=64, max_position_embeddings=24, vocab_size=260, type_vocab_size=2,
        max_seq_length=24, max_predictions_per_seq=4,
    )  # fmt: skip
    model = Bert(cfg)
    model.packs_saved_activations = packs
    model.set_precision(Precision(precision))
    model.allocate(B)
    model.bind_step(3, lambda: 7)  # dropout on: its masks must survive the packing too
    return model


def _bert_params_and_batch(model):
    cfg = model.config
    layout = Layout(model.parameter_specs(), world=1)
    params = layout.views(np.zeros(layout.padded, np.float32))
    model.init_parameters(params, np.random.default_rng(0))
    for p in params.values():
        Precision("bf16").store(p)
    data = BertData(load_corpus_bytes(), cfg.max_seq_length, cfg.max_predictions_per_seq, B, "")
    x, y = data.train_batch(np.arange(B) * 3)
    x = x.copy()
    x[1, 0, -2:] = 0  # some padding
    return layout, params, x, y.copy()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bert_packed_store_gives_the_bits_of_float32_words_in_less_memory(precision):
    packed, plain = _bert(precision, True), _bert(precision, False)
    layout, params, x, y = _bert_params_and_batch(packed)
    runs = []
    for model in (packed, plain):
        flat, grads = _grads(layout)
        loss = model.forward(params, x, y)
        model.backward(params, grads, 1.0 / B)
        runs.append((loss, flat, model.evaluate(params, x, y)))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    assert np.array_equal(runs[0][1], runs[1][1])
    assert np.count_nonzero(runs[0][1]) > 0.9 * layout.numel
    assert packed._words is not None and packed._words.dtype == np.uint16
    held = packed._arena.nbytes + packed._words.nbytes
    assert held == packed.host_activation_bytes(B) < 0.9 * plain._arena.nbytes
    assert plain._words is None and plain._arena.nbytes == plain.host_activation_bytes(B)
    assert packed.activation_bytes(B) == plain.activation_bytes(B) == plain._arena.nbytes


def test_bert_packed_store_across_a_pipeline_boundary():
    """Embeddings and layers 0-1 on one model, layers 2-3 and the heads on another: the
    second stage packs the layer output it received, and its backward unpacks it."""
    whole, first, second = (_bert("bf16", True) for _ in range(3))
    # embeddings, layer.0, layer.1 | layer.2, layer.3, heads
    _assert_split_equals_whole(whole, first, second, 3, *_bert_params_and_batch(whole))


def test_bert_with_two_layers_keeps_float32_words():
    model = _bert("bf16", True, layers=2)
    assert model._words is None
    assert model.host_activation_bytes(B) == model.activation_bytes(B)


# ---------------------------------------------------------------- T5
def _t5(precision: str, packs: bool, gated: bool):
    cfg = t5_config(
        None, num_layers=3, num_decoder_layers=4, num_heads=2, d_model=32, d_kv=16, d_ff=48,
        vocab_size=359, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        n_positions=64, max_seq_length=24, dropout_rate=0.1,
        feed_forward_proj="gated-gelu" if gated else "relu",
    )  # fmt: skip
    model = T5(cfg)
    model.packs_saved_activations = packs
    model.set_precision(Precision(precision))
    model.allocate(B)
    model.bind_step(3, lambda: 7)  # dropout on
    return model


@pytest.mark.parametrize("precision,gated", [("bf16", True), ("fp16", False)])
def test_t5_packed_store_gives_the_bits_of_float32_words_in_less_memory(precision, gated):
    packed, plain = _t5(precision, True, gated), _t5(precision, False, gated)
    cfg = packed.config
    layout = Layout(packed.parameter_specs(), world=1)
    params = layout.views(np.zeros(layout.padded, np.float32))
    packed.init_parameters(params, np.random.default_rng(0))
    for p in params.values():
        Precision(precision).store(p)
    x, y = T5Data(load_corpus_bytes()[:50000], cfg.max_seq_length, B, "").train_batch(
        np.arange(B) * 3
    )
    runs = []
    for model in (packed, plain):
        flat, grads = _grads(layout)
        loss = model.forward(params, x, y)
        model.backward(params, grads, 1.0 / B)
        runs.append((loss, flat, model.evaluate(params, x, y)))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    assert np.array_equal(runs[0][1], runs[1][1])
    assert np.count_nonzero(runs[0][1]) > 0.9 * layout.numel
    assert packed._words is not None and plain._words is None
    held = packed._arena.nbytes + packed._words.nbytes
    assert held == packed.host_activation_bytes(B) < 0.9 * plain._arena.nbytes
    assert packed.activation_bytes(B) == plain.activation_bytes(B) == plain._arena.nbytes


# ---------------------------------------------------------------- the Transformer
def _transformer(precision: str, packs: bool, layers: int = 3):
    from test_transformer import _tiny

    from simdist.models.transformer import Transformer

    cfg = _tiny(num_encoder_layers=layers, num_decoder_layers=layers + 1, dropout=0.1)
    model = Transformer(cfg)
    model.packs_saved_activations = packs
    model.set_precision(Precision(precision))
    model.allocate(B)
    model.bind_step(3, lambda: 7)  # dropout on
    return model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_transformer_packed_store_gives_the_bits_of_float32_words_in_less_memory(precision):
    """Loss, every gradient (the shared table's from three places, the encoder's output
    gradient gathered from every cross-attention) and evaluation, greedy exact match
    included, equal to float32 words."""
    from test_transformer import _batch

    packed, plain = _transformer(precision, True), _transformer(precision, False)
    layout = Layout(packed.parameter_specs(), world=1)
    params = layout.views(np.zeros(layout.padded, np.float32))
    packed.init_parameters(params, np.random.default_rng(0))
    for p in params.values():
        Precision(precision).store(p)
    x, y = _batch(packed.config, B, np.random.default_rng(5))
    x[:, -1] = 1  # evaluation decodes both samples greedily
    runs = []
    for model in (packed, plain):
        flat, grads = _grads(layout)
        loss = model.forward(params, x, y)
        model.backward(params, grads, 1.0 / B)
        scores = model.evaluate(params, x, y)
        runs.append((loss, flat, scores, {k: list(v) for k, v in model.extra_eval.items()}))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2] and runs[0][3] == runs[1][3]
    assert runs[0][3]["exact_match"][1] == B
    assert np.array_equal(runs[0][1], runs[1][1])
    assert np.count_nonzero(runs[0][1]) > 0.9 * layout.numel
    assert packed._words is not None and plain._words is None
    held = packed._arena.nbytes + packed._words.nbytes
    assert held == packed.host_activation_bytes(B) < 0.9 * plain._arena.nbytes
    assert packed.activation_bytes(B) == plain.activation_bytes(B) == plain._arena.nbytes


def test_transformer_with_two_layers_keeps_float32_words():
    model = _transformer("bf16", True, layers=1)
    assert model._words is None
    assert model.host_activation_bytes(B) == model.activation_bytes(B)
