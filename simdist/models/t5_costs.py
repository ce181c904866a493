"""The kernel calls of one T5 training micro-batch, with their FLOPs and bytes.

``kernel_costs(cfg, B, groups)`` mirrors ``T5._forward`` and ``T5.backward`` call by call
(same order and shapes), with ``gpt2_costs``' counting rules (``base.KernelCost``). The
``nn.Linear`` layout makes the forward GEMM "nt" and the weight gradient "tn"; T5 has no
biases. RMS norm: a sum of squares and two multiplies per element forward (the sum is the
serial part), about twice that backward. Attention is ``attention_costs``' with separate
query and key lengths (cross-attention), the relative-position bias add and the decoder's
causal blocks; dropout costs a hash per element (``attention_costs.HASH``).
"""

from __future__ import annotations

from . import attention_costs
from .attention_costs import EXP, HASH
from .base import GradientGroup, KernelCost, gemm, vector
from .gpt2_costs import GELU_BWD, GELU_FWD

RMS_FWD, RMS_FWD_SERIAL = 4, 2
RMS_BWD, RMS_BWD_SERIAL = 9, 3


def _linear(name: str, N: int, c_in: int, c_out: int, phase: str) -> list[KernelCost]:
    if phase == "forward":
        return [gemm(name, N, c_in, c_out, phase, layout="nt")]
    return [
        gemm(name + ".dinput", N, c_out, c_in, phase),
        gemm(name + ".dweight", c_out, N, c_in, phase, layout="tn"),
    ]


def _rms(name: str, N: int, C: int, phase: str) -> KernelCost:
    if phase == "forward":
        return vector(
            name, RMS_FWD * N * C, 2 * N * C + C + N, phase, serial=RMS_FWD_SERIAL * N * C
        )
    return vector(
        name, RMS_BWD * N * C, 3 * N * C + N + 2 * C, phase, serial=RMS_BWD_SERIAL * N * C
    )


def _drop(name: str, n: int, p: float, phase: str) -> list[KernelCost]:
    return [vector(name, HASH * n, 2 * n, phase)] if p > 0 else []


def _add(name: str, n: int, phase: str) -> KernelCost:
    return vector(name, n, 3 * n, phase)


def _attention(
    name: str,
    B: int,
    Tq: int,
    Tk: int,
    NH: int,
    hs: int,
    p: float,
    bias: bool,
    phase: str,
    causal: bool = False,
) -> list[KernelCost]:
    return attention_costs.attention(name, B, NH, Tq, Tk, hs, phase, causal=causal, p=p, bias=bias)


def _ffn(name: str, cfg, N: int, B: int, phase: str) -> list[KernelCost]:
    D, F, p = cfg.d_model, cfg.d_ff, cfg.dropout_rate
    n = N * F
    wi = ("wi_0", "wi_1") if cfg.gated else ("wi",)
    if phase == "forward":
        out = [c for w in wi for c in _linear(name + w, N, D, F, phase)]
        if cfg.gated:
            out += [
                vector(name + "gelu", GELU_FWD * n, 2 * n, phase),
                vector(name + "gate", n, 3 * n, phase),
            ]
        else:
            out.append(vector(name + "relu", n, 2 * n, phase))
        return out + _drop(name + "dropout", n, p, phase) + _linear(name + "wo", N, F, D, phase)
    out = _linear(name + "wo", N, F, D, phase) + _drop(name + "dropout.bwd", n, p, phase)
    if cfg.gated:
        out += [
            vector(name + "gate.bwd", 2 * n, 5 * n, phase),
            vector(name + "gelu.bwd", GELU_BWD * n, 3 * n, phase),
        ]
    else:
        out.append(vector(name + "relu.bwd", n, 3 * n, phase))
    return out + [c for w in wi for c in _linear(name + w, N, D, F, phase)]


