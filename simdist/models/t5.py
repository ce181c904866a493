"""T5 (Raffel et al. 2020): encoder-decoder trained by span-corruption denoising, llm.c-style.

Like ``bert.py`` (configuration, presets t5-mini / t5-small / t5-base and sizes in
``t5_shapes.py``, the arena in ``t5_arena.py``, the kernel list in ``t5_costs.py``): the
parameters in Hugging Face's ``T5ForConditionalGeneration`` state-dict names and
layouts (``nn.Linear`` weights (out, in), no biases anywhere; ``shared.weight`` embeds both
stacks and, tied, is the LM head; each stack's relative-attention-bias table sits in its
first block and serves all its blocks), one float32 activation arena, and forward /
backward as kernel calls. Pre-norm blocks with T5's RMS layer norm (eps 1e-6):
x -> x + drop(attn(norm(x))) -> (decoder: + drop(cross(norm(.), enc))) -> + drop(ffn(norm(.))),
attention scores unscaled (T5 folds 1/sqrt(d_kv) into the initialisation) plus the bias;
the FFN is ReLU (v1.0) or gated-GELU (v1.1, ``feed_forward_proj: gated-gelu``). With tied
embeddings the decoder output is scaled by d_model^-0.5 before the head, as Hugging Face does.

Inputs (``simdist.data.t5`` makes them): ``inputs`` (B, Te + 1) int32, the encoder's token
ids then the sample's global index (the dropout masks hash it); ``targets`` (B, Td) int32,
the decoder's labels (its inputs are the labels shifted right behind the start token, pad
0). Encoder keys whose token is the pad id are masked out. A sample's loss is the mean
cross-entropy of its Td labels; the micro-batch loss is the mean over samples (every
sample has Td labels, so this is Hugging Face's token mean).

Dropout (``dropout_rate`` everywhere Hugging Face puts it: embeddings, attention
probabilities, block outputs, inside the FFN, after each stack's final norm) uses
``kernels/dropout.py``: masks hash (seed, global step, sample index, site).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from simdist.kernels.activation import relu_backward, relu_forward
from simdist.kernels.attention import mha_attend_backward, mha_attend_forward
from simdist.kernels.dropout import dropout_backward, dropout_forward, sample_keys
from simdist.kernels.gelu import gelu_backward, gelu_forward
from simdist.kernels.linear_nobias import (
    gate_backward,
    gate_forward,
    linear_nobias_backward,
    linear_nobias_backward_accumulate,
    linear_nobias_forward,
    scale_forward,
    token_embedding_backward_accumulate,
    token_embedding_forward,
)
from simdist.kernels.loss import softmax_cross_entropy_backward, softmax_cross_entropy_forward
from simdist.kernels.relpos import relpos_bias_backward, relpos_bias_forward
from simdist.kernels.residual import residual_forward
from simdist.kernels.rmsnorm import rmsnorm_backward, rmsnorm_backward_accumulate, rmsnorm_forward
from simdist.precision import no_store

from . import t5_costs
from .base import GradientGroup, KernelCost, ParamSpec
from .saved_words import PacksSavedActivations
from .stages import Stage, StagesByKind
from .t5_arena import EPS, F32, Views, arena_layout, store_layout
from .t5_shapes import (  # noqa: F401  (re-exported: tests and plan mode import them here)
    FIELDS,
    REL,
    T5Config,
    block_names,
    flops_per_sample,
    head_names,
    num_parameters,
    parameter_specs,
    plan_models,
    plan_shape,
    resolve_config,
    sites,
)


def build_t5(config) -> T5:
    """From params.yaml's model section (``simdist.config.T5ModelConfig``)."""
    return T5(resolve_config(config.preset, **{k: getattr(config, k) for k in FIELDS}))


def activation_bytes(cfg: T5Config, batch_size: int) -> int:
    return 4 * arena_layout(cfg, batch_size)[1]


