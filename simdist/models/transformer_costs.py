"""The kernel calls of one AIAYN Transformer training micro-batch, FLOPs and bytes.

``kernel_costs(cfg, B, groups)`` mirrors the ``Transformer``'s stage forwards and
backwards call by call (same order and shapes), with ``gpt2_costs``' counting rules
(``base.KernelCost``). The pieces are BERT's (``nn.Linear`` with bias, LayerNorm with the
residual add fused in) and T5's (attention with separate query and key lengths, dropout
as a hash per element); the embedding is a scaled lookup plus the sinusoid row, the head
an unbiased product with the shared table, the loss label-smoothed (one more row sum).
"""

from __future__ import annotations

from .base import GradientGroup, KernelCost, vector
from .bert_costs import _linear, _ln
from .gpt2_costs import EXP
from .t5_costs import _add, _attention, _drop
from .t5_costs import _linear as _linear_nobias


def _ffn(name: str, N: int, D: int, F: int, p: float, phase: str) -> list[KernelCost]:
    n = N * F
    if phase == "forward":
        return [
            *_linear(name + "linear1", N, D, F, phase),
            vector(name + "relu", n, 2 * n, phase),
            *_drop(name + "dropout", n, p, phase),
            *_linear(name + "linear2", N, F, D, phase),
        ]
    return [
        *_linear(name + "linear2", N, F, D, phase),
        *_drop(name + "dropout.bwd", n, p, phase),
        vector(name + "relu.bwd", n, 3 * n, phase),
        *_linear(name + "linear1", N, D, F, phase),
    ]


def _sublayer_bwd(name: str, N: int, D: int, p: float) -> list[KernelCost]:
    """A post-LN sublayer's norm backward and its output dropout's."""
    return [_ln(name + "norm.bwd", N, D, "backward"), *_drop(name + "dropout.bwd", N * D, p,
                                                             "backward")]  # fmt: skip


def _embed(name: str, N: int, D: int, phase: str) -> KernelCost:
    if phase == "forward":
        return vector(name, 2 * N * D, 3 * N * D + N, phase)
    return vector(name + ".bwd", 2 * N * D, 3 * N * D + N, phase)