def kernel_costs(cfg, B: int, groups: list[GradientGroup]) -> list[KernelCost]:
    """Forward then backward of B samples (cfg: ``t5.T5Config``); ``groups``: the model's
    gradient groups, whose finishing kernels carry ``done`` in the order backward runs."""
    L, Ld, NH = cfg.num_layers, cfg.num_decoder_layers, cfg.num_heads
    D, C, V, p, hs = cfg.d_model, cfg.inner, cfg.vocab_size, cfg.dropout_rate, cfg.d_kv
    Te, Td = cfg.max_seq_length, cfg.target_length
    Ne, Nd = B * Te, B * Td
    nb = cfg.relative_attention_num_buckets
    f, b = "forward", "backward"
    out: list[KernelCost] = [
        vector("inputs.copy", 0, 2 * (Ne + 2 * Nd + B) + B * (Te + Td), f),
        # each stack's bias from its block 0's table (run by that block's stage)
        vector("encoder.relpos.bias", 0, NH * Te * Te * 2 + nb * NH, f),
        vector("decoder.relpos.bias", 0, NH * Td * Td * 2 + nb * NH, f),
        vector("encoder.embed", 0, 2 * Ne * D + Ne, f),
        *_drop("encoder.dropout", Ne * D, p, f),
    ]
    for i in range(L):
        n = f"encoder.{i}."
        out.append(_rms(n + "norm1", Ne, D, f))
        out += [c for a in "qkv" for c in _linear(n + a, Ne, D, C, f)]
        out += _attention(n + "attention", B, Te, Te, NH, hs, p, True, f)
        out += _linear(n + "o", Ne, C, D, f) + _drop(n + "attention.dropout", Ne * D, p, f)
        out += [_add(n + "residual1", Ne * D, f), _rms(n + "norm2", Ne, D, f)]
        out += _ffn(n + "ffn.", cfg, Ne, B, f) + _drop(n + "ffn.out.dropout", Ne * D, p, f)
        out.append(_add(n + "residual2", Ne * D, f))
    out.append(_rms("encoder.final_norm", Ne, D, f))
    out += _drop("encoder.final.dropout", Ne * D, p, f)
    out.append(vector("decoder.embed", 0, 2 * Nd * D + Nd, f))
    out += _drop("decoder.dropout", Nd * D, p, f)
    for j in range(Ld):
        n = f"decoder.{j}."
        out.append(_rms(n + "norm1", Nd, D, f))
        out += [c for a in "qkv" for c in _linear(n + a, Nd, D, C, f)]
        out += _attention(n + "self", B, Td, Td, NH, hs, p, True, f, causal=True)
        out += _linear(n + "o", Nd, C, D, f) + _drop(n + "self.dropout", Nd * D, p, f)
        out += [_add(n + "residual1", Nd * D, f), _rms(n + "norm2", Nd, D, f)]
        out += _linear(n + "cross.q", Nd, D, C, f)
        out += _linear(n + "cross.k", Ne, D, C, f) + _linear(n + "cross.v", Ne, D, C, f)
        out += _attention(n + "cross", B, Td, Te, NH, hs, p, False, f)
        out += _linear(n + "cross.o", Nd, C, D, f) + _drop(n + "cross.dropout", Nd * D, p, f)
        out += [_add(n + "residual2", Nd * D, f), _rms(n + "norm3", Nd, D, f)]
        out += _ffn(n + "ffn.", cfg, Nd, B, f) + _drop(n + "ffn.out.dropout", Nd * D, p, f)
        out.append(_add(n + "residual3", Nd * D, f))
    out.append(_rms("decoder.final_norm", Nd, D, f))
    out += _drop("decoder.final.dropout", Nd * D, p, f)
    if cfg.tie_word_embeddings:
        out.append(vector("lm_head.scale", Nd * D, 2 * Nd * D, f))
    out += _linear("lm_head", Nd, D, V, f)
    ce = (EXP + 4) * Nd * V
    out.append(vector("softmax_ce", ce, 2 * Nd * V + 2 * Nd, f, serial=2 * Nd * V))
    # ---- backward
    done = iter(g.names for g in groups)
    out.append(vector("softmax_ce.bwd", Nd * V, 2 * Nd * V + Nd, b))
    out += _linear("lm_head", Nd, D, V, b)
    if cfg.tie_word_embeddings:
        out.append(vector("lm_head.scale.bwd", Nd * D, 2 * Nd * D, b))
    out += _drop("decoder.final.dropout.bwd", Nd * D, p, b)
    out.append(_rms("decoder.final_norm.bwd", Nd, D, b)._replace(done=next(done)))
    out.append(vector("zero.dbias", 0, NH * (Te * Te + Td * Td) + Ne * D, b))
    for j in range(Ld - 1, -1, -1):
        n = f"decoder.{j}."
        out += _drop(n + "ffn.out.dropout.bwd", Nd * D, p, b) + _ffn(n + "ffn.", cfg, Nd, B, b)
        out.append(_rms(n + "norm3.bwd", Nd, D, b))
        out += _drop(n + "cross.dropout.bwd", Nd * D, p, b) + _linear(n + "cross.o", Nd, C, D, b)
        out += _attention(n + "cross", B, Td, Te, NH, hs, p, False, b)
        out += _linear(n + "cross.q", Nd, D, C, b)
        out += _linear(n + "cross.k", Ne, D, C, b) + _linear(n + "cross.v", Ne, D, C, b)
        out.append(_rms(n + "norm2.bwd", Nd, D, b))
        out += _drop(n + "self.dropout.bwd", Nd * D, p, b) + _linear(n + "o", Nd, C, D, b)
        out += _attention(n + "self", B, Td, Td, NH, hs, p, True, b, causal=True)
        out += [c for a in "qkv" for c in _linear(n + a, Nd, D, C, b)]
        last = _rms(n + "norm1.bwd", Nd, D, b)
        if j == 0:
            out.append(last)
            last = vector("decoder.relpos.bwd", NH * Td * Td, 2 * NH * Td * Td + nb * NH, b)
        out.append(last._replace(done=next(done)))
    out += _drop("decoder.dropout.bwd", Nd * D, p, b)
    out.append(vector("decoder.embed.bwd", Nd * D, 3 * Nd * D + Nd, b))
    out += _drop("encoder.final.dropout.bwd", Ne * D, p, b)
    out.append(_rms("encoder.final_norm.bwd", Ne, D, b)._replace(done=next(done)))
    for i in range(L - 1, -1, -1):
        n = f"encoder.{i}."
        out += _drop(n + "ffn.out.dropout.bwd", Ne * D, p, b) + _ffn(n + "ffn.", cfg, Ne, B, b)
        out.append(_rms(n + "norm2.bwd", Ne, D, b))
        out += _drop(n + "attention.dropout.bwd", Ne * D, p, b) + _linear(n + "o", Ne, C, D, b)
        out += _attention(n + "attention", B, Te, Te, NH, hs, p, True, b)
        out += [c for a in "qkv" for c in _linear(n + a, Ne, D, C, b)]
        last = _rms(n + "norm1.bwd", Ne, D, b)
        if i == 0:
            out.append(last)
            last = vector("encoder.relpos.bwd", NH * Te * Te, 2 * NH * Te * Te + nb * NH, b)
        out.append(last._replace(done=next(done)))
    out += _drop("encoder.dropout.bwd", Ne * D, p, b)
    out.append(vector("encoder.embed.bwd", Ne * D, 3 * Ne * D + Ne, b)._replace(done=next(done)))
    return out
