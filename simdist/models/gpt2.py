"""GPT-2 (Radford et al. 2019) on simdist's numba kernels, llm.c-style.

What this file is: the configuration (with presets from gpt2-mini to gpt2-xl), the parameter
list in Hugging Face's GPT-2 state-dict names and layouts, the activation arena, and the
forward/backward passes as a sequence of kernel calls. What it is not: the kernels
(``kernels/``) or the optimizer (AdamW on the flat buffer, elsewhere).

Conventions:
- inputs ``tokens`` and ``targets`` are (B, T) integers, T <= block_size; the loss is the
  mean over the B*T next-token predictions. A *sample* is one sequence: its loss is the
  mean over its T tokens, so ``backward(dloss)`` (dloss scales per-sample losses, 1/B for
  a mean over the micro-batch) scales each token's loss by dloss / T.
- parameter names and shapes follow the Hugging Face GPT-2 state dict (``GPT2Model``, no
  ``transformer.`` prefix): linear weights are (in, out) like its Conv1D, and the LM head
  is tied to ``wte.weight`` (so it has no parameter of its own).
- weight decay follows nanoGPT: every tensor with ndim >= 2 decays (all matrices AND both
  embeddings, wte doubling as the LM head); biases and layernorm gains/offsets do not.
- initialisation follows GPT-2 / nanoGPT: normal(0, 0.02) for matrices and embeddings,
  normal(0, 0.02 / sqrt(2 * n_layer)) for the two residual projections (``c_proj``),
  zero biases, layernorm weight 1 and bias 0.
- every activation, saved statistic, gradient-of-activation buffer and scratch lives in
  ONE float32 arena allocated by ``allocate(batch_size)``; the int32 token/target copies are
  carved from it too (same 4-byte element), so ``activation_bytes`` is its exact size.
- in mixed precision (``set_precision``) the blocks' activations that backward reads are
  held between forward and backward as 16-bit words, as the device holds them: each block
  computes in float32 working copies (``working_copies``: one block's, two of the residual
  stream, since block i reads block i - 1's res2 and res3) and its tensors are packed into
  a uint16 store once final (exact: they hold half values), then unpacked before its
  backward. ``host_activation_bytes`` is the host's arena plus store; ``activation_bytes``
  stays the device's layout in float32 words.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from simdist.config import ConfigError
from simdist.kernels.attention import attention_backward, attention_forward
from simdist.kernels.embedding import embedding_backward_accumulate, embedding_forward
from simdist.kernels.gelu import gelu_backward, gelu_forward
from simdist.kernels.layernorm import (
    layernorm_backward,
    layernorm_backward_accumulate,
    layernorm_forward,
    residual_layernorm_forward,
)
from simdist.kernels.linear import (
    linear_backward,
    linear_forward,
    linear_gelu_backward,
    linear_gelu_forward,
)
from simdist.kernels.loss import (
    mean_loss,
    softmax_cross_entropy_backward,
    softmax_cross_entropy_forward,
)
from simdist.kernels.matmul import lm_head_backward, lm_head_forward
from simdist.precision import no_store

from . import gpt2_costs
from .base import GradientGroup, KernelCost, ParamSpec
from .presets import resolve_preset
from .saved_words import PacksSavedActivations, SavedWords, SavedWordsViews, aligned_layout
from .stages import Stage, StagedModel

F32 = np.float32


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int  # longest sequence (rows of wpe)
    vocab_size: int

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head "
                f"({self.n_head}): each head gets n_embd / n_head columns"
            )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


PRESETS: dict[str, GPT2Config] = {
    # small enough for tests and single-core benchmarks (3.26M parameters, byte vocabulary)
    "gpt2-mini": GPT2Config(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=256),
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257),
    "gpt2-medium": GPT2Config(
        n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50257
    ),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50257),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=50257),
}


def resolve_config(preset: str | None = None, **overrides: int | None) -> GPT2Config:
    """A preset with some fields replaced (None = keep); without a preset all are needed."""
    fields = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
    presets = {name: asdict(c) for name, c in PRESETS.items()}
    return GPT2Config(**resolve_preset("GPT-2", presets, fields, fields, preset, overrides))


def build_gpt2(config) -> GPT2:
    """From params.yaml's model section (``simdist.config.GPT2ModelConfig``)."""
    cfg = resolve_config(
        config.preset,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        block_size=config.block_size,
        vocab_size=config.vocab_size,
    )
    return GPT2(cfg)


