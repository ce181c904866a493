"""PyTorch twins of simdist's models, for parity tests and benchmarks (optional: torch).

Parameter names and layouts match simdist's checkpoints, so weights move by name:
- ``TorchMLP``: FC-MNIST; simdist stores linear weights (in, out), so ``fcN.weight`` here is
  an (in, out) parameter used as ``x @ W + b``;
- ``TorchGPT2``: GPT-2 with Hugging Face's state-dict names (Conv1D weights (in, out)),
  tied LM head.
Importing this module imports torch; simdist itself never does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class TorchMLP(nn.Module):
    def __init__(self, sizes: list[int]):
        super().__init__()
        self.sizes = sizes
        for i in range(len(sizes) - 1):
            bound = 1.0 / sizes[i] ** 0.5
            w = torch.empty(sizes[i], sizes[i + 1]).uniform_(-bound, bound)
            b = torch.empty(sizes[i + 1]).uniform_(-bound, bound)
            setattr(self, f"fc{i + 1}", nn.Module())
            getattr(self, f"fc{i + 1}").weight = nn.Parameter(w)
            getattr(self, f"fc{i + 1}").bias = nn.Parameter(b)

    def forward(self, x, targets):
        n = len(self.sizes) - 1
        for i in range(n):
            layer = getattr(self, f"fc{i + 1}")
            x = torch.addmm(layer.bias, x, layer.weight)
            if i < n - 1:
                x = torch.relu(x)
        return F.cross_entropy(x, targets)


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 linear layer: weight stored (in, out)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out).normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(
            *x.shape[:-1], -1
        )


class Attention(nn.Module):
    def __init__(self, C: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = Conv1D(C, 3 * C)
        self.c_proj = Conv1D(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (a.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, C: int):
        super().__init__()
        self.c_fc = Conv1D(C, 4 * C)
        self.c_proj = Conv1D(4 * C, C)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = Attention(C, n_head)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT2(nn.Module):
    """``cfg`` has n_layer, n_head, n_embd, block_size, vocab_size (simdist's GPT2Config)."""

    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.h = nn.ModuleList(Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=1e-5)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(T, device=tokens.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied LM head
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
