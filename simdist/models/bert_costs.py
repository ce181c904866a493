"""The kernel calls of one BERT training micro-batch, with their FLOPs and bytes.

``kernel_costs(cfg, B, T)`` mirrors ``Bert._forward`` and ``Bert.backward`` call by call
(same order and shapes), with ``gpt2_costs``' counting rules (``base.KernelCost``). The
``nn.Linear`` layout (weight (out, in)) makes the forward GEMM "nt" and the weight
gradient "tn". Attention is bidirectional: the softmax covers all T x T scores. Dropout
costs a hash per element (SplitMix64: ~12 integer operations, counted as FLOPs).

``bert_shapes.plan_shape(cfg)``: what ``simdist.plan`` needs to plan a BERT preset (the
encoder layer has GPT-2's layer shapes; embeddings add segments, the heads add pooler and
MLM transform).
"""

from __future__ import annotations

from . import attention_costs
from .attention_costs import EXP, HASH
from .base import KernelCost, gemm, vector
from .gpt2_costs import LN_BWD, LN_BWD_SERIAL, LN_FWD, LN_FWD_SERIAL

# exact GELU (``kernels/transformer_act.py``), vectorised: |x|, t = 1 / (1 + z / 2) (5), the
# erfc exponent's degree-9 polynomial (18), -z^2 (2), exp_f32, the tail and x Phi(x) (4);
# backward adds the pdf (exp_f32 and 4) and the product with dout (3)
GELU_ERF_FWD = 29 + EXP
GELU_ERF_BWD = GELU_ERF_FWD + EXP + 7
TANH = 23


def _linear(name: str, N: int, c_in: int, c_out: int, phase: str) -> list[KernelCost]:
    if phase == "forward":
        return [
            gemm(name, N, c_in, c_out, phase, layout="nt"),
            vector(name + ".bias", N * c_out, 2 * N * c_out + c_out, phase),
        ]
    return [
        gemm(name + ".dinput", N, c_out, c_in, phase),
        gemm(name + ".dweight", c_out, N, c_in, phase, layout="tn"),
        vector(name + ".dbias", N * c_out, N * c_out + c_out, phase),
    ]


def _ln(name: str, N: int, C: int, phase: str, fused_add: bool = False) -> KernelCost:
    if phase == "forward":
        moved = (2 + 2 * fused_add) * N * C + 2 * C + 2 * N
        return vector(
            name, (LN_FWD + fused_add) * N * C, moved, phase, serial=LN_FWD_SERIAL * N * C
        )
    moved = 3 * N * C + 2 * N + 3 * C
    return vector(name, LN_BWD * N * C, moved, phase, serial=LN_BWD_SERIAL * N * C)


def _dropout(name: str, n: int, p: float, phase: str) -> list[KernelCost]:
    return [vector(name, HASH * n, 2 * n, phase)] if p > 0 else []


def _attention(
    name: str, B: int, T: int, NH: int, hs: int, p: float, phase: str
) -> list[KernelCost]:
    return attention_costs.attention(name, B, NH, T, T, hs, phase, causal=False, p=p)