# ------------------------------------------------------------------ sizes without allocating
def parameter_specs(cfg: GPT2Config) -> list[ParamSpec]:
    """Hugging Face GPT-2 state-dict order, names and shapes; decay iff ndim >= 2."""
    C, V, T = cfg.n_embd, cfg.vocab_size, cfg.block_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (V, C)), ("wpe.weight", (T, C))]
    for i in range(cfg.n_layer):
        h = f"h.{i}."
        shapes += [
            (h + "ln_1.weight", (C,)),
            (h + "ln_1.bias", (C,)),
            (h + "attn.c_attn.weight", (C, 3 * C)),
            (h + "attn.c_attn.bias", (3 * C,)),
            (h + "attn.c_proj.weight", (C, C)),
            (h + "attn.c_proj.bias", (C,)),
            (h + "ln_2.weight", (C,)),
            (h + "ln_2.bias", (C,)),
            (h + "mlp.c_fc.weight", (C, 4 * C)),
            (h + "mlp.c_fc.bias", (4 * C,)),
            (h + "mlp.c_proj.weight", (4 * C, C)),
            (h + "mlp.c_proj.bias", (C,)),
        ]
    shapes += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    return [ParamSpec(name, shape, len(shape) >= 2) for name, shape in shapes]


def num_parameters(cfg: GPT2Config) -> int:
    """V*C + T*C + L*(12 C^2 + 13 C) + 2 C (124,439,808 for gpt2)."""
    C, L = cfg.n_embd, cfg.n_layer
    return cfg.vocab_size * C + cfg.block_size * C + L * (12 * C * C + 13 * C) + 2 * C


# a block's tensors that backward reads, held as 16-bit words in mixed precision (``_Views``):
# its own (final when the block ends) and its output res3 (final once the next block or the
# head has added the residual into it)
OWN_PACKED = ("ln1", "qkv", "atty", "res2", "ln2", "fch", "fch_gelu")
PACKED = (*OWN_PACKED, "res3")


def activation_shapes(
    cfg: GPT2Config, B: int, T: int, tp: int = 1, packed: bool = False
) -> dict[str, tuple[int, ...]]:
    """Every tensor of the arena for micro-batch B and sequence length T, in arena order.

    ``tp``: the shard of one tensor-parallel rank (``gpt2_tp``): its heads, MLP columns and
    vocabulary rows are 1/tp of the model's; the residual stream stays whole. ``packed``:
    the ``PACKED`` tensors are float32 working copies of ``working_copies`` blocks, not of
    every block (their L blocks are in the uint16 store of ``saved_shapes``)."""
    C, L, NH, V = cfg.n_embd, cfg.n_layer, cfg.n_head // tp, cfg.vocab_size // tp
    Cs = C // tp  # the shard's attention width (its heads x head size)
    N = B * T
    shapes = {
        # int32, stored in the float32 arena (same element size)
        "tokens": (B, T),
        "targets": (B, T),
        # saved by forward for backward, llm.c's ActivationTensors
        "encoded": (B, T, C),  # wte[tokens] + wpe: the residual stream entering layer 0
        "ln1": (L, N, C),
        "ln1_mean": (L, N),
        "ln1_rstd": (L, N),
        "qkv": (L, B, T, 3 * Cs),
        "atty": (L, B, T, Cs),  # attention output before c_proj
        "att": (L, B, NH, T, T),  # softmax probabilities
        "res2": (L, N, C),  # residual stream after the attention block
        "ln2": (L, N, C),
        "ln2_mean": (L, N),
        "ln2_rstd": (L, N),
        "fch": (L, N, 4 * Cs),  # c_fc output, GELU input
        "fch_gelu": (L, N, 4 * Cs),
        "res3": (L, N, C),  # residual stream after the MLP block (= the layer's output)
        "lnf": (N, C),
        "lnf_mean": (N,),
        "lnf_rstd": (N,),
        "logits": (N, V),
        "probs": (N, V),  # softmax; backward overwrites it with dlogits
        "losses": (N,),
        # gradients of activations, reused by every layer in turn
        "dres": (N, C),  # gradient of the residual stream
        "dln": (N, C),  # gradient of a layernorm output
        "datty": (B, T, Cs),
        "dqkv": (B, T, 3 * Cs),
        "dfch_gelu": (N, 4 * Cs),
        # d fch: a buffer of its own because GELU's backward writing over its dout in place
        # stops LLVM's vectoriser (the overlap check fails) and ran 16x slower (measured)
        "dfch": (N, 4 * Cs),
        # attention backward's d scores of one (sequence, head)
        "att_dscores": (T, T),
    }
    if packed:
        shapes.update({name: (working_copies(cfg, name), *shapes[name][1:]) for name in PACKED})
    return shapes


