"""The kernel calls of one attention layer (``kernels/attention.py``), with FLOPs and bytes.

Every model's cost list (``gpt2_costs``, ``bert_costs``, ``t5_costs``, ``transformer_costs``)
prices its attention here, so the simulated device runs the products the CPU ran. Per
(sample, head), as ``_head_forward`` / ``_head_backward`` do it:

* no gather or scatter: BLAS reads the head's q, k, v columns in place and writes its
  output and dq, dk, dv straight into the head's columns;
* a causal head of T >= 2 ``CAUSAL_BLOCK`` positions multiplies in row blocks of
  ``CAUSAL_BLOCK`` and skips the blocks above the diagonal: each block is a GEMM of its own
  shape (query block i against key blocks 0..i), timed at that shape; shorter or
  bidirectional heads are one dense Tq x Tk product each;
* the softmax runs over the visible scores (T(T+1)/2 causal, else Tq Tk; its max and sum are
  ``rowops``' reductions, priced at the reduction rate, its exp ``exp_f32``, which
  vectorises) and zero-fills the
  rest of each row, so it reads and writes all Tq Tk scores;
* dropout (p > 0) draws a mask per score, over the whole Tq x Tk matrix, twice backward
  (the probabilities into the products, and the gradient back through the mask).
"""

from __future__ import annotations

from simdist.kernels.attention import CAUSAL_BLOCK

from .base import KernelCost, gemm, vector

EXP = 24  # FLOPs of one exp_f32 (range reduction and a degree-7 polynomial)
HASH = 12  # a dropout draw: one SplitMix64 finaliser + the compare / select


def row_blocks(T: int, causal: bool) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the row blocks a head's products run in: several blocks for a
    causal head of T >= 2 ``CAUSAL_BLOCK`` (``kernels.attention._causal_block``), else one."""
    if not causal or T < 2 * CAUSAL_BLOCK:
        return [(0, T)]
    return [(i, min(i + CAUSAL_BLOCK, T)) for i in range(0, T, CAUSAL_BLOCK)]


def _scores(name: str, Tq: int, Tk: int, hs: int, blocks, phase: str, calls: int):
    """c = a b^T into the (Tq, Tk) scores (``_product_bt``): q k^T forward, dY V^T backward."""
    if len(blocks) == 1:
        return [gemm(name, Tq, hs, Tk, phase, calls, "nt")]
    return [gemm(f"{name}[{i}:{e}]", e - i, hs, e, phase, calls, "nt") for i, e in blocks]


def _times(name: str, Tq: int, Tk: int, hs: int, blocks, phase: str, calls: int):
    """c = P b, P the (Tq, Tk) scores (``_product``): P V forward, dS K backward."""
    if len(blocks) == 1:
        return [gemm(name, Tq, Tk, hs, phase, calls)]
    return [gemm(f"{name}[{i}:{e}]", e - i, e, hs, phase, calls) for i, e in blocks]


def _times_t(name: str, Tq: int, Tk: int, hs: int, blocks, phase: str, calls: int):
    """c = P^T b (``_product_t``): dV = P^T dY and dK = dS^T Q; key block j takes the query
    rows from j on."""
    if len(blocks) == 1:
        return [gemm(name, Tk, Tq, hs, phase, calls, "tn")]
    return [gemm(f"{name}[{j}:{e}]", e - j, Tq - j, hs, phase, calls, "tn") for j, e in blocks]


def attention(
    name: str,
    B: int,
    NH: int,
    Tq: int,
    Tk: int,
    hs: int,
    phase: str,
    *,
    causal: bool,
    p: float = 0.0,
    bias: bool = False,
) -> list[KernelCost]:
    """One attention layer's calls over B samples of NH heads of width hs, forward or
    backward. ``bias``: a score bias added forward and accumulated backward (T5)."""
    if causal and Tq != Tk:
        raise ValueError("causal attention needs as many queries as keys")
    calls, S = B * NH, Tq * Tk
    visible = Tq * (Tq + 1) // 2 if causal else S
    blocks = row_blocks(Tq, causal)
    drop = [vector(name + ".dropout", (HASH + 1) * S, 2 * S, phase, calls)] if p > 0 else []
    if phase == "forward":
        add = [vector(name + ".bias", S, 3 * S, phase, calls)] if bias else []
        return [
            *_scores(name + ".qk", Tq, Tk, hs, blocks, phase, calls),
            *add,
            # max, exp, sum and scale per visible score; the rest of each row zero-filled
            vector(name + ".softmax", (EXP + 3) * visible, 2 * S, phase, calls, 2 * visible),
            *drop,
            *_times(name + ".pv", Tq, Tk, hs, blocks, phase, calls),
        ]
    dv = _times_t(name + ".dv", Tq, Tk, hs, blocks, phase, calls)
    dp = _scores(name + ".dp", Tq, Tk, hs, blocks, phase, calls)
    # with dropout the kernel forms drop(P) first for dV, then dP and its way back
    products = [*drop, *dv, *dp, *drop] if p > 0 else [*dp, *dv]
    add = [vector(name + ".dbias", S, 3 * S, phase, calls)] if bias else []
    return [
        *products,
        vector(name + ".softmax.bwd", 4 * visible, 3 * S, phase, calls, 2 * visible),
        *add,
        *_times(name + ".dq", Tq, Tk, hs, blocks, phase, calls),
        *_times_t(name + ".dk", Tq, Tk, hs, blocks, phase, calls),
    ]


__all__ = ["EXP", "HASH", "attention", "row_blocks"]
