"""The kernel calls of one GPT-2 training micro-batch, with their FLOPs and bytes.

``kernel_costs(cfg, B, T)`` mirrors ``GPT2._forward`` and ``GPT2.backward`` call by call
(same order, same shapes) so that the simulated device runs exactly the kernels the CPU
ran. Counting rules are those of ``simdist.models.base.KernelCost``; per kernel:

* linear layers (``kernels/linear.py``): one GEMM per product (forward; backward input and
  weight gradients) plus the bias loop (add in forward, column sum in backward);
* attention: ``attention_costs.attention`` (causal; the products in row blocks that skip
  the masked ones, no gather or scatter);
* layernorm: mean, two-pass variance, normalise (8 FLOPs per element), fused with the
  residual add where the model fuses it; backward 18 per element (+1 accumulating);
* exp (``rowops.exp_f32``): 24 FLOPs (range reduction and a degree-7 polynomial), GELU's
  tanh (``gelu.tanh_f32``) 23, so GELU is 31 forward and 40 backward per element;
* ``serial``: the FLOPs in ``rowops``' row reductions (the layernorms' sums, the softmaxes'
  and the loss's max and sum: a chain of dependent adds per lane), costed at the device's
  reduction rate (``scalar_tflops``); the exp of both is ``exp_f32``, which vectorises.
"""

from __future__ import annotations

from . import attention_costs
from .attention_costs import EXP
from .base import KernelCost, gemm, vector

GELU_FWD = 31
GELU_BWD = 40
LN_FWD = 8
LN_BWD = 18
# of which in rowops' reductions: forward row_sum (1) and row_sq_dev (3); backward
# row_dot (2) and row_dot_dev (4)
LN_FWD_SERIAL = 4
LN_BWD_SERIAL = 6


def _linear(name: str, N: int, c_in: int, c_out: int, phase: str) -> list[KernelCost]:
    if phase == "forward":
        return [
            gemm(name, N, c_in, c_out, phase),
            vector(name + ".bias", N * c_out, 2 * N * c_out + c_out, phase),
        ]
    return [
        gemm(name + ".dinput", N, c_out, c_in, phase, layout="nt"),
        gemm(name + ".dweight", c_in, N, c_out, phase, layout="tn"),
        vector(name + ".dbias", N * c_out, N * c_out + c_out, phase),
    ]


def _layernorm(name: str, N: int, C: int, phase: str, fused_add: bool = False) -> KernelCost:
    if phase == "forward":
        flops = (LN_FWD + fused_add) * N * C
        moved = (2 + 2 * fused_add) * N * C + 2 * C + 2 * N
        return vector(name, flops, moved, phase, serial=LN_FWD_SERIAL * N * C)
    # backward, accumulating into the residual gradient when fused_add
    flops = (LN_BWD + fused_add) * N * C
    moved = (3 + fused_add) * N * C + 2 * N + 3 * C
    return vector(name, flops, moved, phase, serial=LN_BWD_SERIAL * N * C)


def _attention(name: str, B: int, T: int, NH: int, hs: int, phase: str) -> list[KernelCost]:
    return attention_costs.attention(name, B, NH, T, T, hs, phase, causal=True)


def kernel_costs(cfg, B: int, T: int) -> list[KernelCost]:
    """Forward then backward of one micro-batch of B sequences of T tokens (cfg: GPT2Config)."""
    C, L, NH, V = cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size
    hs, N = C // NH, B * T
    f, b = "forward", "backward"
    out: list[KernelCost] = [
        vector("tokens.copy", 0, 4 * N, f),  # tokens and targets into the arena (int32)
        vector("embedding", N * C, 2 * N * C + T * C + N, f),
        _layernorm("h.0.ln_1", N, C, f),
    ]
    for i in range(L):
        h = f"h.{i}."
        out += _linear(h + "attn.c_attn", N, C, 3 * C, f)
        out += _attention(h + "attn", B, T, NH, hs, f)
        out += _linear(h + "attn.c_proj", N, C, C, f)
        out.append(_layernorm(h + "ln_2", N, C, f, fused_add=True))
        out += _linear(h + "mlp.c_fc", N, C, 4 * C, f)
        out.append(vector(h + "mlp.gelu", GELU_FWD * N * 4 * C, 2 * N * 4 * C, f))
        out += _linear(h + "mlp.c_proj", N, 4 * C, C, f)
        nxt = f"h.{i + 1}.ln_1" if i + 1 < L else "ln_f"
        out.append(_layernorm(nxt, N, C, f, fused_add=True))
    out.append(gemm("lm_head", N, C, V, f, layout="nt"))
    # per logit: the row's max and sum (serial), exp_f32 and the normalisation (vectorised)
    out.append(vector("softmax_ce", (EXP + 4) * N * V, 2 * N * V + 2 * N, f, serial=2 * N * V))

    out.append(vector("softmax_ce.bwd", N * V, 2 * N * V + N, b))
    out.append(gemm("lm_head.dinput", N, V, C, b))
    out.append(gemm("lm_head.dwte", V, N, C, b, layout="tn"))
    out.append(_layernorm("ln_f.bwd", N, C, b)._replace(done=("ln_f.weight", "ln_f.bias")))
    for i in range(L - 1, -1, -1):
        h = f"h.{i}."
        out += _linear(h + "mlp.c_proj", N, 4 * C, C, b)
        out.append(vector(h + "mlp.gelu.bwd", GELU_BWD * N * 4 * C, 3 * N * 4 * C, b))
        out += _linear(h + "mlp.c_fc", N, C, 4 * C, b)
        out.append(_layernorm(h + "ln_2.bwd", N, C, b, fused_add=True))
        out += _linear(h + "attn.c_proj", N, C, C, b)
        out += _attention(h + "attn", B, T, NH, hs, b)
        out += _linear(h + "attn.c_attn", N, C, 3 * C, b)
        names = tuple(f"{h}{p}" for p in LAYER_PARAMS)
        out.append(_layernorm(h + "ln_1.bwd", N, C, b, fused_add=True)._replace(done=names))
    out.append(vector("wpe.grad.zero", 0, cfg.block_size * C, b))
    done = ("wte.weight", "wpe.weight")
    out.append(vector("embedding.bwd", 2 * N * C, 3 * N * C + 2 * T * C, b)._replace(done=done))
    return out


# A block's parameters in the Hugging Face state-dict order (the flat layout's order too).
LAYER_PARAMS = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
)