def working_copies(cfg: GPT2Config, name: str) -> int:
    """Blocks of float32 working copies of a packed tensor: two of the residual stream
    (block i reads block i - 1's res2 and res3 while it writes its own), one of the rest."""
    return min(cfg.n_layer, 2 if name in ("res2", "res3") else 1)


def saved_shapes(cfg: GPT2Config, B: int, T: int, tp: int = 1) -> dict[str, tuple[int, ...]]:
    """The uint16 store of mixed precision: every block's ``PACKED`` tensors."""
    shapes = activation_shapes(cfg, B, T, tp)
    return {name: shapes[name] for name in PACKED}


ARENA_ALIGN = 16  # elements (64 bytes): every tensor starts on its own cache line


def arena_layout(
    cfg: GPT2Config, batch_size: int, tp: int = 1, packed: bool = False
) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total elements) of the arena for micro-batches of batch_size
    (``packed``: with float32 working copies of the packed tensors, ``activation_shapes``)."""
    return _layout(activation_shapes(cfg, batch_size, cfg.block_size, tp, packed))


def _layout(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, int], int]:
    return aligned_layout({name: math.prod(s) for name, s in shapes.items()}, ARENA_ALIGN)


def activation_bytes(cfg: GPT2Config, batch_size: int, tp: int = 1) -> int:
    """Bytes of the arena ``GPT2(cfg).allocate(batch_size)`` creates (nothing allocated)."""
    return 4 * arena_layout(cfg, batch_size, tp)[1]


def flops_per_sample(cfg: GPT2Config) -> int:
    """Forward + backward FLOPs of one sequence of block_size tokens (2 per multiply-add).

    Counts the matrix products only, as nanoGPT's MFU estimate (6 N + 12 L C T per token)
    does, with N the matrices' parameters: per token and layer, the forward does
    2 * 12 C^2 (c_attn 3C^2, attn c_proj C^2, c_fc 4C^2, mlp c_proj 4C^2) plus attention's
    q k^T and p v, 2 * 2 T C, counted dense T x T (causal masking makes half of it zeros);
    the LM head adds 2 C V. Backward does each product twice (input and weight gradient),
    so the total is 3x forward: T * (72 C^2 L + 12 T C L + 6 C V). Layernorm, GELU, softmax,
    embedding and the optimizer are not counted.
    """
    C, L, T, V = cfg.n_embd, cfg.n_layer, cfg.block_size, cfg.vocab_size
    return T * (72 * C * C * L + 12 * T * C * L + 6 * C * V)


def close_block(v, i: int, out: tuple, norm: tuple, st) -> None:
    """Block i's second residual add fused with the layernorm that follows it (the next
    block's ln_1, or ln_f): res3[i] = res2[i] + the MLP output already in res3[i], then
    ``out`` = (ln, mean, rstd) of it with ``norm`` = (weight, bias). Block i's output is
    then final: stored half (``st``; mixed precision) and packed where the arena keeps
    16-bit words. Shared by GPT-2 and its tensor-parallel shards (the same kernel calls)."""
    residual_layernorm_forward(v.res3[i], *out, v.res2[i], v.res3[i], *norm)
    st(v.res3[i], out[0])
    v.pack(i, ("res3",))


def open_block(v, i: int, first: np.ndarray, norm: tuple, st) -> None:
    """Block i's ln_1 with ``norm`` = (weight, bias): of the embeddings ``first`` for
    block 0, else fused with the residual add that closes block i - 1 (``close_block``)."""
    if i == 0:
        layernorm_forward(v.ln1[0], v.ln1_mean[0], v.ln1_rstd[0], first, *norm)
        st(v.ln1[0])
    else:
        close_block(v, i - 1, (v.ln1[i], v.ln1_mean[i], v.ln1_rstd[i]), norm, st)


def mid_block(v, i: int, branch: np.ndarray, norm: tuple, st) -> None:
    """Block i's first residual add fused with its ln_2 (``norm`` = (weight, bias)):
    res2[i] = block i's input + ``branch`` (the attention output, which may be res2[i]
    itself), ln2[i] = layernorm of it; both stored half (``st``; mixed precision). Shared by
    GPT-2 and its tensor-parallel shards (the same kernel calls)."""
    residual_layernorm_forward(
        v.res2[i], v.ln2[i], v.ln2_mean[i], v.ln2_rstd[i], v.layer_in[i], branch, *norm
    )
    st(v.res2[i], v.ln2[i])


# ------------------------------------------------------------------ the model
class _Views(SavedWordsViews):
    """Named views of the arena for one (B, T), per layer where the tensor is per layer."""

    def __init__(
        self,
        arena: np.ndarray,
        cfg: GPT2Config,
        B: int,
        T: int,
        offsets: dict,
        tp: int = 1,
        store: tuple[np.ndarray, dict[str, int], int] | None = None,
    ):
        """``store``: mixed precision's (uint16 store, its offsets, half format); the
        arena then holds ``working_copies`` blocks of the ``PACKED`` tensors."""
        shapes = activation_shapes(cfg, B, T, tp, packed=store is not None)
        self._bind(arena, cfg, B, T, tp, offsets, shapes, saved_shapes(cfg, B, T, tp), store)
        self.encoded2 = self.encoded.reshape(B * T, cfg.n_embd)
        self.layer_in = [self.encoded2] + self.res3[: cfg.n_layer - 1]  # each block's input
        self.dres3 = self.dres.reshape(B, T, cfg.n_embd)

    def _bind(self, arena, cfg: GPT2Config, B: int, T: int, tp: int, offsets, shapes, saved, store):
        """The named views of ``shapes`` (per-layer tensors as lists of per-layer views);
        with ``store``, the ``PACKED`` tensors' working copies over the 16-bit words."""
        self.B, self.T = B, T
        N = B * T
        Cs = cfg.n_embd // tp  # a tensor-parallel shard's attention width
        v = {}
        for name, shape in shapes.items():
            flat = arena[offsets[name] : offsets[name] + math.prod(shape)]
            if name in ("tokens", "targets"):
                flat = flat.view(np.int32)
            v[name] = flat.reshape(shape)
        self._words: SavedWords | None = None
        if store is not None:
            words, store_offsets, fmt = store
            self._words = SavedWords(words, store_offsets, saved, fmt)
            for name in PACKED:  # block i: working copy i % working_copies
                v[name] = self._words.working(name, v[name])
        self.tokens, self.targets = v["tokens"], v["targets"]
        self.targets_flat = self.targets.reshape(N)
        self.encoded = v["encoded"]
        self.ln1, self.ln1_mean, self.ln1_rstd = (
            list(v[k]) for k in ("ln1", "ln1_mean", "ln1_rstd")
        )
        self.ln2, self.ln2_mean, self.ln2_rstd = (
            list(v[k]) for k in ("ln2", "ln2_mean", "ln2_rstd")
        )
        self.att, self.res2, self.res3 = list(v["att"]), list(v["res2"]), list(v["res3"])
        self.fch, self.fch_gelu = list(v["fch"]), list(v["fch_gelu"])
        self.qkv = list(v["qkv"])  # (B, T, 3C) for attention
        self.qkv2 = [a.reshape(N, 3 * Cs) for a in self.qkv]  # (N, 3C) for the linear layers
        self.atty = list(v["atty"])
        self.atty2 = [a.reshape(N, Cs) for a in self.atty]
        self.fch1 = [a.reshape(-1) for a in self.fch]  # flat, for GELU
        self.fch_gelu1 = [a.reshape(-1) for a in self.fch_gelu]
        self.lnf, self.lnf_mean, self.lnf_rstd = v["lnf"], v["lnf_mean"], v["lnf_rstd"]
        self.logits, self.probs, self.losses = v["logits"], v["probs"], v["losses"]
        self.dres, self.dln = v["dres"], v["dln"]
        self.datty = v["datty"]
        self.datty2 = self.datty.reshape(N, Cs)
        self.dqkv = v["dqkv"]
        self.dqkv2 = self.dqkv.reshape(N, 3 * Cs)
        self.dfch_gelu, self.dfch = v["dfch_gelu"], v["dfch"]
        self.dfch_gelu1, self.dfch1 = self.dfch_gelu.reshape(-1), self.dfch.reshape(-1)
        self.att_dscores = v["att_dscores"]
        return v


