"""GPT-2's tied LM head: logits = x @ wte.T with no bias, and its backward.

The generic biased layer (c_attn, c_proj, c_fc) is ``linear.py``; this one differs in the
weight layout, (V, C) as the token embedding stores it, so its product is with ``wte.T``,
which BLAS reads as a transposed operand at no cost.
"""

import numpy as np

from ._jit import kernel
from .blas import gemm

ONE, ZERO = np.float32(1.0), np.float32(0.0)


@kernel
def lm_head_forward(logits, inp, wte):
    """logits = inp @ wte.T."""
    # logits: (N, V); inp: (N, C); wte: (V, C)
    gemm(inp, wte.T, logits, ONE, ZERO)


@kernel
def lm_head_backward(dinp, dwte, dlogits, inp, wte):
    """dinp = dlogits @ wte and dwte = dlogits.T @ inp; overwrites both."""
    # dinp: (N, C); dwte: (V, C); dlogits: (N, V); inp: (N, C); wte: (V, C)
    gemm(dlogits, wte, dinp, ONE, ZERO)
    # the embedding's backward adds its share into dwte afterwards (weights are tied)
    gemm(dlogits.T, inp, dwte, ONE, ZERO)


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    x = np.ones((2, 3), dtype=np.float32)
    w = np.ones((4, 3), dtype=np.float32)
    y = np.zeros((2, 4), dtype=np.float32)
    lm_head_forward(y, x, w)
    lm_head_backward(x.copy(), w.copy(), y, x, w)