def kernel_costs(
    cfg, B: int, T: int, embed_params: tuple, head_params: tuple, layer_params: tuple
) -> list[KernelCost]:
    """Forward then backward of B sequences of T tokens (cfg: ``bert.BertConfig``); the
    gradient groups that the embedding's, each layer's and the heads' last kernels finish are
    the model's (passed in, so that this module needs no import of the model)."""

    L, H, I, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    NH, P = cfg.num_attention_heads, cfg.max_predictions_per_seq
    ph, pa = cfg.hidden_dropout_prob, cfg.attention_probs_dropout_prob
    hs, N, M = H // NH, B * T, B * P
    f, b = "forward", "backward"
    out: list[KernelCost] = [
        vector("inputs.copy", 0, 2 * (3 * N + 2 * M + 3 * B), f),
        vector("embedding", 2 * N * H, 2 * N * H + N * H + 2 * N, f),
        _ln("embeddings.LayerNorm", N, H, f),
        *_dropout("embeddings.dropout", N * H, ph, f),
    ]
    for i in range(L):
        n = f"layer.{i}."
        for proj in ("query", "key", "value"):
            out += _linear(n + proj, N, H, H, f)
        out += _attention(n + "attention", B, T, NH, hs, pa, f)
        out += _linear(n + "attention.output.dense", N, H, H, f)
        out += _dropout(n + "attention.output.dropout", N * H, ph, f)
        out.append(_ln(n + "attention.output.LayerNorm", N, H, f, fused_add=True))
        out += _linear(n + "intermediate.dense", N, H, I, f)
        out.append(vector(n + "intermediate.gelu", GELU_ERF_FWD * N * I, 2 * N * I, f))
        out += _linear(n + "output.dense", N, I, H, f)
        out += _dropout(n + "output.dropout", N * H, ph, f)
        out.append(_ln(n + "output.LayerNorm", N, H, f, fused_add=True))
    ce = (EXP + 4) * M * V
    out += [
        vector("mlm.gather", 0, 2 * M * H, f),
        *_linear("mlm.transform.dense", M, H, H, f),
        vector("mlm.transform.gelu", GELU_ERF_FWD * M * H, 2 * M * H, f),
        _ln("mlm.transform.LayerNorm", M, H, f),
        *_linear("mlm.decoder", M, H, V, f),
        vector("mlm.softmax_ce", ce, 2 * M * V + 2 * M, f, serial=2 * M * V),
        vector("pooler.gather", 0, 2 * B * H, f),
        *_linear("pooler.dense", B, H, H, f),
        vector("pooler.tanh", TANH * B * H, 2 * B * H, f),
        *_linear("nsp", B, H, 2, f),
        vector("nsp.softmax_ce", (EXP + 4) * 2 * B, 6 * B, f, serial=2 * 2 * B),
    ]
    out += [
        vector("mlm.softmax_ce.bwd", M * V, 2 * M * V + M, b),
        *_linear("mlm.decoder", M, H, V, b),
        _ln("mlm.transform.LayerNorm.bwd", M, H, b),
        vector("mlm.transform.gelu.bwd", GELU_ERF_BWD * M * H, 3 * M * H, b),
        *_linear("mlm.transform.dense", M, H, H, b),
        vector("nsp.softmax_ce.bwd", 2 * B, 6 * B, b),
        *_linear("nsp", B, H, 2, b),
        vector("pooler.tanh.bwd", 3 * B * H, 3 * B * H, b),
    ]
    pooler = _linear("pooler.dense", B, H, H, b)
    pooler[-1] = pooler[-1]._replace(done=head_params)
    out += pooler
    out.append(vector("scatter_rows.bwd", M * H + B * H, N * H + 2 * (M + B) * H, b))
    for i in range(L - 1, -1, -1):
        n = f"layer.{i}."
        out.append(_ln(n + "output.LayerNorm.bwd", N, H, b))
        out += _dropout(n + "output.dropout.bwd", N * H, ph, b)
        out += _linear(n + "output.dense", N, I, H, b)
        out.append(vector(n + "intermediate.gelu.bwd", GELU_ERF_BWD * N * I, 3 * N * I, b))
        out += _linear(n + "intermediate.dense", N, H, I, b)
        out.append(vector(n + "residual.bwd", N * H, 3 * N * H, b))
        out.append(_ln(n + "attention.output.LayerNorm.bwd", N, H, b))
        out += _dropout(n + "attention.output.dropout.bwd", N * H, ph, b)
        out += _linear(n + "attention.output.dense", N, H, H, b)
        out += _attention(n + "attention", B, T, NH, hs, pa, b)
        for proj in ("query", "key", "value"):
            out += _linear(n + proj, N, H, H, b)
        names = tuple(f"bert.encoder.layer.{i}.{p}" for p in layer_params)
        out.append(
            vector(n + "residual.bwd", 3 * N * H, 9 * N * H, b, count=1)._replace(done=names)
        )
    out += _dropout("embeddings.dropout.bwd", N * H, ph, b)
    out.append(_ln("embeddings.LayerNorm.bwd", N, H, b))
    moved = 4 * N * H + 2 * N + (cfg.max_position_embeddings + cfg.type_vocab_size) * H
    out.append(vector("embedding.bwd", 3 * N * H, moved, b)._replace(done=embed_params))
    return out