class GPT2(PacksSavedActivations, StagedModel):
    """The Model protocol (``simdist.models.base``) for GPT-2."""

    # simdist.kernels modules it calls (warmed before training; tests/test_imports.py)
    kernel_modules = (
        "attention",
        "dropout",
        "embedding",
        "gelu",
        "layernorm",
        "linear",
        "loss",
        "matmul",
        "rowops",
    )

    def __init__(self, config: GPT2Config):
        self.config = config
        self.name = "gpt2"
        L = config.n_layer
        self._layer_names = [tuple(f"h.{i}.{p}" for p in gpt2_costs.LAYER_PARAMS) for i in range(L)]
        self._arena: np.ndarray | None = None
        self._batch = 0
        self._offsets: dict[str, int] = {}
        self._views: dict[tuple[int, int], _Views] = {}
        self._saved: _Views | None = None  # what the last forward left for backward
        self._current: _Views | None = None  # the micro-batch begin() loaded
        embed = ("wte.weight", "wpe.weight")
        head = ("ln_f.weight", "ln_f.bias", "wte.weight")
        self._stages = [Stage("embed", embed, ())]
        self._stages += [Stage(f"h.{i}", n, n) for i, n in enumerate(self._layer_names)]
        self._stages.append(Stage("head", head, head))
        self._store = no_store  # set_precision: round what the kernels store
        self.tp = 1  # tensor-parallel shards of the arena (``gpt2_tp``); 1: the whole model

    # -------------------------------------------------------------- protocol: sizes
    def parameter_specs(self) -> list[ParamSpec]:
        return parameter_specs(self.config)

    def num_parameters(self) -> int:
        return num_parameters(self.config)

    def activation_bytes(self, batch_size: int) -> int:
        """The arena in float32 words, every block's tensors (the device's layout)."""
        return activation_bytes(self.config, batch_size, self.tp)

    def _arena_layout(self, batch_size: int, packed: bool) -> tuple[dict[str, int], int]:
        return arena_layout(self.config, batch_size, self.tp, packed)

    def _store_layout(self, batch_size: int) -> tuple[dict[str, int], int]:
        return _layout(saved_shapes(self.config, batch_size, self.config.block_size, self.tp))

    def flops_per_sample(self) -> int:
        return flops_per_sample(self.config)

    def kernel_costs(self, batch: int, seq: int | None = None) -> list[KernelCost]:
        """Every kernel call of forward + backward on ``batch`` sequences of ``seq`` tokens
        (default block_size), in order (``gpt2_costs``: the simulated device's work)."""
        return gpt2_costs.kernel_costs(self.config, batch, seq or self.config.block_size)

    # -------------------------------------------------------------- protocol: set-up
    def init_parameters(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        std = 0.02
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layer)  # GPT-2's residual scaling
        for spec in self.parameter_specs():
            p = params[spec.name]
            if spec.name.endswith("c_proj.weight"):
                rng.standard_normal(out=p, dtype=np.float32)
                p *= F32(proj_std)
            elif len(spec.shape) >= 2:
                rng.standard_normal(out=p, dtype=np.float32)
                p *= F32(std)
            elif spec.name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.fill(1.0)
            else:
                p.fill(0.0)  # biases

    def allocate(self, batch_size: int) -> None:
        self._allocate_arena(batch_size)
        self._views = {}
        self._saved = None
        self._current = None

    def _views_for(self, B: int, T: int) -> _Views:
        if self._arena is None:
            raise ValueError("call allocate(batch_size) before forward/evaluate")
        if B > self._batch:
            raise ValueError(f"batch of {B} sequences, but allocate({self._batch}) was called")
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds model.block_size ({self.config.block_size})"
            )
        key = (B, T)
        if key not in self._views:
            self._views[key] = _Views(
                self._arena, self.config, B, T, self._offsets, self.tp, self._store_of()
            )
        return self._views[key]

    # -------------------------------------------------------------- stages (forward, backward
    # and evaluate: StagedModel's loops over them)
    def stages(self) -> list[Stage]:
        """Embedding, blocks 0..L-1, head: what forward runs in order, backward in reverse.

        Block i starts with its own ln_1 (fused with the previous block's residual add), so
        a block's stage reads only that block's weights. The head (ln_f and the tied LM
        head) reads wte again; the embedding's backward reads no weights.
        """
        return list(self._stages)

    def begin(self, inputs: np.ndarray, targets: np.ndarray, training: bool = True) -> None:
        """Load a micro-batch (B <= the allocated batch) for ``forward_stage`` (no dropout:
        training or not, the same forward)."""
        self._current = self._load_batch(inputs, targets)
        self._saved = None  # the arena is being overwritten: no backward until the head ran

    def forward_stage(self, k: int, params) -> float | None:
        """Run stage ``k``'s forward; the head (last stage) returns the mean loss."""
        v = self._current
        if v is None:
            raise RuntimeError("forward_stage without begin(inputs, targets)")
        self._forward_stage(v, k, params)
        if k == len(self._stages) - 1:
            self._saved = v
            return mean_loss(v.losses)  # losses.mean(dtype=np.float64)'s bits
        return None

    def eval_stats(self) -> tuple[float, int]:
        """(sum of the token losses, correct argmax predictions) of the last forward."""
        v = self._current
        if v is None:
            raise RuntimeError("eval_stats without a forward")
        loss_sum = float(v.losses.sum(dtype=np.float64))
        return loss_sum, int(np.count_nonzero(v.logits.argmax(axis=1) == v.targets_flat))

    def backward_stage(self, k: int, params, grads, dloss: float) -> None:
        """Stage ``k``'s backward (call from the last stage down to 0 after the forward);
        each stage finishes its gradient group with ``grads.done``."""
        v = self._saved
        if v is None:
            raise RuntimeError("backward without a preceding forward")
        self._backward_stage(v, k, params, grads, dloss)

    def _backward_stage(self, v: _Views, k: int, params, grads, dloss: float) -> None:
        if k == self.config.n_layer + 1:
            self._head_backward(v, params, grads, dloss)
        elif k == 0:
            self._embed_backward(v, grads)
        else:
            self._block_backward(v, k - 1, params, grads)

    def _head_backward(self, v: _Views, params, grads, dloss: float) -> None:
        """The loss, the tied LM head and ln_f backward: dres becomes d res3 of the last
        block (``_lnf_output_gradient``: what a tensor-parallel shard sums first)."""
        st, L = self._store, self.config.n_layer
        v.unpack(L - 1, ("res3",))
        dlogits = self._logit_gradient(v, dloss)
        st(dlogits)
        lm_head_backward(v.dln, grads["wte.weight"], dlogits, v.lnf, params["wte.weight"])
        st(v.dln)
        layernorm_backward(
            v.dres,
            grads["ln_f.weight"],
            grads["ln_f.bias"],
            self._lnf_output_gradient(v),
            v.res3[L - 1],
            params["ln_f.weight"],
            v.lnf_mean,
            v.lnf_rstd,
        )
        st(v.dres)
        grads.done(("ln_f.weight", "ln_f.bias"))

    def _lnf_output_gradient(self, v: _Views) -> np.ndarray:
        """d ln_f's output: the LM head's input gradient, summed over a tensor-parallel
        group (``_f_backward``: Megatron's f; nothing on one rank)."""
        self._f_backward(v.dln)
        return v.dln

    def _logit_gradient(self, v: _Views, dloss: float) -> np.ndarray:
        """d logits = (probs - onehot(targets)) * dloss / T, over ``probs`` in place: a
        sample's loss is the mean over its T tokens."""
        softmax_cross_entropy_backward(v.probs, v.probs, v.targets_flat, F32(dloss / v.T))
        return v.probs

    def _embed_backward(self, v: _Views, grads) -> None:
        """dres is now d encoded: scatter-added into wte's rows, summed over the batch
        into wpe's (whose rows past T get none, so it is zeroed first)."""
        dwpe = grads["wpe.weight"]
        dwpe.fill(0.0)
        embedding_backward_accumulate(grads["wte.weight"], dwpe, v.dres3, v.tokens)
        grads.done(("wte.weight", "wpe.weight"))

    def _block_backward(self, v: _Views, i: int, params, grads) -> None:
        """Block i's backward: dres from d res3 to d of the block's input. On one rank
        ``_f_backward`` does nothing; a tensor-parallel shard sums its partial input
        gradients there (Megatron's f)."""
        st = self._store
        ln1w, ln1b, attnw, attnb, aprojw, aprojb, ln2w, ln2b, fcw, fcb, mprojw, mprojb = (
            self._layer_names[i]
        )
        v.unpack(i, OWN_PACKED)
        if i > 0:
            v.unpack(i - 1, ("res3",))  # block i's input (layer_in)
        # MLP block: res3 = res2 + c_proj(gelu(c_fc(ln_2(res2)))); dres is d res3
        if st is no_store:  # float32: the GELU's gradient applied to the product in place
            linear_gelu_backward(
                v.dfch, grads[mprojw], grads[mprojb], v.dres, v.fch_gelu[i], params[mprojw],
                v.fch[i],
            )  # fmt: skip
        else:  # mixed precision: the GELU-output gradient is stored (rounded) first
            linear_backward(
                v.dfch_gelu, grads[mprojw], grads[mprojb], v.dres, v.fch_gelu[i], params[mprojw]
            )
            st(v.dfch_gelu)
            gelu_backward(v.dfch1, v.fch1[i], v.dfch_gelu1)
            st(v.dfch)
        linear_backward(v.dln, grads[fcw], grads[fcb], v.dfch, v.ln2[i], params[fcw])
        st(v.dln)
        self._f_backward(v.dln)
        # dres becomes d res2: the skip path's dres plus the branch's contribution
        layernorm_backward_accumulate(
            v.dres,
            grads[ln2w],
            grads[ln2b],
            v.dln,
            v.res2[i],
            params[ln2w],
            v.ln2_mean[i],
            v.ln2_rstd[i],
        )
        st(v.dres)
        # attention block: res2 = x + c_proj(attn(c_attn(ln_1(x))))
        linear_backward(v.datty2, grads[aprojw], grads[aprojb], v.dres, v.atty2[i], params[aprojw])
        st(v.datty2)
        attention_backward(v.dqkv, v.datty, v.qkv[i], v.att[i], v.att_dscores, self._heads())
        st(v.dqkv)
        linear_backward(v.dln, grads[attnw], grads[attnb], v.dqkv2, v.ln1[i], params[attnw])
        st(v.dln)
        self._f_backward(v.dln)
        layernorm_backward_accumulate(
            v.dres,
            grads[ln1w],
            grads[ln1b],
            v.dln,
            v.layer_in[i],
            params[ln1w],
            v.ln1_mean[i],
            v.ln1_rstd[i],
        )
        st(v.dres)
        grads.done(self._layer_names[i])

    # -------------------------------------------------------------- pipeline boundaries
    def stage_input(self, k: int) -> list[np.ndarray]:
        """What stage ``k`` (>= 1) reads from the stages before it, as views of the loaded
        micro-batch's arena: the embedding's output for block 0; for later blocks and the
        head, the previous block's res2 and its MLP output (res3 before the residual add,
        which stage k runs fused with its layernorm). A pipeline sends these after stage
        k - 1's forward and receives them before stage k's."""
        v = self._current
        if v is None:
            raise RuntimeError("stage_input without begin(inputs, targets)")
        if k == 1:
            return [v.encoded]
        return [v.res2[k - 2], v.res3[k - 2]]

    def stage_input_grad(self, k: int) -> np.ndarray:
        """The gradient of stage ``k``'s input after ``backward_stage(k)``; also where
        ``backward_stage(k - 1)`` starts from (one residual-stream gradient buffer)."""
        if self._current is None:
            raise RuntimeError("stage_input_grad without begin(inputs, targets)")
        return self._current.dres

    def stage_flops(self) -> list[int]:
        """Forward + backward FLOPs of each stage per sequence, counted as
        ``flops_per_sample`` counts them (they add up to it): the embedding's lookup none,
        a block T (72 C^2 + 12 T C), the head's tied LM head 6 T C V. Pipelines balance
        their split by these."""
        C, L, T, V = (self.config.n_embd, self.config.n_layer, self.config.block_size,
                      self.config.vocab_size)  # fmt: skip
        return [0, *[T * (72 * C * C + 12 * T * C)] * L, 6 * T * C * V]

    def hold_for_backward(self) -> None:
        """A pipeline stage that ends before the head: keep this micro-batch's activations
        for its backward (the head's forward does this otherwise)."""
        self._saved = self._current

    def gradient_groups(self) -> list[GradientGroup]:
        """ln_f, then blocks last to first, then the embeddings: written first by the tied
        LM head and finished last by the embedding backward, hence held."""
        groups = [GradientGroup(("ln_f.weight", "ln_f.bias"))]
        groups += [
            GradientGroup(tuple(self._layer_names[i]))
            for i in range(self.config.n_layer - 1, -1, -1)
        ]
        groups.append(GradientGroup(("wte.weight", "wpe.weight"), held=True))
        return groups

    # -------------------------------------------------------------- internals
    def _ln1_params(self, params, i: int) -> tuple[np.ndarray, np.ndarray]:
        names = self._layer_names[i]
        return params[names[0]], params[names[1]]

    def _load_batch(self, inputs: np.ndarray, targets: np.ndarray) -> _Views:
        if inputs.ndim != 2 or inputs.shape != targets.shape:
            raise ValueError(
                f"tokens and targets must both be (B, T); got {inputs.shape} and {targets.shape}"
            )
        B, T = inputs.shape
        v = self._views_for(B, T)
        V = self.config.vocab_size
        for what, src, dst in (("tokens", inputs, v.tokens), ("targets", targets, v.targets)):
            # the kernels index with these unchecked: a bad id would read or write wild memory
            if src.size and (src.min() < 0 or src.max() >= V):
                raise ValueError(f"{what} must lie in [0, vocab_size={V})")
            np.copyto(dst, src, casting="same_kind")
        return v

    def _forward_stage(self, v: _Views, k: int, params) -> None:
        # every residual add feeds the next layernorm, so the two run fused:
        # res = x + branch (written over the branch output), then ln = layernorm(res);
        # block i opens with the add that closes block i - 1 and its own ln_1
        if k == 0:
            self._embed_forward(v, params)
        elif k == self.config.n_layer + 1:
            self._head_forward(v, params)
        else:
            self._block_forward(v, k - 1, params)

    def _embed_forward(self, v: _Views, params) -> None:
        embedding_forward(v.encoded, v.tokens, params["wte.weight"], params["wpe.weight"])
        self._store(v.encoded)  # mixed precision: stored half (else a no-op)

    def _head_forward(self, v: _Views, params) -> None:
        """The last block's residual add into ln_f, the LM head (tied to wte), the loss."""
        st, L = self._store, self.config.n_layer
        lnf = params["ln_f.weight"], params["ln_f.bias"]
        close_block(v, L - 1, (v.lnf, v.lnf_mean, v.lnf_rstd), lnf, st)  # now final
        lm_head_forward(v.logits, v.lnf, params["wte.weight"])
        st(v.logits)  # the loss reads them in float32, as a fused softmax-CE kernel
        self._loss(v)

    def _loss(self, v: _Views) -> None:
        """Per-token losses and the softmax probabilities (kept for backward)."""
        softmax_cross_entropy_forward(v.losses, v.probs, v.logits, v.targets_flat)

    def _block_forward(self, v: _Views, i: int, params) -> None:
        """Block i's forward. On one rank ``_row_bias`` and ``_g`` do nothing; a
        tensor-parallel shard adds the row-parallel GEMMs' bias on one rank only and sums
        their partial outputs there (Megatron's g)."""
        st = self._store
        ln1w, ln1b, attnw, attnb, aprojw, aprojb, ln2w, ln2b, fcw, fcb, mprojw, mprojb = (
            self._layer_names[i]
        )
        open_block(v, i, v.encoded2, (params[ln1w], params[ln1b]), st)
        linear_forward(v.qkv2[i], v.ln1[i], params[attnw], params[attnb])  # column-parallel
        st(v.qkv2[i])
        attention_forward(v.atty[i], v.att[i], v.qkv[i], self._heads())
        # the probabilities stay float32, as a fused attention keeps them (it stores none)
        st(v.atty[i])
        linear_forward(v.res2[i], v.atty2[i], params[aprojw], self._row_bias(params[aprojb]))
        st(v.res2[i])  # the GEMM's half output (a shard's partial sums are summed in half)
        self._g(v.res2[i])
        mid_block(v, i, v.res2[i], (params[ln2w], params[ln2b]), st)
        if st is no_store:  # float32: the GELU applied to c_fc's rows in the bias pass
            linear_gelu_forward(v.fch_gelu[i], v.fch[i], v.ln2[i], params[fcw], params[fcb])
        else:  # mixed precision: the GELU reads c_fc's output as stored (rounded)
            linear_forward(v.fch[i], v.ln2[i], params[fcw], params[fcb])
            st(v.fch[i])
            gelu_forward(v.fch_gelu1[i], v.fch1[i])
            st(v.fch_gelu[i])
        linear_forward(v.res3[i], v.fch_gelu[i], params[mprojw], self._row_bias(params[mprojb]))
        st(v.res3[i])
        self._g(v.res3[i])
        v.pack(i, OWN_PACKED)  # before block i + 2 reuses the working copies

    # Megatron's f and g around a block's GEMM pairs: nothing to do on one rank
    def _heads(self) -> int:
        """Attention heads this model computes (a tensor-parallel shard: its share)."""
        return self.config.n_head

    def _row_bias(self, bias: np.ndarray) -> np.ndarray:
        return bias

    def _g(self, buf: np.ndarray) -> None:
        """The row-parallel GEMM's output, summed over a tensor-parallel group."""

    def _f_backward(self, buf: np.ndarray) -> None:
        """The column-parallel GEMM's input gradient, summed over a tensor-parallel group."""