# ------------------------------------------------------------------ the model
class T5(PacksSavedActivations, StagesByKind):
    """The Model protocol (``simdist.models.base``) for T5 span-corruption denoising; in
    mixed precision (``set_precision``) it holds its blocks' saved activations as 16-bit
    words."""

    # simdist.kernels modules it calls (warmed before training; tests/test_imports.py)
    kernel_modules = (
        "activation",
        "attention",
        "dropout",
        "gelu",
        "linear_nobias",
        "loss",
        "relpos",
        "residual",
        "rmsnorm",
        "rowops",
    )

    def __init__(self, config: T5Config):
        self.config = config
        self.name = "t5"
        self._enc = [block_names(config, "encoder", i) for i in range(config.num_layers)]
        self._dec = [block_names(config, "decoder", i) for i in range(config.num_decoder_layers)]
        self._head = head_names(config)
        shared = ("shared.weight",)
        final = ("encoder.final_layer_norm.weight",)
        head = (*self._head, *(shared if config.tie_word_embeddings else ()))
        # (stage, which forward / backward method runs it, with which block index)
        plan = [(Stage("encoder.embed", shared, ()), ("encoder_embed", 0))]
        plan += [(Stage(f"encoder.{i}", n, n), ("encoder", i)) for i, n in enumerate(self._enc)]
        plan.append((Stage("encoder.final_norm", final, final), ("encoder_final", 0)))
        plan.append((Stage("decoder.embed", shared, ()), ("decoder_embed", 0)))
        plan += [(Stage(f"decoder.{j}", n, n), ("decoder", j)) for j, n in enumerate(self._dec)]
        plan.append((Stage("head", head, head), ("head", 0)))
        self._stages = [s for s, _ in plan]
        self._kinds = [k for _, k in plan]
        self._current: Views | None = None
        self._arena: np.ndarray | None = None
        self._batch = 0
        self._offsets: dict[str, int] = {}
        self._views: dict[int, Views] = {}
        self._saved: Views | None = None
        self._seed = 0
        self._step: Callable[[], int] = lambda: 0
        self._p = F32(0.0)  # this forward's dropout probability (0 in evaluation)
        self._keys = np.zeros(1, np.uint64)  # the current batch's dropout keys
        self._store = no_store  # set_precision: round what the kernels store

    def bind_step(self, seed: int, step: Callable[[], int]) -> None:
        """Dropout masks hash (seed, step(), sample index)."""
        self._seed, self._step = int(seed), step

    # -------------------------------------------------------------- protocol: sizes
    def parameter_specs(self) -> list[ParamSpec]:
        return parameter_specs(self.config)

    def num_parameters(self) -> int:
        return num_parameters(self.config)

    def activation_bytes(self, batch_size: int) -> int:
        """The arena in float32 words, every block's tensors (the device's layout)."""
        return activation_bytes(self.config, batch_size)

    def _arena_layout(self, batch_size: int, packed: bool) -> tuple[dict[str, int], int]:
        return arena_layout(self.config, batch_size, packed)

    def _store_layout(self, batch_size: int) -> tuple[dict[str, int], int]:
        return store_layout(self.config, batch_size)

    def flops_per_sample(self) -> int:
        return flops_per_sample(self.config)

    def kernel_costs(self, batch: int, seq: int | None = None) -> list[KernelCost]:
        return t5_costs.kernel_costs(self.config, batch, self.gradient_groups())

    def gradient_groups(self) -> list[GradientGroup]:
        """Head norm (and untied head), decoder blocks last to first, the encoder's final
        norm, encoder blocks last to first, then the shared embedding: written first by the
        tied head (or the decoder's embedding) and last by the encoder's, hence held."""
        groups = [GradientGroup(self._head)]
        groups += [GradientGroup(n) for n in reversed(self._dec)]
        groups.append(GradientGroup(("encoder.final_layer_norm.weight",)))
        groups += [GradientGroup(n) for n in reversed(self._enc)]
        groups.append(GradientGroup(("shared.weight",), held=True))
        return groups

    # -------------------------------------------------------------- protocol: set-up
    def init_parameters(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """Hugging Face's T5 init (factor 1): embeddings N(0, 1), q N(0, (D d_kv)^-1/2),
        k, v, wi and the bias tables N(0, D^-1/2), o N(0, C^-1/2), wo N(0, d_ff^-1/2),
        layer norms 1."""
        cfg = self.config
        D = cfg.d_model
        std = {"q": (D * cfg.d_kv) ** -0.5, "o": cfg.inner**-0.5, "wo": cfg.d_ff**-0.5}
        for spec in self.parameter_specs():
            p = params[spec.name]
            if len(spec.shape) == 1:
                p.fill(1.0)
                continue
            rng.standard_normal(out=p, dtype=np.float32)
            kind = spec.name.split(".")[-2]
            if spec.name in ("shared.weight", "lm_head.weight"):
                continue
            p *= F32(std.get(kind, D**-0.5))

    def allocate(self, batch_size: int) -> None:
        self._allocate_arena(batch_size)
        self._views, self._saved, self._current = {}, None, None

    # -------------------------------------------------------------- stages (forward, backward
    # and evaluate: StagedModel's loops over them, StagesByKind's dispatch)
    # kernel costs (``t5_costs``) whose names do not start with their stage's name
    kernel_stages = {
        "encoder.relpos": "encoder.0",
        "encoder.dropout": "encoder.embed",
        "encoder.final": "encoder.final_norm",
        "decoder.relpos": "decoder.0",
        "decoder.dropout": "decoder.embed",
        "decoder.final_norm": "head",
        "decoder.final": "head",
    }

    def stages(self) -> list[Stage]:
        """The encoder's embedding, blocks and final norm, then the decoder's embedding,
        blocks and head (final norm and output projection): forward in order, backward in
        reverse. The shared embedding is read by both embeddings (and a tied head); the
        embeddings' backward reads no weights. Block 0 of each stack holds its relative
        position bias table, which the block computes the stack's bias from."""
        return list(self._stages)

    def begin(self, inputs: np.ndarray, targets: np.ndarray, training: bool = True) -> None:
        """Load a micro-batch for ``forward_stage``; ``training``: apply dropout (when the
        config has it), whose masks hash the step ``bind_step`` gives."""
        v = self._load_batch(inputs, targets)
        self._p = F32(self.config.dropout_rate) if training else F32(0.0)
        if self._p > 0:
            sample_keys(self._seed, self._step(), inputs[:, -1], v.keys)
        self._current = v
        self._saved = None  # the arena is being overwritten: no backward until the head ran

    def eval_stats(self) -> tuple[float, int]:
        """(sum of the target-token losses, correct argmax predictions) of the last forward."""
        v = self._current
        if v is None:
            raise RuntimeError("eval_stats without a forward")
        loss_sum = float(v.losses.sum(dtype=np.float64))
        return loss_sum, int(np.count_nonzero(v.logits.argmax(axis=1) == v.labels))

    # -------------------------------------------------------------- stage forwards
    def _encoder_embed_forward(self, v: Views, params, _: int) -> None:
        S, st = sites(self.config), self._store
        token_embedding_forward(v.ex[0], v.enc_ids, params["shared.weight"])
        self._drop(v.ex[0], v.B, S["enc_emb"])
        st(v.ex[0])

    def _encoder_forward(self, v: Views, params, i: int) -> None:
        cfg = self.config
        B, NH, p = v.B, cfg.num_heads, self._p
        S = sites(cfg)
        st = self._store  # mixed precision: what a kernel writes is stored half (else no-op)
        names = self._enc[i]
        if i == 0:  # the encoder's bias, from block 0's table, for every block
            relpos_bias_forward(v.e_bias, params[names[4]], v.e_buckets)
        q, k, vv, o = (params[n] for n in names[:4])
        s0 = S["enc"][i]
        off = 1 if i == 0 else 0
        v.pack(i, ("ex",))  # block i's input, final
        x, t = v.ex[i], v.tD[: v.Ne]
        rmsnorm_forward(v.e_n1[i], v.e_r1[i], x, params[names[4 + off]], EPS)
        st(v.e_n1[i])
        linear_nobias_forward(v.e_q[i], v.e_n1[i], q)
        linear_nobias_forward(v.e_k[i], v.e_n1[i], k)
        linear_nobias_forward(v.e_v[i], v.e_n1[i], vv)
        st(v.e_q[i], v.e_k[i], v.e_v[i])
        _attend(v.enc3(v.e_ctx[i]), v.e_att[i], v.enc3(v.e_q[i]), v.enc3(v.e_k[i]),
                v.enc3(v.e_v[i]), v.enc_keep, v.scratch, v.ds_ee, NH, False, v.keys, s0, p,
                v.e_bias, True)  # fmt: skip
        st(v.e_ctx[i])  # the probabilities stay float32, as a fused attention keeps them
        linear_nobias_forward(t, v.e_ctx[i], o)
        self._drop(t, B, s0 + 1)
        st(t)
        residual_forward(v.e_xm[i].reshape(-1), x.reshape(-1), t.reshape(-1))
        st(v.e_xm[i])
        rmsnorm_forward(v.e_n2[i], v.e_r2[i], v.e_xm[i], params[names[-1]], EPS)
        st(v.e_n2[i])
        self._ffn_forward(v, params, names[5 + off : -1], v.e_n2[i], v.e_h[i], v.e_h1[i],
                          v.e_g[i], v.e_a[i], B, s0 + 2)  # fmt: skip
        linear_nobias_forward(t, v.e_a[i], params[names[-2]])
        self._drop(t, B, s0 + 3)
        st(t)
        residual_forward(v.ex[i + 1].reshape(-1), v.e_xm[i].reshape(-1), t.reshape(-1))
        st(v.ex[i + 1])
        v.pack(i, v.enc_own)  # before block i + 1 reuses the working copies

    def _encoder_final_forward(self, v: Views, params, _: int) -> None:
        S, st = sites(self.config), self._store
        w = params["encoder.final_layer_norm.weight"]
        rmsnorm_forward(v.enc_out, v.e_rf, v.ex[-1], w, EPS)
        self._drop(v.enc_out, v.B, S["enc_final"])
        st(v.enc_out)

    def _decoder_embed_forward(self, v: Views, params, _: int) -> None:
        S, st = sites(self.config), self._store
        token_embedding_forward(v.dy[0], v.dec_ids, params["shared.weight"])
        self._drop(v.dy[0], v.B, S["dec_emb"])
        st(v.dy[0])

    def _decoder_forward(self, v: Views, params, j: int) -> None:
        cfg = self.config
        B, NH, p = v.B, cfg.num_heads, self._p
        S = sites(cfg)
        st = self._store
        names = self._dec[j]
        if j == 0:  # the decoder's self-attention bias, from block 0's table
            relpos_bias_forward(v.d_bias, params[names[4]], v.d_buckets)
        s0 = S["dec"][j]
        off = 1 if j == 0 else 0
        v.pack(j, ("dy",))  # block j's input, final
        y, t = v.dy[j], v.tD[: v.Nd]
        sq, sk, sv, so = (params[n] for n in names[:4])
        rmsnorm_forward(v.s_n[j], v.s_r[j], y, params[names[4 + off]], EPS)
        st(v.s_n[j])
        linear_nobias_forward(v.s_q[j], v.s_n[j], sq)
        linear_nobias_forward(v.s_k[j], v.s_n[j], sk)
        linear_nobias_forward(v.s_v[j], v.s_n[j], sv)
        st(v.s_q[j], v.s_k[j], v.s_v[j])
        _attend(v.dec3(v.s_ctx[j]), v.s_att[j], v.dec3(v.s_q[j]), v.dec3(v.s_k[j]),
                v.dec3(v.s_v[j]), v.dec_keep, v.scratch, v.ds_dd, NH, True, v.keys, s0, p,
                v.d_bias, True)  # fmt: skip
        st(v.s_ctx[j])
        linear_nobias_forward(t, v.s_ctx[j], so)
        self._drop(t, B, s0 + 1)
        st(t)
        residual_forward(v.s_xm[j].reshape(-1), y.reshape(-1), t.reshape(-1))
        st(v.s_xm[j])
        c = 5 + off
        cq, ck, cv, co = (params[n] for n in names[c : c + 4])
        rmsnorm_forward(v.c_n[j], v.c_r[j], v.s_xm[j], params[names[c + 4]], EPS)
        st(v.c_n[j])
        linear_nobias_forward(v.c_q[j], v.c_n[j], cq)
        linear_nobias_forward(v.c_k[j], v.enc_out, ck)
        linear_nobias_forward(v.c_v[j], v.enc_out, cv)
        st(v.c_q[j], v.c_k[j], v.c_v[j])
        _attend(v.dec3(v.c_ctx[j]), v.c_att[j], v.dec3(v.c_q[j]), v.enc3(v.c_k[j]),
                v.enc3(v.c_v[j]), v.enc_keep, v.scratch, v.ds_de, NH, False, v.keys,
                s0 + 2, p, v.d_bias, False)  # fmt: skip
        st(v.c_ctx[j])
        linear_nobias_forward(t, v.c_ctx[j], co)
        self._drop(t, B, s0 + 3)
        st(t)
        residual_forward(v.c_xm[j].reshape(-1), v.s_xm[j].reshape(-1), t.reshape(-1))
        st(v.c_xm[j])
        rmsnorm_forward(v.f_n[j], v.f_r[j], v.c_xm[j], params[names[-1]], EPS)
        st(v.f_n[j])
        self._ffn_forward(v, params, names[c + 5 : -1], v.f_n[j], v.f_h[j], v.f_h1[j],
                          v.f_g[j], v.f_a[j], B, s0 + 4)  # fmt: skip
        linear_nobias_forward(t, v.f_a[j], params[names[-2]])
        self._drop(t, B, s0 + 5)
        st(t)
        residual_forward(v.dy[j + 1].reshape(-1), v.c_xm[j].reshape(-1), t.reshape(-1))
        st(v.dy[j + 1])
        v.pack(j, v.dec_own)  # before block j + 1 reuses the working copies

    def _head_forward(self, v: Views, params, _: int) -> None:
        cfg = self.config
        S, st = sites(cfg), self._store
        w = params["decoder.final_layer_norm.weight"]
        rmsnorm_forward(v.dec_out, v.d_rf, v.dy[-1], w, EPS)
        self._drop(v.dec_out, v.B, S["dec_final"])
        st(v.dec_out)
        head = v.dec_out
        if cfg.tie_word_embeddings:
            scale_forward(v.dec_scaled.reshape(-1), v.dec_out.reshape(-1), F32(cfg.d_model**-0.5))
            st(v.dec_scaled)
            head = v.dec_scaled
        linear_nobias_forward(v.logits, head, params[self._head_weight()])
        st(v.logits)  # the loss reads them in float32
        softmax_cross_entropy_forward(v.losses, v.probs, v.logits, v.labels)

    def _head_weight(self) -> str:
        return "shared.weight" if self.config.tie_word_embeddings else "lm_head.weight"

    # -------------------------------------------------------------- stage backwards
    def _head_backward(self, v: Views, params, g, _: int, dloss: float) -> None:
        """Per-sample loss = mean of its Td token losses; leaves d(last block's output) in
        ``gd`` and zeroes what the blocks accumulate into (bias and encoder-output grads)."""
        cfg = self.config
        B, S, Nd = v.B, sites(cfg), v.Nd
        hw = self._head_weight()
        st = self._store
        softmax_cross_entropy_backward(v.probs, v.probs, v.labels, F32(dloss / cfg.target_length))
        st(v.probs)  # d logits
        t = v.tD[:Nd]
        head = v.dec_scaled if cfg.tie_word_embeddings else v.dec_out
        linear_nobias_backward(t, g[hw], v.probs, head, params[hw])
        if cfg.tie_word_embeddings:
            st(t)
            scale_forward(t.reshape(-1), t.reshape(-1), F32(cfg.d_model**-0.5))
        d = self._undrop(t, t, B, S["dec_final"])
        st(d)
        gd = v.gd
        w = "decoder.final_layer_norm.weight"
        rmsnorm_backward(gd, g[w], d, v.dy[-1], params[w], v.d_rf)
        st(gd)
        g.done(self._head)
        v.e_dbias.fill(0.0)
        v.d_dbias.fill(0.0)
        v.g_enc.fill(0.0)

    def _decoder_backward(self, v: Views, params, g, j: int, dloss: float) -> None:
        """``gd`` holds d(block j's output); leaves d(its input) there."""
        cfg = self.config
        B, NH, p = v.B, cfg.num_heads, self._p
        S = sites(cfg)
        Ne, Nd = v.Ne, v.Nd
        st = self._store
        t, gd = v.tD[:Nd], v.gd
        gn, gq, gk, gv, gc = v.g_n[:Nd], v.g_q[:Nd], v.g_k, v.g_v, v.g_ctx[:Nd]
        names = self._dec[j]
        s0, off = S["dec"][j], (1 if j == 0 else 0)
        c = 5 + off
        v.unpack(j, (*v.dec_own, "dy"))
        # FFN
        d = self._undrop(t, gd, B, s0 + 5)
        st(d)
        self._ffn_backward(v, params, g, names[c + 5 : -1], gn, d, v.f_n[j],
                           v.f_h[j], v.f_h1[j], v.f_g[j], v.f_a[j], Nd, B, s0 + 4)  # fmt: skip
        rmsnorm_backward_accumulate(gd, g[names[-1]], gn, v.c_xm[j], params[names[-1]],
                                    v.f_r[j])  # fmt: skip
        st(gd)
        # cross-attention: keys and values from the encoder output
        d = self._undrop(t, gd, B, s0 + 3)
        st(d)
        linear_nobias_backward(gc, g[names[c + 3]], d, v.c_ctx[j], params[names[c + 3]])
        st(gc)
        _attend_back(v.dec3(gq), v.enc3(gk[:Ne]), v.enc3(gv[:Ne]), v.d_dbias, v.dec3(gc),
                     v.dec3(v.c_q[j]), v.enc3(v.c_k[j]), v.enc3(v.c_v[j]), v.c_att[j],
                     v.scratch, v.ds_de, NH, False, v.keys, s0 + 2, p, False)  # fmt: skip
        st(gq, gk[:Ne], gv[:Ne])
        linear_nobias_backward(gn, g[names[c]], gq, v.c_n[j], params[names[c]])
        st(gn)
        for which, dk in ((1, gk[:Ne]), (2, gv[:Ne])):
            n = names[c + which]
            linear_nobias_backward_accumulate(v.g_enc, g[n], dk, v.enc_out, params[n])
        st(v.g_enc)
        rmsnorm_backward_accumulate(gd, g[names[c + 4]], gn, v.s_xm[j], params[names[c + 4]],
                                    v.c_r[j])  # fmt: skip
        st(gd)
        # causal self-attention with the shared bias
        acts = (v.s_n[j], v.s_q[j], v.s_k[j], v.s_v[j], v.s_ctx[j], v.s_att[j], v.s_r[j])
        self._self_attention_backward(
            v, params, g, names, v.dy[j], gd, acts, v.d_dbias, v.ds_dd, True, v.dec3, s0
        )
        if j == 0:
            relpos_bias_backward(g[names[4]], v.d_dbias, v.d_buckets)
        g.done(names)

    def _decoder_embed_backward(self, v: Views, params, g, _: int, dloss: float) -> None:
        """The shared table (a tied head wrote its gradient first)."""
        if not self.config.tie_word_embeddings:
            g["shared.weight"].fill(0.0)
        d = self._undrop(v.tD[: v.Nd], v.gd, v.B, sites(self.config)["dec_emb"])
        self._store(d)
        token_embedding_backward_accumulate(g["shared.weight"], d, v.dec_ids)

    def _encoder_final_backward(self, v: Views, params, g, _: int, dloss: float) -> None:
        """d(encoder output), gathered from every cross-attention, through the final norm."""
        st = self._store
        w = "encoder.final_layer_norm.weight"
        d = self._undrop(v.g_enc, v.g_enc, v.B, sites(self.config)["enc_final"])
        st(d)
        rmsnorm_backward(v.ge, g[w], d, v.ex[-1], params[w], v.e_rf)
        st(v.ge)
        g.done((w,))

    def _encoder_backward(self, v: Views, params, g, i: int, dloss: float) -> None:
        """``ge`` holds d(block i's output); leaves d(its input) there."""
        B, S, Ne = v.B, sites(self.config), v.Ne
        st = self._store
        t, gn, ge = v.tD[:Ne], v.g_n[:Ne], v.ge
        names = self._enc[i]
        s0, off = S["enc"][i], (1 if i == 0 else 0)
        v.unpack(i, (*v.enc_own, "ex"))
        d = self._undrop(t, ge, B, s0 + 3)
        st(d)
        self._ffn_backward(v, params, g, names[5 + off : -1], gn, d, v.e_n2[i], v.e_h[i],
                           v.e_h1[i], v.e_g[i], v.e_a[i], Ne, B, s0 + 2)  # fmt: skip
        rmsnorm_backward_accumulate(ge, g[names[-1]], gn, v.e_xm[i], params[names[-1]],
                                    v.e_r2[i])  # fmt: skip
        st(ge)
        acts = (v.e_n1[i], v.e_q[i], v.e_k[i], v.e_v[i], v.e_ctx[i], v.e_att[i], v.e_r1[i])
        self._self_attention_backward(
            v, params, g, names, v.ex[i], ge, acts, v.e_dbias, v.ds_ee, False, v.enc3, s0
        )
        if i == 0:
            relpos_bias_backward(g[names[4]], v.e_dbias, v.e_buckets)
        g.done(names)

    def _encoder_embed_backward(self, v: Views, params, g, _: int, dloss: float) -> None:
        d = self._undrop(v.tD[: v.Ne], v.ge, v.B, sites(self.config)["enc_emb"])
        self._store(d)
        token_embedding_backward_accumulate(g["shared.weight"], d, v.enc_ids)
        g.done(("shared.weight",))

    def _sample_losses(self, v: Views) -> np.ndarray:
        return v.losses.reshape(v.B, -1).mean(axis=1, dtype=np.float64)

    def _load_batch(self, inputs: np.ndarray, targets: np.ndarray) -> Views:
        cfg = self.config
        Te, Td, V = cfg.max_seq_length, cfg.target_length, cfg.vocab_size
        if self._arena is None:
            raise ValueError("call allocate(batch_size) before forward/evaluate")
        if inputs.ndim != 2 or inputs.shape[1] != Te + 1:
            raise ValueError(f"T5 inputs must be (B, {Te + 1}); got {inputs.shape}")
        B = inputs.shape[0]
        if targets.shape != (B, Td):
            raise ValueError(f"T5 targets must be (B, {Td}); got {targets.shape}")
        if B > self._batch:
            raise ValueError(f"batch of {B} samples, but allocate({self._batch}) was called")
        v = self._views.get(B)
        if v is None:
            v = self._views[B] = Views(self._arena, cfg, B, self._offsets, self._store_of())
        for what, a in (("token ids", inputs[:, :Te]), ("labels", targets)):
            if a.size and (a.min() < 0 or a.max() >= V):  # the kernels index unchecked
                raise ValueError(f"T5 {what} must lie in [0, {V})")
        np.copyto(v.enc_ids.reshape(B, Te), inputs[:, :Te], casting="same_kind")
        np.copyto(v.labels.reshape(B, Td), targets, casting="same_kind")
        dec = v.dec_ids.reshape(B, Td)
        dec[:, 0] = cfg.pad_token_id  # the decoder start token
        dec[:, 1:] = targets[:, :-1]
        np.not_equal(v.enc_ids.reshape(B, Te), cfg.pad_token_id, out=v.enc_keep, casting="unsafe")
        self._keys = v.keys
        return v

    def _drop(self, a: np.ndarray, B: int, site: int) -> None:
        if self._p > 0:
            dropout_forward(a.reshape(B, -1), a.reshape(B, -1), self._keys, site, self._p)

    def _undrop(self, dst: np.ndarray, src: np.ndarray, B: int, site: int) -> np.ndarray:
        """d(pre-dropout) from d(post-dropout): into dst, or src itself without dropout."""
        if self._p == 0:
            return src
        dropout_backward(dst.reshape(B, -1), src.reshape(B, -1), self._keys, site, self._p)
        return dst

    def _ffn_forward(self, v, params, names, x_norm, h, h1, g, a, B, site) -> None:
        st = self._store
        if self.config.gated:
            w0, w1 = (params[n] for n in names[:2])
            linear_nobias_forward(h, x_norm, w0)
            linear_nobias_forward(h1, x_norm, w1)
            st(h, h1)
            gelu_forward(g.reshape(-1), h.reshape(-1))
            st(g)
            gate_forward(a.reshape(-1), g.reshape(-1), h1.reshape(-1))
        else:
            linear_nobias_forward(h, x_norm, params[names[0]])
            st(h)
            relu_forward(a, h)
        self._drop(a, B, site)
        st(a)

    def _ffn_backward(self, v, params, grads, names, dn, d_out, x_norm, h, h1, g, a, N, B, site):
        """d_out: d(FFN output); leaves d(x_norm) in dn."""
        cfg = self.config
        wo = names[-1]
        st = self._store
        ga, gh = v.g_a[:N], v.g_h[:N]
        linear_nobias_backward(ga, grads[wo], d_out, a, params[wo])
        ga = self._undrop(ga, ga, B, site)
        st(ga)
        if cfg.gated:
            gh1 = v.g_h1[:N]
            gate_backward(gh.reshape(-1), gh1.reshape(-1), ga.reshape(-1), g.reshape(-1),
                          h1.reshape(-1))  # fmt: skip
            st(gh, gh1)
            gelu_backward(ga.reshape(-1), h.reshape(-1), gh.reshape(-1))
            st(ga)
            linear_nobias_backward(dn, grads[names[0]], ga, x_norm, params[names[0]])
            linear_nobias_backward_accumulate(dn, grads[names[1]], gh1, x_norm, params[names[1]])
        else:
            relu_backward(gh, ga, h)
            linear_nobias_backward(dn, grads[names[0]], gh, x_norm, params[names[0]])
        st(dn)

    def _self_attention_backward(
        self, v, params, g, names, x, gres, acts, dbias, ds, causal, to3, s0
    ) -> None:
        """gres (d block-part output) += d x through x + drop(o(attn(norm(x))));
        acts: the forward's (norm(x), q, k, v, context, softmax, rstd)."""
        N = x.shape[0]
        t, gn, gc = v.tD[:N], v.g_n[:N], v.g_ctx[:N]
        gq, gk, gv = v.g_q[:N], v.g_k[:N], v.g_v[:N]
        x_norm, q, k, vv, ctx, att, rstd = acts
        st = self._store
        d = self._undrop(t, gres, v.B, s0 + 1)
        st(d)
        linear_nobias_backward(gc, g[names[3]], d, ctx, params[names[3]])
        st(gc)
        _attend_back(to3(gq), to3(gk), to3(gv), dbias, to3(gc), to3(q), to3(k), to3(vv), att,
                     v.scratch, ds, self.config.num_heads, causal, v.keys, s0, self._p,
                     True)  # fmt: skip
        st(gq, gk, gv)
        linear_nobias_backward(gn, g[names[0]], gq, x_norm, params[names[0]])
        linear_nobias_backward_accumulate(gn, g[names[1]], gk, x_norm, params[names[1]])
        linear_nobias_backward_accumulate(gn, g[names[2]], gv, x_norm, params[names[2]])
        st(gn)
        ln = names[5] if names[4].endswith(REL) else names[4]
        rmsnorm_backward_accumulate(gres, g[ln], gn, x, params[ln], rstd)
        st(gres)


def _attend(out, att, q, k, v, keep, scratch, ds, NH, causal, keys, site, p, bias, has_bias):
    mha_attend_forward(out, att, q, k, v, keep, scratch, ds, NH, causal, keys, site, p,
                       F32(1.0), bias, has_bias)  # fmt: skip


def _attend_back(dq, dk, dv, dbias, dout, q, k, v, att, scratch, ds, NH, causal, keys, site, p,
                 has_bias):  # fmt: skip
    mha_attend_backward(dq, dk, dv, dbias, dout, q, k, v, att, scratch, ds, NH, causal, keys,
                        site, p, F32(1.0), has_bias)  # fmt: skip
