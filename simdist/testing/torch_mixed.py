"""A PyTorch GPT-2 trained with simdist's mixed-precision casts (test reference; imports torch).

The same contract as ``simdist.precision``, written with PyTorch's own ops: the weights are
the half rounding of an fp32 master; every activation and activation gradient is rounded to
the half format where simdist's kernels store it (straight-through in autograd: the
rounding of a value is exact, its gradient is rounded by a tensor hook); matrix products
take half operands (attention's float32 probabilities and score gradients rounded where
they enter one) and accumulate in float32; the parameter gradients are rounded to
the half format, clipped by their global norm and applied by AdamW to the fp32 master.
``half=None`` runs the same code in plain float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from torch.nn import functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Casts:
    def __init__(self, half: str | None):
        self.dtype = DTYPES.get(half) if half else None

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """t's value stored in the half format (gradient passes through)."""
        if self.dtype is None:
            return t
        return t + (t.detach().to(self.dtype).float() - t.detach())

    def grad(self, t: torch.Tensor) -> torch.Tensor:
        """The gradient reaching t is stored in the half format."""
        if self.dtype is not None and t.requires_grad:
            t.register_hook(lambda g: g.to(self.dtype).float())
        return t

    def store(self, t: torch.Tensor) -> torch.Tensor:
        return self.grad(self.value(t))


class _StoredInputLayerNorm(torch.autograd.Function):
    """simdist's fused residual add + layer norm: the statistics and output come from the
    float32 sum ``s``, while the backward reads the input as stored (``x``: ``s`` in the
    half format) with those statistics (kernels/layernorm.py)."""

    @staticmethod
    def forward(ctx, s, x, w, b):
        mean = s.mean(-1, keepdim=True)
        rstd = torch.rsqrt(((s - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
        ctx.save_for_backward(x, w, mean, rstd)
        return (s - mean) * rstd * w + b

    @staticmethod
    def backward(ctx, g):
        x, w, mean, rstd = ctx.saved_tensors
        xhat = (x - mean) * rstd
        dxhat = g * w
        dx = rstd * (
            dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
        )
        dims = tuple(range(g.dim() - 1))
        return dx, None, (g * xhat).sum(dims), g.sum(dims)


def _ln(s, x, w, b):
    if x is s:
        return F.layer_norm(s, (s.shape[-1],), w, b, eps=1e-5)
    return _StoredInputLayerNorm.apply(s, x.detach(), w, b)


def gpt2_loss(p: dict[str, torch.Tensor], tokens, targets, cfg, c: Casts) -> torch.Tensor:
    """Mean next-token loss of simdist's GPT-2, cast where simdist stores (models/gpt2.py)."""
    B, T = tokens.shape
    C, H = cfg.n_embd, cfg.n_head
    x = c.store(p["wte.weight"][tokens] + p["wpe.weight"][:T])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    s = x  # the residual stream as the next layer norm reads it (an fp32 sum)
    for i in range(cfg.n_layer):
        h = f"h.{i}."
        x = c.store(s)
        ln1 = c.store(_ln(s, x, p[h + "ln_1.weight"], p[h + "ln_1.bias"]))
        qkv = c.store(ln1 @ p[h + "attn.c_attn.weight"] + p[h + "attn.c_attn.bias"])
        q, k, v = (a.view(B, T, H, C // H).transpose(1, 2) for a in qkv.split(C, dim=2))
        # every matrix product takes half operands (kernels.blas.half_operands): the
        # float32 probabilities and score gradients are rounded where they enter one
        scores = c.grad((q @ k.transpose(-1, -2)) / math.sqrt(C // H))
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        y = c.store((c.value(att) @ v).transpose(1, 2).reshape(B, T, C))
        branch = c.value(y @ p[h + "attn.c_proj.weight"] + p[h + "attn.c_proj.bias"])
        s = c.grad(x + branch)
        x = c.store(s)
        ln2 = c.store(_ln(s, x, p[h + "ln_2.weight"], p[h + "ln_2.bias"]))
        fc = c.store(ln2 @ p[h + "mlp.c_fc.weight"] + p[h + "mlp.c_fc.bias"])
        g = c.store(F.gelu(fc, approximate="tanh"))
        branch = c.value(g @ p[h + "mlp.c_proj.weight"] + p[h + "mlp.c_proj.bias"])
        s = c.grad(x + branch)
    lnf = c.store(_ln(s, c.value(s), p["ln_f.weight"], p["ln_f.bias"]))
    logits = c.store(lnf @ p["wte.weight"].T)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_gpt2(
    cfg,
    init: dict[str, np.ndarray],
    decay: dict[str, bool],
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    half: str | None,
    lr: float | list[float],
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    max_norm: float | None,
    loss_scale: float | None = None,
) -> list[float]:
    """Per-step losses of AdamW on an fp32 master, weights = its half rounding; ``lr``: one
    rate, or each step's. ``loss_scale``: the loss is multiplied by it before backward and
    the gradients divided by it after their rounding; a step whose gradients overflow is
    skipped and the scale halved (GradScaler, no growth: use runs shorter than its
    interval)."""
    c = Casts(half)
    master = {k: torch.from_numpy(v.copy()) for k, v in init.items()}
    groups = [
        {"params": [t for k, t in master.items() if decay[k]], "weight_decay": weight_decay},
        {"params": [t for k, t in master.items() if not decay[k]], "weight_decay": 0.0},
    ]
    rates = lr if isinstance(lr, list) else None
    opt = torch.optim.AdamW(groups, lr=rates[0] if rates else lr, betas=betas, eps=eps)
    losses = []
    for step, (tokens, targets) in enumerate(batches):
        if rates:
            for g in opt.param_groups:
                g["lr"] = rates[step]
        w = {k: c.value(m).detach().requires_grad_(True) for k, m in master.items()}
        loss = gpt2_loss(
            w, torch.from_numpy(tokens).long(), torch.from_numpy(targets).long(), cfg, c
        )
        (loss if loss_scale is None else loss * loss_scale).backward()
        losses.append(float(loss.detach()))
        grads = {k: c.value(t.grad) for k, t in w.items()}
        if loss_scale is not None:
            if not all(bool(torch.isfinite(g).all()) for g in grads.values()):
                loss_scale /= 2
                continue
            inv = torch.tensor(1.0 / loss_scale, dtype=torch.float32)
            grads = {k: g * inv for k, g in grads.items()}
        if max_norm is not None:
            norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                grads = {k: g * torch.tensor(coef, dtype=torch.float32) for k, g in grads.items()}
        for k, m in master.items():
            m.grad = grads[k]
        opt.step()
    return losses
