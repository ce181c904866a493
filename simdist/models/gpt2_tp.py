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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from simdist.config import ConfigError
from simdist.kernels._jit import kernel
from simdist.kernels.attention import attention_backward, attention_forward
from simdist.kernels.gelu import gelu_backward, gelu_forward
from simdist.kernels.layernorm import (
    layernorm_backward,
    layernorm_backward_accumulate,
    layernorm_forward,
    residual_layernorm_forward,
)
from simdist.kernels.linear import linear_backward, linear_forward
from simdist.kernels.matmul import lm_head_backward, lm_head_forward
from simdist.kernels.rowops import exp_f32, row_sum

from . import gpt2_costs
from .base import KernelCost, ParamSpec, gemm, vector
from .gpt2 import GPT2, GPT2Config, parameter_specs

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


def check_split(cfg: GPT2Config, tp: int, key: str = "runconfig.tensor_parallel") -> None:
    """Heads and vocabulary must divide by the degree (no padding of the vocabulary)."""
    for what, n in (("model.n_head", cfg.n_head), ("model.vocab_size", cfg.vocab_size)):
        if n % tp:
            raise ConfigError(
                f"{key}={tp} (weight mode) must divide {what} ({n}): each rank holds an "
                f"equal share of the heads, MLP columns (n_inner = 4 n_embd) and vocabulary "
                "rows; the vocabulary is not padded, choose a degree that divides both",
                key,
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


def kernel_costs(cfg: GPT2Config, tp: int, B: int, T: int) -> list[KernelCost]:
    """The shard's kernel calls (``gpt2_costs`` on its shapes): heads, MLP columns and
    vocabulary divided by ``tp``; LayerNorms, embedding and residual adds whole."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size // tp
    NH, hs, N = cfg.n_head // tp, cfg.head_size, B * T
    Cs, Fs = C // tp, 4 * C // tp
    lin, att, ln = gpt2_costs._linear, gpt2_costs._attention, gpt2_costs._layernorm
    f, b = "forward", "backward"
    out: list[KernelCost] = [
        vector("tokens.copy", 0, 4 * N, f),
        vector("embedding", N * C, 2 * N * C + T * C + N, f),
        _layernorm_first(N, C),
    ]
    for i in range(L):
        h = f"h.{i}."
        out += lin(h + "attn.c_attn", N, C, 3 * Cs, f)
        out += att(h + "attn", B, T, NH, hs, f)
        out += lin(h + "attn.c_proj", N, Cs, C, f)
        out.append(ln(h + "ln_2", N, C, f, fused_add=True))
        out += lin(h + "mlp.c_fc", N, C, Fs, f)
        out.append(vector(h + "mlp.gelu", gpt2_costs.GELU_FWD * N * Fs, 2 * N * Fs, f))
        out += lin(h + "mlp.c_proj", N, Fs, C, f)
        nxt = f"h.{i + 1}.ln_1" if i + 1 < L else "ln_f"
        out.append(ln(nxt, N, C, f, fused_add=True))
    out.append(gemm("lm_head", N, C, V, f, layout="nt"))
    exp = gpt2_costs.EXP
    out.append(vector("softmax_ce", (exp + 4) * N * V, 2 * N * V + 6 * N, f))
    out.append(vector("softmax_ce.bwd", N * V, 2 * N * V + N, b))
    out.append(gemm("lm_head.dinput", N, V, C, b))
    out.append(gemm("lm_head.dwte", V, N, C, b, layout="tn"))
    out.append(ln("ln_f.bwd", N, C, b)._replace(done=("ln_f.weight", "ln_f.bias")))
    for i in range(L - 1, -1, -1):
        h = f"h.{i}."
        out += lin(h + "mlp.c_proj", N, Fs, C, b)
        out.append(vector(h + "mlp.gelu.bwd", gpt2_costs.GELU_BWD * N * Fs, 3 * N * Fs, b))
        out += lin(h + "mlp.c_fc", N, C, Fs, b)
        out.append(ln(h + "ln_2.bwd", N, C, b, fused_add=True))
        out += lin(h + "attn.c_proj", N, Cs, C, b)
        out += att(h + "attn", B, T, NH, hs, b)
        out += lin(h + "attn.c_attn", N, C, 3 * Cs, b)
        names = tuple(f"{h}{p}" for p in gpt2_costs.LAYER_PARAMS)
        out.append(ln(h + "ln_1.bwd", N, C, b, fused_add=True)._replace(done=names))
    out.append(vector("wpe.grad.zero", 0, cfg.block_size * C, b))
    done = ("wte.weight", "wpe.weight")
    out.append(vector("embedding.bwd", 2 * N * C, 3 * N * C + 2 * T * C, b)._replace(done=done))
    return out


def _layernorm_first(N: int, C: int) -> KernelCost:
    return gpt2_costs._layernorm("h.0.ln_1", N, C, "forward")


class GPT2TP(GPT2):
    """Rank ``rank``'s shard of GPT-2 in a tensor-parallel group of ``tp`` ranks. The
    group's collectives (``simdist.comm.Collectives`` over the group) come through
    ``bind(coll)`` before the first forward; the parameters it reads are the shard's
    (``shard_specs``), initialised as one rank initialises the whole model."""

    def __init__(self, config: GPT2Config, tp: int, rank: int):
        check_split(config, tp)
        super().__init__(config)
        self._tp, self.rank = tp, rank
        self.index = shard_index(config, tp, rank)
        Vs = config.vocab_size // tp
        self.vocab = (rank * Vs, (rank + 1) * Vs)  # this rank's rows of wte
        # row-parallel biases are added once (rank 0): the others add zeros
        self._zero_bias = np.zeros(config.n_embd, F32)
        self.coll: Any = None
        self._scratch: dict[str, np.ndarray] = {}

    def bind(self, coll) -> None:
        """The tensor-parallel group's collectives (ranks in group order)."""
        self.coll = coll

    # -------------------------------------------------------------- sizes
    def parameter_specs(self) -> list[ParamSpec]:
        return shard_specs(self.config, self._tp)

    def num_parameters(self) -> int:
        return sum(s.numel for s in self.parameter_specs())

    def kernel_costs(self, batch: int, seq: int | None = None) -> list[KernelCost]:
        return kernel_costs(self.config, self._tp, batch, seq or self.config.block_size)

    def init_parameters(self, params, rng: np.random.Generator) -> None:
        """The whole model's initialisation (the same draws as one rank), then this
        rank's slice of it: a tensor-parallel run starts where a one-rank run starts."""
        full = {s.name: np.empty(s.shape, F32) for s in parameter_specs(self.config)}
        GPT2.init_parameters(self, full, rng)
        for name, split in self.index.items():
            params[name][...] = extract(full[name], split)

    def allocate(self, batch_size: int) -> None:
        super().allocate(batch_size)
        N, C = batch_size * self.config.block_size, self.config.n_embd
        self._scratch = {
            "max": np.zeros(self._tp * N, F32),  # every rank's row maxima
            "sums": np.zeros(2 * N, F32),  # sum of exponentials, target logit
            "argmax": np.zeros(2 * self._tp * N, F32),  # eval: (max, index) per rank
            "mask": np.zeros(N, bool),
            "local": np.zeros(N, np.int64),
            "zero_rows": np.zeros((0, C), F32),
        }

    # -------------------------------------------------------------- the group's sums
    def _allreduce(self, buf: np.ndarray) -> None:
        self.coll.allreduce(buf.reshape(-1))

    def _row_bias(self, bias: np.ndarray) -> np.ndarray:
        return bias if self.rank == 0 else self._zero_bias

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
        cfg = self.config
        L = cfg.n_layer
        if k == 0:  # vocab-parallel embedding: own rows, zeros elsewhere, summed; + wpe
            local, mask = self._local_tokens(v.tokens)
            np.take(params["wte.weight"], local, axis=0, out=v.encoded2)
            v.encoded2[~mask] = 0.0
            self._allreduce(v.encoded)
            v.encoded += params["wpe.weight"][: v.T]
            return
        if k == L + 1:
            residual_layernorm_forward(
                v.res3[L - 1],
                v.lnf,
                v.lnf_mean,
                v.lnf_rstd,
                v.res2[L - 1],
                v.res3[L - 1],
                params["ln_f.weight"],
                params["ln_f.bias"],
            )
            lm_head_forward(v.logits, v.lnf, params["wte.weight"])  # this vocabulary's
            self._cross_entropy(v)
            return
        i = k - 1
        ln1w, ln1b, attnw, attnb, aprojw, aprojb, ln2w, ln2b, fcw, fcb, mprojw, mprojb = (
            self._layer_names[i]
        )
        if i == 0:
            layernorm_forward(
                v.ln1[0], v.ln1_mean[0], v.ln1_rstd[0], v.encoded2, params[ln1w], params[ln1b]
            )
        else:
            residual_layernorm_forward(
                v.res3[i - 1],
                v.ln1[i],
                v.ln1_mean[i],
                v.ln1_rstd[i],
                v.res2[i - 1],
                v.res3[i - 1],
                params[ln1w],
                params[ln1b],
            )
        linear_forward(v.qkv2[i], v.ln1[i], params[attnw], params[attnb])  # column-parallel
        attention_forward(v.atty[i], v.att[i], v.qkv[i], cfg.n_head // self._tp)
        linear_forward(v.res2[i], v.atty2[i], params[aprojw], self._row_bias(params[aprojb]))
        self._allreduce(v.res2[i])  # g: the row-parallel partial sums
        residual_layernorm_forward(
            v.res2[i],
            v.ln2[i],
            v.ln2_mean[i],
            v.ln2_rstd[i],
            v.layer_in[i],
            v.res2[i],
            params[ln2w],
            params[ln2b],
        )
        linear_forward(v.fch[i], v.ln2[i], params[fcw], params[fcb])
        gelu_forward(v.fch_gelu1[i], v.fch1[i])
        linear_forward(v.res3[i], v.fch_gelu[i], params[mprojw], self._row_bias(params[mprojb]))
        self._allreduce(v.res3[i])

    def _cross_entropy(self, v) -> None:
        """Vocab-parallel softmax cross-entropy: per row the maximum over every rank's
        logits (all-gathered), the sum of exponentials and the target's logit (its owner
        contributes it, the others 0) summed over the group; ``probs`` keeps this rank's
        columns of the softmax, ``losses`` the whole loss, the same bits on every rank."""
        N = v.logits.shape[0]
        tp, r = self._tp, self.rank
        maxima = self._scratch["max"][: tp * N].reshape(tp, N)
        np.max(v.logits, axis=1, out=maxima[r])
        self.coll.allgather(maxima.reshape(-1))
        row_max = maxima.max(axis=0)  # a maximum is exact: the whole row's
        sums = self._scratch["sums"][: 2 * N].reshape(2, N)
        vocab_softmax_partial(v.probs, sums[0], v.logits, row_max)
        local, mask = self._local_tokens(v.targets)
        sums[1] = np.where(mask, v.logits[np.arange(N), local], F32(0.0))
        self._allreduce(sums)  # sums of exponentials; the target's logit from its owner
        vocab_softmax_finish(v.losses, v.probs, sums[0], sums[1], row_max)

    def eval_stats(self) -> tuple[float, int]:
        """(sum of the token losses, correct argmax predictions): the argmax over every
        rank's vocabulary (the first maximum, as one rank's argmax takes it)."""
        v = self._current
        if v is None:
            raise RuntimeError("eval_stats without a forward")
        N, tp, r = v.logits.shape[0], self._tp, self.rank
        best = self._scratch["argmax"][: 2 * tp * N].reshape(tp, 2, N)
        np.max(v.logits, axis=1, out=best[r, 0])
        best[r, 1] = v.logits.argmax(axis=1) + self.vocab[0]  # < 2^24: exact in float32
        self.coll.allgather(best.reshape(-1))
        winner = best[:, 0].argmax(axis=0)  # first rank with the maximum: lowest index
        pred = best[winner, 1, np.arange(N)].astype(np.int64)
        loss_sum = float(v.losses.sum(dtype=np.float64))
        return loss_sum, int(np.count_nonzero(pred == v.targets_flat))

    # -------------------------------------------------------------- backward
    def backward_stage(self, k: int, params, grads, dloss: float) -> None:
        v = self._saved
        if v is None:
            raise RuntimeError("backward without a preceding forward")
        cfg = self.config
        L = cfg.n_layer
        if k == L + 1:  # head: this vocabulary's logits; lnf's gradient summed (f)
            d = F32(dloss / v.T)
            dlogits = v.probs
            local, mask = self._local_tokens(v.targets)
            rows = np.nonzero(mask)[0]
            dlogits[rows, local[rows]] -= F32(1.0)  # probs - onehot(own targets)
            dlogits *= d
            lm_head_backward(v.dln, grads["wte.weight"], dlogits, v.lnf, params["wte.weight"])
            self._allreduce(v.dln)
            layernorm_backward(
                v.dres,
                grads["ln_f.weight"],
                grads["ln_f.bias"],
                v.dln,
                v.res3[L - 1],
                params["ln_f.weight"],
                v.lnf_mean,
                v.lnf_rstd,
            )
            grads.done(("ln_f.weight", "ln_f.bias"))
            return
        if k == 0:  # the owned tokens' rows of wte; wpe whole (dres is the same everywhere)
            dwpe = grads["wpe.weight"]
            dwpe.fill(0.0)
            np.sum(v.dres3, axis=0, out=dwpe[: v.T])
            local, mask = self._local_tokens(v.tokens)
            np.add.at(grads["wte.weight"], local[mask], v.dres[mask])
            grads.done(("wte.weight", "wpe.weight"))
            return
        i = k - 1
        ln1w, ln1b, attnw, attnb, aprojw, aprojb, ln2w, ln2b, fcw, fcb, mprojw, mprojb = (
            self._layer_names[i]
        )
        # MLP: the row-parallel c_proj takes the whole dres; c_fc's input gradient is summed
        linear_backward(
            v.dfch_gelu, grads[mprojw], grads[mprojb], v.dres, v.fch_gelu[i], params[mprojw]
        )
        gelu_backward(v.dfch1, v.fch1[i], v.dfch_gelu1)
        linear_backward(v.dln, grads[fcw], grads[fcb], v.dfch, v.ln2[i], params[fcw])
        self._allreduce(v.dln)  # f
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
        linear_backward(v.datty2, grads[aprojw], grads[aprojb], v.dres, v.atty2[i], params[aprojw])
        attention_backward(
            v.dqkv, v.datty, v.qkv[i], v.att[i], v.att_dscores, cfg.n_head // self._tp
        )
        linear_backward(v.dln, grads[attnw], grads[attnb], v.dqkv2, v.ln1[i], params[attnw])
        self._allreduce(v.dln)  # f
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
        grads.done(self._layer_names[i])

    def stage_input(self, k: int) -> list[np.ndarray]:
        raise ConfigError(
            "runconfig.tensor_parallel_mode=weight does not combine with "
            "runconfig.pipeline_parallel",
            "runconfig.pipeline_parallel",
        )
