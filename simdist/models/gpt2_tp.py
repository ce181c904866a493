"""GPT-2 split Megatron-style over a tensor-parallel group (``tensor_parallel_mode: weight``).

What this file is: one rank's shard of GPT-2 (``GPT2TP``, the ``gpt2.GPT2`` model with its
stage functions re-sequenced around the group's collectives), which parameter slice of
the whole model each shard holds (``shard_index``, ``extract``, ``insert``), and the
shard's kernel list for the simulated device. What it is not: the kernels (the shard calls
``kernels/`` on its own shapes), the group's communicator or the optimizer (the schedule,
``simdist.schedules.tensor_parallel``).

The split, rank t of T (Shoeybi et al. 2019, "Megatron-LM", section 3):
- attention: ``c_attn`` column-parallel by heads (the q, k and v columns of heads
  [t H/T, (t+1) H/T)), ``attn.c_proj`` row-parallel (the same heads' rows);
- MLP: ``c_fc`` column-parallel (columns [t 4C/T, (t+1) 4C/T)), ``mlp.c_proj`` row-parallel;
- ``wte`` split over the vocabulary (rows [t V/T, (t+1) V/T)): the embedding looks up the
  tokens it owns (zeros elsewhere) and the group sums; the tied LM head gives each rank its
  vocabulary's logits and the cross-entropy is vocab-parallel: the row maxima (an
  all-gather of N floats), the sums of exponentials and the target's logit (from its owner)
  are reduced over the group; no rank ever holds a full row of logits;
- replicated: ``wpe``, the LayerNorms and the row-parallel layers' biases.
The row-parallel biases are added once, by rank 0 (the others add a zero vector), before
the group's all-reduce. Per block one all-reduce in forward (after each row-parallel
layer: Megatron's g) and one in backward (the input gradient of each column-parallel
layer: Megatron's f). Everything downstream of an all-reduce (the residual stream, the
LayerNorms, their gradients) is computed from bit-identical inputs on every rank of the
group, so the replicated parameters' gradients are bit-identical there too, and so are
their updates: no extra synchronisation keeps the copies equal (the schedule checks it).
The vocabulary is not padded: V and the heads must divide by T (checked at start-up).

Sequence parallelism (``runconfig.sequence_parallel``; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.2.2): the regions between
the column- and row-parallel layers (the residual stream, the LayerNorms) work on rank t's
block of the micro-batch's B T token rows, rows [t N/T, (t+1) N/T) of the (B, T) order.
With one sequence that is Megatron's split of the sequence; with B of them it is the same
amount of work and memory (Megatron's [s, b] layout interleaves the sequences instead),
and each all-gather is a plain concatenation, with no transpose around the collectives.
Megatron's g becomes a reduce-scatter after each row-parallel layer (backward: an
all-gather of the residual gradient), f an all-gather of the LayerNorm output before each
column-parallel layer (backward: a reduce-scatter); the LayerNorm outputs are kept as
shards and gathered again in backward for the weight gradients, as Megatron does. The
embedding's sum over the vocabulary shards is a reduce-scatter, and ln_f's output is
all-gathered before the LM head (the vocab-parallel cross-entropy stays on every row).
The LayerNorms' and ``wpe``'s gradients are then partial sums over the rank's rows: the
schedule sums them over the group once per step (``sequence_parallel_names``). The
row-parallel biases are still added by rank 0 before the reduction, so their gradients
come from the all-gathered residual gradient, whole and the same on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from simdist.config import ConfigError
from simdist.kernels._jit import kernel
from simdist.kernels.attention import attention_backward, attention_forward
from simdist.kernels.gelu import gelu_backward, gelu_forward
from simdist.kernels.layernorm import layernorm_backward_accumulate
from simdist.kernels.linear import linear_backward, linear_forward
from simdist.kernels.matmul import lm_head_forward
from simdist.kernels.rowops import exp_f32, row_sum

from . import gpt2_costs
from .base import KernelCost, ParamSpec, gemm, vector
from .gpt2 import (
    ARENA_ALIGN,
    GPT2,
    OWN_PACKED,
    PACKED,
    GPT2Config,
    _Views,
    activation_shapes,
    close_block,
    mid_block,
    open_block,
    parameter_specs,
    working_copies,
)
from .saved_words import aligned_layout

F32 = np.float32


# ------------------------------------------------------------------ vocab-parallel softmax
# The two halves of ``kernels/loss.py``'s softmax_cross_entropy_forward around the group's
# sums, with its exp_f32 and row_sum: given the same maximum a shard's exponentials are
# the one-rank kernel's bits; only the sum over the shards is grouped differently.
@kernel
def vocab_softmax_partial(probs, sums, logits, maxv):
    """probs[b, v] = exp(logits[b, v] - maxv[b]) over this shard's vocabulary; sums[b]
    their sum."""
    B, V = logits.shape
    for b in range(B):
        row = logits[b]
        p = probs[b]
        m = maxv[b]
        for v in range(V):
            p[v] = exp_f32(row[v] - m)
        sums[b] = row_sum(p, V)


@kernel
def vocab_softmax_finish(losses, probs, total, target_logit, maxv):
    """probs /= the group's sum (a true division, as the kernel); losses[b] = log(total)
    - (the target's logit - maxv), the kernel's formula."""
    B, V = probs.shape
    for b in range(B):
        t = total[b]
        p = probs[b]
        for v in range(V):
            p[v] /= t
        losses[b] = np.log(t) - (target_logit[b] - maxv[b])


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes the model uses."""
    logits = np.array([[1.0, 2.0], [0.5, -1.0]], F32)
    probs, sums, m = np.empty_like(logits), np.empty(2, F32), logits.max(axis=1)
    vocab_softmax_partial(probs, sums, logits, m)
    vocab_softmax_finish(np.empty(2, F32), probs, sums, logits[:, 0].copy(), m)


def check_split(
    cfg: GPT2Config,
    tp: int,
    key: str = "runconfig.tensor_parallel",
    sequence_parallel: bool = False,
) -> None:
    """Heads and vocabulary must divide by the degree (no padding of the vocabulary); with
    sequence parallelism the sequence length too."""
    for what, n in (("model.n_head", cfg.n_head), ("model.vocab_size", cfg.vocab_size)):
        if n % tp:
            raise ConfigError(
                f"{key}={tp} (weight mode) must divide {what} ({n}): each rank holds an "
                f"equal share of the heads, MLP columns (n_inner = 4 n_embd) and vocabulary "
                "rows; the vocabulary is not padded, choose a degree that divides both",
                key,
            )
    if sequence_parallel and cfg.block_size % tp:
        raise ConfigError(
            f"runconfig.sequence_parallel needs the sequence length (model.block_size, "
            f"{cfg.block_size}) to divide by {key}={tp}: each rank of the group holds an "
            "equal share of every micro-batch's tokens between the split layers",
            "runconfig.sequence_parallel",
        )


def shard_index(cfg: GPT2Config, tp: int, rank: int) -> dict[str, tuple[int, np.ndarray] | None]:
    """For each parameter: (axis, indices along it) of rank ``rank``'s slice, or None
    where every rank holds the whole tensor."""
    C, V = cfg.n_embd, cfg.vocab_size
    Cs, Fs, Vs = C // tp, 4 * C // tp, V // tp
    heads = np.arange(rank * Cs, (rank + 1) * Cs)
    qkv = np.concatenate([heads, C + heads, 2 * C + heads])  # q, k, v of the shard's heads
    ffn = np.arange(rank * Fs, (rank + 1) * Fs)
    out: dict[str, tuple[int, np.ndarray] | None] = {}
    for spec in parameter_specs(cfg):
        n = spec.name
        split = None
        if n == "wte.weight":
            split = (0, np.arange(rank * Vs, (rank + 1) * Vs))
        elif n.endswith("attn.c_attn.weight") or n.endswith("attn.c_attn.bias"):
            split = (len(spec.shape) - 1, qkv)
        elif n.endswith("attn.c_proj.weight"):
            split = (0, heads)
        elif n.endswith("mlp.c_fc.weight") or n.endswith("mlp.c_fc.bias"):
            split = (len(spec.shape) - 1, ffn)
        elif n.endswith("mlp.c_proj.weight"):
            split = (0, ffn)
        out[n] = split
    return out


def shard_specs(cfg: GPT2Config, tp: int) -> list[ParamSpec]:
    """The shard's parameters: the whole model's names and order, the shard's shapes."""
    index = shard_index(cfg, tp, 0)
    specs = []
    for spec in parameter_specs(cfg):
        shape = list(spec.shape)
        if index[spec.name] is not None:
            axis, idx = index[spec.name]
            shape[axis] = idx.size
        specs.append(ParamSpec(spec.name, tuple(shape), spec.weight_decay))
    return specs


def extract(full: np.ndarray, split: tuple[int, np.ndarray] | None) -> np.ndarray:
    """A rank's slice of a whole tensor (a copy)."""
    return full.copy() if split is None else np.take(full, split[1], axis=split[0])


def insert(full: np.ndarray, part: np.ndarray, split: tuple[int, np.ndarray] | None) -> None:
    """Write a rank's slice back into the whole tensor."""
    if split is None:
        full[...] = part
    else:
        idx: list[Any] = [slice(None)] * full.ndim
        idx[split[0]] = split[1]
        full[tuple(idx)] = part


# ------------------------------------------------------------------ sequence-parallel arena
# the tensors that hold one rank's block of the N token rows (the rest keep their shapes)
_SEQUENCE_ROWS = (
    "encoded", "ln1", "ln1_mean", "ln1_rstd", "res2", "ln2", "ln2_mean", "ln2_rstd", "res3",
    "lnf_mean", "lnf_rstd", "dres",
)  # fmt: skip


def sequence_shapes(
    cfg: GPT2Config, B: int, T: int, tp: int, packed: bool = False
) -> dict[str, tuple[int, ...]]:
    """``gpt2.activation_shapes`` of a shard with sequence parallelism: the residual stream,
    the LayerNorms' outputs and statistics and the residual gradient hold N / tp rows;
    ``lnf`` stays whole (ln_f's output gathered for the LM head and its backward), ``dln``
    too (a split layer's partial sums before the reduce-scatter), and one (N, C) buffer,
    ``gathered``, receives each all-gather in turn. ``packed``: the ``PACKED`` tensors are
    float32 working copies of ``working_copies`` blocks (all blocks are in the uint16 store
    of ``sequence_saved_shapes``)."""
    shapes = _sequence_shapes(cfg, B, T, tp)
    if packed:
        shapes.update({n: (working_copies(cfg, n), *shapes[n][1:]) for n in PACKED})
    return shapes


def sequence_saved_shapes(cfg: GPT2Config, B: int, T: int, tp: int) -> dict[str, tuple[int, ...]]:
    """The uint16 store of mixed precision with sequence parallelism: every block's
    ``PACKED`` tensors, the residual stream's on this rank's rows."""
    shapes = _sequence_shapes(cfg, B, T, tp)
    return {name: shapes[name] for name in PACKED}


def _sequence_shapes(cfg: GPT2Config, B: int, T: int, tp: int) -> dict[str, tuple[int, ...]]:
    shapes = activation_shapes(cfg, B, T, tp)
    rows = B * T // tp
    for name in _SEQUENCE_ROWS:
        shape = shapes[name]
        if name == "encoded":
            shapes[name] = (rows, shape[-1])
        elif len(shape) == 3 or (len(shape) == 2 and name.startswith(("ln1_", "ln2_"))):
            shapes[name] = (shape[0], rows, *shape[2:])  # per layer
        else:
            shapes[name] = (rows, *shape[1:])
    shapes["gathered"] = (B * T, cfg.n_embd)
    return shapes


def sequence_layout(
    cfg: GPT2Config, batch_size: int, tp: int, packed: bool = False
) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total elements), as ``gpt2.arena_layout``."""
    shapes = sequence_shapes(cfg, batch_size, cfg.block_size, tp, packed)
    return aligned_layout({n: math.prod(s) for n, s in shapes.items()}, ARENA_ALIGN)


def sequence_store_layout(cfg: GPT2Config, batch_size: int, tp: int) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total uint16 words) of the sequence-parallel 16-bit store."""
    shapes = sequence_saved_shapes(cfg, batch_size, cfg.block_size, tp)
    return aligned_layout({n: math.prod(s) for n, s in shapes.items()}, ARENA_ALIGN)