def kernel_costs(cfg, B: int, groups: list[GradientGroup]) -> list[KernelCost]:
    """Forward then backward of B samples (cfg: ``TransformerConfig``); ``groups``: the
    model's gradient groups, whose finishing kernels carry ``done`` in backward's order."""
    L, Ld, NH = cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.nhead
    D, F, V, p, hs = cfg.d_model, cfg.dim_feedforward, cfg.vocab_size, cfg.dropout, cfg.head_size
    Te, Td = cfg.max_seq_length, cfg.target_length
    Ne, Nd = B * Te, B * Td
    f, b = "forward", "backward"
    out: list[KernelCost] = [
        vector("inputs.copy", 0, 2 * (Ne + 2 * Nd + B) + B * (Te + 2 * Td), f),
        _embed("encoder.embed", Ne, D, f),
        *_drop("encoder.dropout", Ne * D, p, f),
    ]
    for i in range(L):
        n = f"encoder.{i}."
        out += [c for a in "qkv" for c in _linear(n + a, Ne, D, D, f)]
        out += _attention(n + "attention", B, Te, Te, NH, hs, p, False, f)
        out += _linear(n + "out_proj", Ne, D, D, f) + _drop(n + "dropout1", Ne * D, p, f)
        out.append(_ln(n + "norm1", Ne, D, f, fused_add=True))
        out += _ffn(n + "ffn.", Ne, D, F, p, f) + _drop(n + "dropout2", Ne * D, p, f)
        out.append(_ln(n + "norm2", Ne, D, f, fused_add=True))
    out.append(_ln("encoder.norm", Ne, D, f))
    out += [_embed("decoder.embed", Nd, D, f), *_drop("decoder.dropout", Nd * D, p, f)]
    for j in range(Ld):
        n = f"decoder.{j}."
        out += [c for a in "qkv" for c in _linear(n + a, Nd, D, D, f)]
        out += _attention(n + "self", B, Td, Td, NH, hs, p, False, f, causal=True)
        out += _linear(n + "self.out_proj", Nd, D, D, f) + _drop(n + "dropout1", Nd * D, p, f)
        out.append(_ln(n + "norm1", Nd, D, f, fused_add=True))
        out += _linear(n + "cross.q", Nd, D, D, f)
        out += _linear(n + "cross.k", Ne, D, D, f) + _linear(n + "cross.v", Ne, D, D, f)
        out += _attention(n + "cross", B, Td, Te, NH, hs, p, False, f)
        out += _linear(n + "cross.out_proj", Nd, D, D, f) + _drop(n + "dropout2", Nd * D, p, f)
        out.append(_ln(n + "norm2", Nd, D, f, fused_add=True))
        out += _ffn(n + "ffn.", Nd, D, F, p, f) + _drop(n + "dropout3", Nd * D, p, f)
        out.append(_ln(n + "norm3", Nd, D, f, fused_add=True))
    out.append(_ln("decoder.norm", Nd, D, f))
    out += _linear_nobias("output_projection", Nd, D, V, f)
    ce = (EXP + 6) * Nd * V
    out.append(vector("smoothed_ce", ce, 2 * Nd * V + 2 * Nd, f, serial=3 * Nd * V))
    # ---- backward
    done = iter(g.names for g in groups)
    out.append(vector("smoothed_ce.bwd", 2 * Nd * V, 2 * Nd * V + 2 * Nd, b))
    out += _linear_nobias("output_projection", Nd, D, V, b)
    out.append(_ln("decoder.norm.bwd", Nd, D, b)._replace(done=next(done)))
    out.append(vector("zero.g_enc", 0, Ne * D, b))
    for j in range(Ld - 1, -1, -1):
        n = f"decoder.{j}."
        out += _sublayer_bwd(n + "ffn.", Nd, D, p) + _ffn(n + "ffn.", Nd, D, F, p, b)
        out.append(_add(n + "ffn.residual.bwd", Nd * D, b))
        out += _sublayer_bwd(n + "cross.", Nd, D, p) + _linear(n + "cross.out_proj", Nd, D, D, b)
        out += _attention(n + "cross", B, Td, Te, NH, hs, p, False, b)
        out += _linear(n + "cross.q", Nd, D, D, b)
        out += _linear(n + "cross.k", Ne, D, D, b) + _linear(n + "cross.v", Ne, D, D, b)
        out.append(_add(n + "cross.residual.bwd", Nd * D, b))
        out += _sublayer_bwd(n + "self.", Nd, D, p) + _linear(n + "self.out_proj", Nd, D, D, b)
        out += _attention(n + "self", B, Td, Td, NH, hs, p, False, b, causal=True)
        out += [c for a in "qkv" for c in _linear(n + a, Nd, D, D, b)]
        out.append(_add(n + "self.residual.bwd", Nd * D, b)._replace(done=next(done)))
    out += _drop("decoder.dropout.bwd", Nd * D, p, b) + [_embed("decoder.embed", Nd, D, b)]
    out.append(_ln("encoder.norm.bwd", Ne, D, b)._replace(done=next(done)))
    for i in range(L - 1, -1, -1):
        n = f"encoder.{i}."
        out += _sublayer_bwd(n + "ffn.", Ne, D, p) + _ffn(n + "ffn.", Ne, D, F, p, b)
        out.append(_add(n + "ffn.residual.bwd", Ne * D, b))
        out += _sublayer_bwd(n + "attention.", Ne, D, p)
        out += _linear(n + "out_proj", Ne, D, D, b)
        out += _attention(n + "attention", B, Te, Te, NH, hs, p, False, b)
        out += [c for a in "qkv" for c in _linear(n + a, Ne, D, D, b)]
        out.append(_add(n + "attention.residual.bwd", Ne * D, b)._replace(done=next(done)))
    out += _drop("encoder.dropout.bwd", Ne * D, p, b)
    out.append(_embed("encoder.embed", Ne, D, b)._replace(done=next(done)))
    return out
