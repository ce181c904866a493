"""PyTorch twins of simdist's BERT, T5 and AIAYN Transformer, for parity tests and
benchmarks (optional: torch and transformers; simdist itself never imports either).

``hf_bert`` / ``hf_t5`` build the Hugging Face model of a simdist config with random
weights (nothing downloaded), in eager attention; ``bert_inputs`` / ``t5_inputs`` turn a
simdist batch (``simdist.data.bert`` / ``simdist.data.t5``) into the model's keyword
arguments, so both sides see the same tokens, masks and labels. ``TorchTransformer`` is
``torch.nn.Transformer`` plus the embeddings, positions and loss simdist puts around it,
taking simdist's transformer batches as they are.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import h5py
import numpy as np
import torch
import transformers

from simdist import interop
from simdist.arena import Layout
from simdist.data import bert as bert_data
from simdist.data import t5 as t5_data
from simdist.data import transformer as tf_data
from simdist.models.base import GradientViews


def _take_hugging_face_kernels() -> None:
    """Import Hugging Face's ``kernels`` package before anything can import this
    repository's ``kernels/`` in its place (transformers >= 5 imports the package when it
    builds a model, not at its own import). That folder, installed as ``simdist.kernels``,
    is importable as a top-level ``kernels`` wherever the repository's root is on
    ``sys.path``: under ``python -m`` run from the root, which puts the working directory
    first. Nothing in simdist imports the top-level name, so the installed package can own
    it."""
    spec = importlib.util.find_spec("kernels")
    ours = Path(__file__).resolve().parents[2] / "kernels"
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent != ours:
        return  # absent, or already the installed one
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != ours.parent]
    try:
        importlib.import_module("kernels")
    except ImportError:  # transformers without the package: it never imports it either
        pass
    finally:
        sys.path[:] = saved


_take_hugging_face_kernels()


def hf_bert(cfg, seed: int = 0, dropout: float = 0.0) -> transformers.BertForPreTraining:
    torch.manual_seed(seed)
    hf_cfg = transformers.BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=cfg.type_vocab_size,
        hidden_act="gelu",
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        layer_norm_eps=cfg.layer_norm_eps,
        pad_token_id=bert_data.PAD,
    )
    hf_cfg._attn_implementation = "eager"
    return transformers.BertForPreTraining(hf_cfg)


def bert_inputs(x: np.ndarray, y: np.ndarray, P: int) -> dict[str, torch.Tensor]:
    """x (B, 3, T): tokens, segments, sample index; y (B, 2P + 1): masked positions, their
    tokens, the NSP label. Labels are -100 except at the masked positions."""
    ids = torch.from_numpy(x[:, 0]).long()
    labels = torch.full_like(ids, -100)
    pos = torch.from_numpy(y[:, :P]).long()
    labels.scatter_(1, pos, torch.from_numpy(y[:, P : 2 * P]).long())
    return dict(
        input_ids=ids,
        token_type_ids=torch.from_numpy(x[:, 1]).long(),
        attention_mask=(ids != bert_data.PAD).long(),
        labels=labels,
        next_sentence_label=torch.from_numpy(y[:, 2 * P]).long(),
    )


def hf_t5(cfg, seed: int = 0, dropout: float = 0.0) -> transformers.T5ForConditionalGeneration:
    torch.manual_seed(seed)
    hf_cfg = transformers.T5Config(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        d_kv=cfg.d_kv,
        d_ff=cfg.d_ff,
        num_layers=cfg.num_layers,
        num_decoder_layers=cfg.num_decoder_layers,
        num_heads=cfg.num_heads,
        relative_attention_num_buckets=cfg.relative_attention_num_buckets,
        relative_attention_max_distance=cfg.relative_attention_max_distance,
        dropout_rate=dropout,
        layer_norm_epsilon=1e-6,
        feed_forward_proj=cfg.feed_forward_proj,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=t5_data.PAD,
        eos_token_id=t5_data.EOS,
        decoder_start_token_id=t5_data.PAD,
    )
    hf_cfg._attn_implementation = "eager"
    return transformers.T5ForConditionalGeneration(hf_cfg)


def t5_inputs(x: np.ndarray, y: np.ndarray, Te: int) -> dict[str, torch.Tensor]:
    """x (B, >= Te): the corrupted inputs in its first Te columns; y (B, Td): the targets."""
    ids = torch.from_numpy(x[:, :Te]).long()
    return dict(
        input_ids=ids,
        attention_mask=(ids != t5_data.PAD).long(),
        labels=torch.from_numpy(y).long(),
    )


class TorchTransformer(torch.nn.Module):
    """``torch.nn.Transformer`` (batch first, post-LN, ReLU) with what simdist's AIAYN
    model puts around it (``simdist.models.transformer``): one table for source, target and
    output, scaled by sqrt(d_model) plus sinusoids in; label-smoothed cross-entropy over
    the real targets, the mean per sample, then over samples. ``forward(x, y)`` takes a
    ``simdist.data.transformer`` batch as tensors: x (B, Te + 2), y (B, Td) and returns
    the loss. (tests/test_transformer.py builds the same reference around its own
    ``nn.Transformer`` for the parity test.)"""

    def __init__(self, cfg, dropout: float = 0.0, seed: int = 0):
        super().__init__()
        from simdist.kernels.positions import sinusoid_table

        torch.manual_seed(seed)
        self.cfg = cfg
        self.net = torch.nn.Transformer(
            cfg.d_model, cfg.nhead, cfg.num_encoder_layers, cfg.num_decoder_layers,
            cfg.dim_feedforward, dropout=dropout, batch_first=True,
        )  # fmt: skip
        self.embedding = torch.nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * 0.02)
        pe = np.zeros((max(cfg.max_seq_length, cfg.target_length), cfg.d_model), np.float32)
        sinusoid_table(pe)
        self.register_buffer("pe", torch.from_numpy(pe))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(cfg.target_length)
        self.register_buffer("tgt_mask", mask)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        Te, Td = cfg.max_seq_length, cfg.target_length
        src, tgt = x[:, :Te].long(), y.long()
        dec_in = torch.cat([torch.full_like(tgt[:, :1], tf_data.BOS), tgt[:, :-1]], 1)
        E, scale = self.embedding, cfg.d_model**0.5
        pad = src == tf_data.PAD
        out = self.net(
            E[src] * scale + self.pe[:Te], E[dec_in] * scale + self.pe[:Td],
            tgt_mask=self.tgt_mask, src_key_padding_mask=pad, memory_key_padding_mask=pad,
        )  # fmt: skip
        tok = torch.nn.functional.cross_entropy(
            (out @ E.T).reshape(-1, cfg.vocab_size), tgt.reshape(-1), reduction="none",
            label_smoothing=cfg.label_smoothing, ignore_index=tf_data.PAD,
        ).reshape(tgt.shape)  # fmt: skip
        return (tok.sum(1) / (tgt != tf_data.PAD).sum(1)).mean()


def load_into_simdist(hf: torch.nn.Module, model, name: str, tmp: Path) -> tuple:
    """``hf``'s weights into simdist's ``model`` (its flat buffers, one rank) through the
    interop path a user takes: safetensors -> ``interop.import_`` -> checkpoint -> buffers.
    Returns (layout, parameter flat, gradient flat, parameter views, gradient views)."""
    from safetensors.torch import save_file

    src, ckpt = tmp / f"{name}.safetensors", tmp / f"{name}.h5"
    save_file({k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}, src)
    interop.import_(src, ckpt, model=name)
    layout = Layout(model.parameter_specs(), world=1)
    pflat = np.zeros(layout.padded, np.float32)
    gflat = np.zeros(layout.padded, np.float32)
    params = layout.views(pflat)
    with h5py.File(ckpt, "r") as f:
        if set(f["model"]) != set(params):
            raise AssertionError(f"names differ: {sorted(set(f['model']) ^ set(params))}")
        for n in params:
            params[n][...] = f["model"][n][...]
    return layout, pflat, gflat, params, GradientViews(layout.views(gflat))