def position_runs(first: int, rows: int, T: int) -> list[tuple[int, int, int]]:
    """Rows [first, first + rows) of the (B, T) order as (row lo, row hi, position of lo)
    runs of consecutive positions, rows relative to ``first``: one per sequence touched."""
    runs, r = [], 0
    while r < rows:
        pos = (first + r) % T
        n = min(rows - r, T - pos)
        runs.append((r, r + n, pos))
        r += n
    return runs


class _SequenceViews(_Views):
    """``gpt2._Views`` of a sequence-parallel shard: the same names, the residual-stream
    tensors ``rows`` tall (this rank's block ``self.rows`` of the N token rows)."""

    def __init__(
        self,
        arena: np.ndarray,
        cfg: GPT2Config,
        B: int,
        T: int,
        offsets,
        tp,
        rank,
        store: tuple[np.ndarray, dict[str, int], int] | None = None,
    ):
        """``store``: mixed precision's (uint16 store, its offsets, half format); the
        arena then holds ``working_copies`` blocks of the ``PACKED`` tensors."""
        shapes = sequence_shapes(cfg, B, T, tp, packed=store is not None)
        saved = sequence_saved_shapes(cfg, B, T, tp)
        v = self._bind(arena, cfg, B, T, tp, offsets, shapes, saved, store)
        self.layer_in = [self.encoded] + self.res3[: cfg.n_layer - 1]
        self.gathered = v["gathered"]
        # this rank's rows, the collectives' blocks (elements) and the rows' positions
        rows = B * T // tp
        self.rows = slice(rank * rows, (rank + 1) * rows)
        self.bounds = cfg.n_embd * rows * np.arange(tp + 1)
        self.runs = position_runs(rank * rows, rows, T)


def kernel_costs(
    cfg: GPT2Config, tp: int, B: int, T: int, sequence_parallel: bool = False
) -> list[KernelCost]:
    """The shard's kernel calls (``gpt2_costs`` on its shapes): heads, MLP columns and
    vocabulary divided by ``tp``; LayerNorms, embedding and residual adds whole, or with
    ``sequence_parallel`` on the rank's N / tp rows, plus the copies of a shard into the
    all-gather buffer (``.stage``) and of a reduce-scatter's block into the residual
    stream (``.unstage``)."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size // tp
    NH, hs, N = cfg.n_head // tp, cfg.head_size, B * T
    Cs, Fs = C // tp, 4 * C // tp
    R = N // tp if sequence_parallel else N  # rows of the residual stream and LayerNorms
    lin, att, ln = gpt2_costs._linear, gpt2_costs._attention, gpt2_costs._layernorm
    f, b = "forward", "backward"

    def stage(name: str, phase: str) -> list[KernelCost]:
        return [vector(name + ".stage", 0, 2 * R * C, phase)] if sequence_parallel else []

    if sequence_parallel:  # the N tokens' owned rows looked up, then + wpe on the R rows
        embed = vector("embedding", R * C, 2 * N * C + N + 3 * R * C, f)
    else:
        embed = vector("embedding", N * C, 2 * N * C + T * C + N, f)
    out: list[KernelCost] = [vector("tokens.copy", 0, 4 * N, f), embed, _layernorm_first(R, C)]
    for i in range(L):
        h = f"h.{i}."
        out += stage(h + "ln_1", f)
        out += lin(h + "attn.c_attn", N, C, 3 * Cs, f)
        out += att(h + "attn", B, T, NH, hs, f)
        out += lin(h + "attn.c_proj", N, Cs, C, f)
        out.append(ln(h + "ln_2", R, C, f, fused_add=True))
        out += stage(h + "ln_2", f)
        out += lin(h + "mlp.c_fc", N, C, Fs, f)
        out.append(vector(h + "mlp.gelu", gpt2_costs.GELU_FWD * N * Fs, 2 * N * Fs, f))
        out += lin(h + "mlp.c_proj", N, Fs, C, f)
        if sequence_parallel:
            out.append(vector(h + "mlp.c_proj.unstage", 0, 2 * R * C, f))
        nxt = f"h.{i + 1}.ln_1" if i + 1 < L else "ln_f"
        out.append(ln(nxt, R, C, f, fused_add=True))
    out.append(gemm("lm_head", N, C, V, f, layout="nt"))
    exp = gpt2_costs.EXP
    # the shard's row max and sum are serial, as in the whole model's loss
    out.append(vector("softmax_ce", (exp + 4) * N * V, 2 * N * V + 6 * N, f, serial=2 * N * V))
    out.append(vector("softmax_ce.bwd", N * V, 2 * N * V + N, b))
    out.append(gemm("lm_head.dinput", N, V, C, b))
    out.append(gemm("lm_head.dwte", V, N, C, b, layout="tn"))
    out.append(ln("ln_f.bwd", R, C, b)._replace(done=("ln_f.weight", "ln_f.bias")))
    for i in range(L - 1, -1, -1):
        h = f"h.{i}."
        out += stage(h + "mlp.c_proj.dout", b)
        out += lin(h + "mlp.c_proj", N, Fs, C, b)
        out.append(vector(h + "mlp.gelu.bwd", gpt2_costs.GELU_BWD * N * Fs, 3 * N * Fs, b))
        out += stage(h + "ln_2", b)
        out += lin(h + "mlp.c_fc", N, C, Fs, b)
        out.append(ln(h + "ln_2.bwd", R, C, b, fused_add=True))
        out += stage(h + "attn.c_proj.dout", b)
        out += lin(h + "attn.c_proj", N, Cs, C, b)
        out += att(h + "attn", B, T, NH, hs, b)
        out += stage(h + "ln_1", b)
        out += lin(h + "attn.c_attn", N, C, 3 * Cs, b)
        names = tuple(f"{h}{p}" for p in gpt2_costs.LAYER_PARAMS)
        out.append(ln(h + "ln_1.bwd", R, C, b, fused_add=True)._replace(done=names))
    out.append(vector("wpe.grad.zero", 0, cfg.block_size * C, b))
    out += stage("embedding.dout", b)
    done = ("wte.weight", "wpe.weight")
    if sequence_parallel:  # wpe's gradient from the R rows, wte's from the gathered N
        bwd = vector("embedding.bwd", R * C + N * C, 2 * R * C + 2 * N * C + 2 * T * C, b)
    else:
        bwd = vector("embedding.bwd", 2 * N * C, 3 * N * C + 2 * T * C, b)
    out.append(bwd._replace(done=done))
    return out


def stage_collectives(
    cfg: GPT2Config, tp: int, B: int, T: int, sequence_parallel: bool = False
) -> dict[str, list[list[tuple[str, int, bool]]]]:
    """Phase -> per model stage (embedding, blocks, head: ``stages()``'s order) the group's
    collective calls of one micro-batch, in the order ``GPT2TP`` issues them: (op, elements
    of the buffer, whether it carries activations: on a half wire in mixed precision, the
    cross-entropy's float32). Forward: the vocab-parallel embedding's sum, each block's two
    row-parallel sums (g), then the cross-entropy's row maxima (all-gathered, ``tp`` N
    values) and its sums of exponentials and target logits (2 N). Backward: the LM head's
    input gradient and each block's two column-parallel input gradients (f). With
    ``sequence_parallel`` every sum of N C is a reduce-scatter and every f an all-gather
    (``_forward_stage_sequence`` / ``_backward_stage_sequence``): forward, the embedding's
    reduce-scatter, per block all-gather, reduce-scatter (twice), ln_f's all-gather;
    backward, the head's reduce-scatter, per block the residual gradient's all-gather,
    ln_2's output gathered again, the reduce-scatter (twice: ln_1 too), and the
    embedding's all-gather. A pipeline stage issues the calls of its model stages."""
    N, C, L = B * T, cfg.n_embd, cfg.n_layer
    ce = [("allgather", tp * N, False), ("allreduce", 2 * N, False)]
    if not sequence_parallel:
        ar = ("allreduce", N * C, True)
        return {
            "forward": [[ar], *[[ar, ar]] * L, ce],
            "backward": [[], *[[ar, ar]] * L, [ar]],
        }
    ag, rs = ("allgather", N * C, True), ("reduce_scatter", N * C, True)
    return {
        "forward": [[rs], *[[ag, rs, ag, rs]] * L, [ag, *ce]],
        "backward": [[ag], *[[ag, ag, rs, ag, ag, rs]] * L, [rs]],
    }


def group_collectives(
    cfg: GPT2Config, tp: int, B: int, T: int, sequence_parallel: bool = False
) -> list[tuple[str, str, int, bool]]:
    """The group's collective calls of one micro-batch in issue order, (phase, op,
    elements, activation): ``stage_collectives``' forward stages first to last, then its
    backward stages last to first. Plan mode writes a weight-mode step down from this list
    (``simdist.sim.tp_schedule``); ``tests/test_simulate.py`` checks it against what a run
    records."""
    calls = stage_collectives(cfg, tp, B, T, sequence_parallel)
    fwd = [("forward", *c) for stage in calls["forward"] for c in stage]
    return fwd + [("backward", *c) for stage in calls["backward"][::-1] for c in stage]


def _layernorm_first(N: int, C: int) -> KernelCost:
    return gpt2_costs._layernorm("h.0.ln_1", N, C, "forward")


class GPT2TP(GPT2):
    """Rank ``rank``'s shard of GPT-2 in a tensor-parallel group of ``tp`` ranks. The
    group's collectives (``simdist.comm.Collectives`` over the group) come through
    ``bind(coll)`` before the first forward; the parameters it reads are the shard's
    (``shard_specs``), initialised as one rank initialises the whole model.
    ``sequence_parallel``: the residual stream and LayerNorms on this rank's N / tp token
    rows (module docstring)."""

    def __init__(self, config: GPT2Config, tp: int, rank: int, sequence_parallel: bool = False):
        check_split(config, tp, sequence_parallel=sequence_parallel)
        super().__init__(config)
        self.tp, self.rank = tp, rank
        self.sequence_parallel = sequence_parallel
        self.index = shard_index(config, tp, rank)
        Vs = config.vocab_size // tp
        self.vocab = (rank * Vs, (rank + 1) * Vs)  # this rank's rows of wte
        # row-parallel biases are added once (rank 0): the others add zeros
        self._zero_bias = np.zeros(config.n_embd, F32)
        self.coll: Any = None
        self._scratch: dict[str, np.ndarray] = {}
        self._wire = 0  # the activation collectives' format (set_precision; 0: float32)

    def set_precision(self, precision) -> None:
        """``GPT2.set_precision`` (every activation and activation gradient stored in the
        half format), and the group's activation collectives on a half wire. Megatron-LM
        runs its f / g collectives (``reduce_from_tensor_model_parallel_region``, the
        sequence-parallel all-gathers and reduce-scatters) on the bf16 / fp16 tensors the
        GEMMs wrote: NCCL moves 16-bit words and sums in the half format. simdist does the
        same: the row-parallel partial sums are stored half where the GEMM writes them and
        reduced with every partial sum rounded (``Collectives.half_wire``). The
        vocab-parallel cross-entropy's sums stay float32, as Megatron's (it upcasts the
        logits, ``fp16_lm_cross_entropy`` off), and as the one-rank loss reads them."""
        super().set_precision(precision)
        self._wire = precision.fmt if precision.half is not None else 0

    def bind(self, coll) -> None:
        """The tensor-parallel group's collectives (ranks in group order)."""
        self.coll = coll

    # -------------------------------------------------------------- sizes
    def parameter_specs(self) -> list[ParamSpec]:
        return shard_specs(self.config, self.tp)

    def num_parameters(self) -> int:
        return sum(s.numel for s in self.parameter_specs())

    def kernel_costs(self, batch: int, seq: int | None = None) -> list[KernelCost]:
        T = seq or self.config.block_size
        return kernel_costs(self.config, self.tp, batch, T, self.sequence_parallel)

    def activation_bytes(self, batch_size: int) -> int:
        if not self.sequence_parallel:
            return super().activation_bytes(batch_size)
        return 4 * sequence_layout(self.config, batch_size, self.tp)[1]

    # mixed precision: the shard's saved activations as 16-bit words (``PacksSavedActivations``),
    # packed and unpacked where the one-rank GPT-2 does it, in GPT-2's layout at the shard's
    # width or, with sequence parallelism, in its own
    def _arena_layout(self, batch_size: int, packed: bool) -> tuple[dict[str, int], int]:
        if not self.sequence_parallel:
            return super()._arena_layout(batch_size, packed)
        return sequence_layout(self.config, batch_size, self.tp, packed)

    def _store_layout(self, batch_size: int) -> tuple[dict[str, int], int]:
        if not self.sequence_parallel:
            return super()._store_layout(batch_size)
        return sequence_store_layout(self.config, batch_size, self.tp)

    def sequence_parallel_names(self) -> list[str]:
        """The replicated parameters whose gradients each rank computes from its rows only
        (LayerNorms, ``wpe``): the schedule sums them over the group once per step. Empty
        without sequence parallelism."""
        if not self.sequence_parallel:
            return []
        norms = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight", "ln_f.bias")
        return [n for n in self.index if n.endswith(norms) or n == "wpe.weight"]

    def init_parameters(self, params, rng: np.random.Generator) -> None:
        """The whole model's initialisation (the same draws as one rank), then this
        rank's slice of it: a tensor-parallel run starts where a one-rank run starts."""
        full = {s.name: np.empty(s.shape, F32) for s in parameter_specs(self.config)}
        GPT2.init_parameters(self, full, rng)
        for name, split in self.index.items():
            params[name][...] = extract(full[name], split)

    def allocate(self, batch_size: int) -> None:
        super().allocate(batch_size)  # the arena of ``_arena_layout``
        N, C = batch_size * self.config.block_size, self.config.n_embd
        self._scratch = {
            "max": np.zeros(self.tp * N, F32),  # every rank's row maxima
            "sums": np.zeros(2 * N, F32),  # sum of exponentials, target logit
            "argmax": np.zeros(2 * self.tp * N, F32),  # eval: (max, index) per rank
            "mask": np.zeros(N, bool),
            "local": np.zeros(N, np.int64),
            "zero_rows": np.zeros((0, C), F32),
        }

    def _views_for(self, B: int, T: int):
        if not self.sequence_parallel:
            return super()._views_for(B, T)
        if self._arena is None:
            raise ValueError("call allocate(batch_size) before forward/evaluate")
        if B > self._batch or T > self.config.block_size or T % self.tp:
            raise ValueError(
                f"batch ({B}, {T}): sequence parallelism needs at most ({self._batch}, "
                f"{self.config.block_size}) and the length divisible by {self.tp}"
            )
        if (B, T) not in self._views:
            self._views[(B, T)] = _SequenceViews(
                self._arena, self.config, B, T, self._offsets, self.tp, self.rank, self._store_of()
            )
        return self._views[(B, T)]

    # -------------------------------------------------------------- the group's sums
    def _allreduce(self, buf: np.ndarray) -> None:
        """An activation (or activation gradient) summed over the group: f or g."""
        with self.coll.half_wire(self._wire):
            self.coll.allreduce(buf.reshape(-1))

    def _reduce_scatter(self, v) -> np.ndarray:
        """Sequence parallelism's g: the partial sums in ``v.dln`` (N, C) summed over the
        group; returns this rank's rows of the sum (a view of ``v.dln``)."""
        with self.coll.half_wire(self._wire):
            mine = self.coll.reduce_scatter(v.dln.reshape(-1), bounds=v.bounds)
        return mine.reshape(-1, self.config.n_embd)

    def _all_gather(self, v, rows: np.ndarray) -> np.ndarray:
        """Sequence parallelism's f: every rank's ``rows`` concatenated in ``v.gathered``."""
        np.copyto(v.gathered[v.rows], rows)
        with self.coll.half_wire(self._wire):  # half values: exact in 16-bit words
            self.coll.allgather(v.gathered.reshape(-1), bounds=v.bounds)
        return v.gathered

    def _row_bias(self, bias: np.ndarray) -> np.ndarray:
        """A row-parallel GEMM's bias: added once, by rank 0, before the group's sum."""
        return bias if self.rank == 0 else self._zero_bias

    def _heads(self) -> int:
        return self.config.n_head // self.tp

    def _g(self, buf: np.ndarray) -> None:
        self._allreduce(buf)  # the row-parallel partial sums, in half where stored half

    def _f_backward(self, buf: np.ndarray) -> None:
        self._allreduce(buf)  # the partial input gradients, in half where stored half

    def _local_tokens(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(this rank's row of each token, 0 where not owned; owned mask), flat."""
        n = tokens.size
        mask, local = self._scratch["mask"][:n], self._scratch["local"][:n]
        lo, hi = self.vocab
        np.subtract(tokens.reshape(-1), lo, out=local)
        np.logical_and(local >= 0, local < hi - lo, out=mask)
        local[~mask] = 0
        return local, mask

    # -------------------------------------------------------------- forward
    def _forward_stage(self, v, k: int, params) -> None:
        if self.sequence_parallel:
            self._forward_stage_sequence(v, k, params)
        else:
            super()._forward_stage(v, k, params)

    def _embed_forward(self, v, params) -> None:
        """Vocab-parallel embedding: own rows, zeros elsewhere, summed; + wpe."""
        local, mask = self._local_tokens(v.tokens)
        # local is in range: "clip" only stops take buffering out (simdist.data.datasets)
        np.take(params["wte.weight"], local, axis=0, out=v.encoded2, mode="clip")
        v.encoded2[~mask] = 0.0
        self._allreduce(v.encoded)  # one half row and zeros: exact
        v.encoded += params["wpe.weight"][: v.T]
        self._store(v.encoded)  # wte + wpe rounded once, as embedding_forward's

    def _loss(self, v) -> None:
        self._cross_entropy(v)  # over this vocabulary's logits

    def _forward_stage_sequence(self, v: _SequenceViews, k: int, params) -> None:
        """``_forward_stage`` with sequence parallelism: the residual stream, the residual
        adds and the LayerNorms on this rank's rows; all-gathers before the
        column-parallel layers, reduce-scatters after the row-parallel ones."""
        cfg = self.config
        L = cfg.n_layer
        st = self._store
        if k == 0:  # the owned rows summed by a reduce-scatter; + wpe on this rank's rows
            local, mask = self._local_tokens(v.tokens)
            np.take(params["wte.weight"], local, axis=0, out=v.dln, mode="clip")
            v.dln[~mask] = 0.0
            mine, wpe = self._reduce_scatter(v), params["wpe.weight"]
            for lo, hi, pos in v.runs:
                np.add(mine[lo:hi], wpe[pos : pos + hi - lo], out=v.encoded[lo:hi])
            st(v.encoded)
            return
        if k == L + 1:  # ln_f on this rank's rows, straight into the gather buffer
            lnf = params["ln_f.weight"], params["ln_f.bias"]
            close_block(v, L - 1, (v.lnf[v.rows], v.lnf_mean, v.lnf_rstd), lnf, st)  # now final
            with self.coll.half_wire(self._wire):
                self.coll.allgather(v.lnf.reshape(-1), bounds=v.bounds)
            lm_head_forward(v.logits, v.lnf, params["wte.weight"])
            st(v.logits)
            self._cross_entropy(v)
            return
        i = k - 1
        ln1w, ln1b, attnw, attnb, aprojw, aprojb, ln2w, ln2b, fcw, fcb, mprojw, mprojb = (
            self._layer_names[i]
        )
        open_block(v, i, v.encoded, (params[ln1w], params[ln1b]), st)
        full = self._all_gather(v, v.ln1[i])  # f
        linear_forward(v.qkv2[i], full, params[attnw], params[attnb])
        st(v.qkv2[i])
        attention_forward(v.atty[i], v.att[i], v.qkv[i], cfg.n_head // self.tp)
        st(v.atty[i])
        linear_forward(v.dln, v.atty2[i], params[aprojw], self._row_bias(params[aprojb]))
        st(v.dln)  # the GEMM's half output, reduce-scattered in half (g)
        mid_block(v, i, self._reduce_scatter(v), (params[ln2w], params[ln2b]), st)  # g
        full = self._all_gather(v, v.ln2[i])  # f
        linear_forward(v.fch[i], full, params[fcw], params[fcb])
        st(v.fch[i])
        gelu_forward(v.fch_gelu1[i], v.fch1[i])
        st(v.fch_gelu[i])
        linear_forward(v.dln, v.fch_gelu[i], params[mprojw], self._row_bias(params[mprojb]))
        st(v.dln)
        np.copyto(v.res3[i], self._reduce_scatter(v))  # g; the next stage adds the residual
        v.pack(i, OWN_PACKED)  # before block i + 2 reuses the working copies

    def _cross_entropy(self, v) -> None:
        """Vocab-parallel softmax cross-entropy: per row the maximum over every rank's
        logits (all-gathered), the sum of exponentials and the target's logit (its owner
        contributes it, the others 0) summed over the group; ``probs`` keeps this rank's
        columns of the softmax, ``losses`` the whole loss, the same bits on every rank."""
        N = v.logits.shape[0]
        tp, r = self.tp, self.rank
        maxima = self._scratch["max"][: tp * N].reshape(tp, N)
        np.max(v.logits, axis=1, out=maxima[r])
        self.coll.allgather(maxima.reshape(-1))
        row_max = maxima.max(axis=0)  # a maximum is exact: the whole row's
        sums = self._scratch["sums"][: 2 * N].reshape(2, N)
        vocab_softmax_partial(v.probs, sums[0], v.logits, row_max)
        local, mask = self._local_tokens(v.targets)
        sums[1] = np.where(mask, v.logits[np.arange(N), local], F32(0.0))
        # sums of exponentials; the target's logit from its owner: float32 in every precision
        self.coll.allreduce(sums.reshape(-1))
        vocab_softmax_finish(v.losses, v.probs, sums[0], sums[1], row_max)

    def eval_stats(self) -> tuple[float, int]:
        """(sum of the token losses, correct argmax predictions): the argmax over every
        rank's vocabulary (the first maximum, as one rank's argmax takes it)."""
        v = self._current
        if v is None:
            raise RuntimeError("eval_stats without a forward")
        N, tp, r = v.logits.shape[0], self.tp, self.rank
        best = self._scratch["argmax"][: 2 * tp * N].reshape(tp, 2, N)
        np.max(v.logits, axis=1, out=best[r, 0])
        best[r, 1] = v.logits.argmax(axis=1) + self.vocab[0]  # < 2^24: exact in float32
        self.coll.allgather(best.reshape(-1))
        winner = best[:, 0].argmax(axis=0)  # first rank with the maximum: lowest index
        pred = best[winner, 1, np.arange(N)].astype(np.int64)
        loss_sum = float(v.losses.sum(dtype=np.float64))
        return loss_sum, int(np.count_nonzero(pred == v.targets_flat))

    # -------------------------------------------------------------- backward
    def _backward_stage(self, v, k: int, params, grads, dloss: float) -> None:
        if self.sequence_parallel:
            self._backward_stage_sequence(v, k, params, grads, dloss)
        else:
            super()._backward_stage(v, k, params, grads, dloss)

    def _lnf_output_gradient(self, v) -> np.ndarray:
        if self.sequence_parallel:  # this rank's rows of the sum (g's backward)
            return self._reduce_scatter(v)
        return super()._lnf_output_gradient(v)

    def _logit_gradient(self, v, dloss: float) -> np.ndarray:
        """probs - onehot(own targets), scaled: this vocabulary's logits' gradient."""
        d = F32(dloss / v.T)
        dlogits = v.probs
        local, mask = self._local_tokens(v.targets)
        rows = np.nonzero(mask)[0]
        dlogits[rows, local[rows]] -= F32(1.0)
        dlogits *= d
        return dlogits

    def _embed_backward(self, v, grads) -> None:
        """The owned tokens' rows of wte; wpe whole (dres is the same everywhere)."""
        dwpe = grads["wpe.weight"]
        dwpe.fill(0.0)
        np.sum(v.dres3, axis=0, out=dwpe[: v.T])
        local, mask = self._local_tokens(v.tokens)
        np.add.at(grads["wte.weight"], local[mask], v.dres[mask])
        grads.done(("wte.weight", "wpe.weight"))

    def _backward_stage_sequence(self, v: _SequenceViews, k: int, params, grads, dloss) -> None:
        """``backward_stage`` with sequence parallelism: each all-gather of the forward is a
        reduce-scatter here and each reduce-scatter an all-gather; the LayerNorm outputs
        are gathered again for the column-parallel weight gradients. The LayerNorms' and
        wpe's gradients are this rank's rows' share (the schedule sums them)."""
        L = self.config.n_layer
        st = self._store
        if k == L + 1:  # ln_f's output gradient reduce-scattered to this rank's rows
            self._head_backward(v, params, grads, dloss)
            return
        if k == 0:  # wpe from this rank's rows; wte's owned rows from every row (gathered)
            dwpe = grads["wpe.weight"]
            dwpe.fill(0.0)
            for lo, hi, pos in v.runs:
                dwpe[pos : pos + hi - lo] += v.dres[lo:hi]
            full = self._all_gather(v, v.dres)
            local, mask = self._local_tokens(v.tokens)
            np.add.at(grads["wte.weight"], local[mask], full[mask])
            grads.done(("wte.weight", "wpe.weight"))
            return
        i = k - 1
        ln1w, ln1b, attnw, attnb, aprojw, aprojb, ln2w, ln2b, fcw, fcb, mprojw, mprojb = (
            self._layer_names[i]
        )
        nh = self.config.n_head // self.tp
        v.unpack(i, OWN_PACKED)
        if i > 0:
            v.unpack(i - 1, ("res3",))  # block i's input (layer_in)
        full = self._all_gather(v, v.dres)  # g's backward
        linear_backward(v.dfch_gelu, grads[mprojw], grads[mprojb], full, v.fch_gelu[i],
                        params[mprojw])  # fmt: skip
        st(v.dfch_gelu)
        gelu_backward(v.dfch1, v.fch1[i], v.dfch_gelu1)
        st(v.dfch)
        full = self._all_gather(v, v.ln2[i])  # c_fc's input again, for its weight gradient
        linear_backward(v.dln, grads[fcw], grads[fcb], v.dfch, full, params[fcw])
        st(v.dln)
        layernorm_backward_accumulate(
            v.dres,
            grads[ln2w],
            grads[ln2b],
            self._reduce_scatter(v),  # f's backward
            v.res2[i],
            params[ln2w],
            v.ln2_mean[i],
            v.ln2_rstd[i],
        )
        st(v.dres)
        full = self._all_gather(v, v.dres)
        linear_backward(v.datty2, grads[aprojw], grads[aprojb], full, v.atty2[i], params[aprojw])
        st(v.datty2)
        attention_backward(v.dqkv, v.datty, v.qkv[i], v.att[i], v.att_dscores, nh)
        st(v.dqkv)
        full = self._all_gather(v, v.ln1[i])
        linear_backward(v.dln, grads[attnw], grads[attnb], v.dqkv2, full, params[attnw])
        st(v.dln)
        layernorm_backward_accumulate(
            v.dres,
            grads[ln1w],
            grads[ln1b],
            self._reduce_scatter(v),
            v.layer_in[i],
            params[ln1w],
            v.ln1_mean[i],
            v.ln1_rstd[i],
        )
        st(v.dres)
        grads.done(self._layer_names[i])
