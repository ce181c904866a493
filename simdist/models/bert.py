"""BERT (Devlin et al. 2019) pretraining, masked LM + next-sentence prediction, llm.c-style.

Like ``gpt2.py``: the configuration with presets (bert-mini, bert-base, bert-large; in
``bert_shapes.py`` with the sizes, so they are known without allocating), the parameter
list in Hugging Face's ``BertForPreTraining`` state-dict names and layouts (``nn.Linear``
weights are (out, in); the MLM decoder is tied to the word embeddings, its
bias is ``cls.predictions.bias``), one float32 activation arena (in mixed precision the layers'
saved activations as 16-bit words besides it, ``saved_words``), and forward / backward as
kernel calls. Post-LN encoder layers: x -> LN(x + drop(attn(x))) -> LN(. + drop(ffn(.))).

Inputs (``simdist.data.bert`` makes them):
- ``inputs``: (B, 3, T) int32: token ids, segment (token type) ids, and in row 2 column 0
  the sample's global index (the dropout masks hash it; the rest of row 2 is unused).
  Keys whose token is ``pad_token_id`` are masked out of attention.
- ``targets``: (B, 2P + 1) int32: the P masked positions, their original tokens, and the
  NSP label (0: B follows A, 1: B is random), Hugging Face's convention.
The loss of a sample is its mean MLM cross-entropy over its P predictions plus its NSP
cross-entropy (Hugging Face's ``total_loss`` when every sample has P predictions); the
micro-batch loss is the mean over samples. Only the P masked rows go through the MLM head
(as the original BERT does with ``max_predictions_per_seq``), which changes no gradient.

Dropout (hidden and attention probabilities) uses ``kernels/dropout.py``: masks hash
(seed, global step, sample index, site), so they do not depend on rank or world size.
The training loop tells the model the seed and step through ``bind_step``; evaluation
runs without dropout. Layer norms use the config's ``layer_norm_eps`` (default 1e-12, Hugging
Face's BertConfig default).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from simdist.kernels.attention import mha_backward, mha_forward
from simdist.kernels.dropout import dropout_backward, dropout_forward, sample_keys
from simdist.kernels.embedding_seg import (
    segment_embedding_backward_accumulate,
    segment_embedding_forward,
)
from simdist.kernels.layernorm import (
    layernorm_backward,
    layernorm_forward_eps,
    residual_layernorm_forward_eps,
)
from simdist.kernels.linear_hf import (
    gather_rows_backward,
    gather_rows_forward,
    linear_hf_backward,
    linear_hf_forward,
)
from simdist.kernels.loss import softmax_cross_entropy_backward, softmax_cross_entropy_forward
from simdist.kernels.residual import residual_forward
from simdist.kernels.transformer_act import (
    gelu_erf_backward,
    gelu_erf_forward,
    tanh_backward,
    tanh_forward,
)
from simdist.precision import no_store

from . import bert_costs
from .base import GradientGroup, KernelCost, ParamSpec
from .bert_shapes import (
    EMBED_PARAMS,
    FLOAT_FIELDS,
    HEAD_PARAMS,
    INT_FIELDS,
    LAYER_PARAMS,
    OWN_PACKED,
    PACKED,
    BertConfig,
    activation_bytes,
    activation_shapes,
    arena_layout,
    flops_per_sample,
    num_parameters,
    parameter_specs,
    resolve_config,
    saved_shapes,
    store_layout,
)
from .saved_words import PacksSavedActivations, SavedWords, SavedWordsViews
from .stages import Stage, StagedModel

F32 = np.float32


def build_bert(config) -> Bert:
    """From params.yaml's model section (``simdist.config.BertModelConfig``)."""
    keys = INT_FIELDS + FLOAT_FIELDS
    return Bert(resolve_config(config.preset, **{k: getattr(config, k) for k in keys}))


# ------------------------------------------------------------------ the model
class _Views(SavedWordsViews):
    """Named views of the arena for one micro-batch size B, per layer where the tensor is
    per layer."""

    def __init__(
        self,
        arena: np.ndarray,
        cfg: BertConfig,
        B: int,
        offsets: dict,
        store: tuple[np.ndarray, dict[str, int], int] | None = None,
    ):
        """``store``: mixed precision's (uint16 store, its offsets, half format); the
        arena then holds ``working_copies`` layers of the ``PACKED`` tensors."""
        self.B = B
        self._words: SavedWords | None = None
        if store is not None:
            self._words = SavedWords(store[0], store[1], saved_shapes(cfg, B), store[2])
        for name, (shape, dtype) in activation_shapes(cfg, B, store is not None).items():
            lo = offsets[name]
            n = math.prod(shape) * (2 if dtype == "u8" else 1)
            flat = arena[lo : lo + n]
            if dtype == "i4":
                flat = flat.view(np.int32)
            elif dtype == "u8":
                flat = flat.view(np.uint64)
            arr = flat.reshape(shape)
            if self._words is not None and name in PACKED:  # layer i: working copy i % w
                arr = self._words.working(name, arr)
            elif name in _PER_LAYER:  # a list of per-layer views
                arr = list(arr)
            setattr(self, name, arr)
        T, H = cfg.max_seq_length, cfg.hidden_size
        self.layer_in = [self.x0] + self.h[:-1]
        self.q3 = [a.reshape(B, T, H) for a in self.q]
        self.k3 = [a.reshape(B, T, H) for a in self.k]
        self.v3 = [a.reshape(B, T, H) for a in self.v]
        self.ctx3 = [a.reshape(B, T, H) for a in self.ctx]
        self.emb3 = self.emb.reshape(B, T, H)
        self.dres3 = self.dres.reshape(B, T, H)
        self.dctx3, self.dq3 = self.dctx.reshape(B, T, H), self.dq.reshape(B, T, H)
        self.dk3, self.dv3 = self.dk.reshape(B, T, H), self.dv.reshape(B, T, H)


_PER_LAYER = {
    "q", "k", "v", "att", "ctx", "res1", "a1", "a1_mean", "a1_rstd",
    "inter", "inter_g", "res2", "h", "h_mean", "h_rstd",
}  # fmt: skip


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


class Bert(PacksSavedActivations, StagedModel):
    """The Model protocol (``simdist.models.base``) for BERT pretraining; in mixed
    precision (``set_precision``) it holds its layers' saved activations as 16-bit words."""

    # simdist.kernels modules it calls (warmed before training; tests/test_imports.py)
    kernel_modules = (
        "attention",
        "dropout",
        "embedding_seg",
        "gelu",
        "layernorm",
        "linear_hf",
        "loss",
        "residual",
        "rowops",
        "transformer_act",
    )

    def __init__(self, config: BertConfig):
        self.config = config
        self.name = "bert"
        L = config.num_hidden_layers
        self._layer_names = [
            tuple(f"bert.encoder.layer.{i}.{p}" for p in LAYER_PARAMS) for i in range(L)
        ]
        heads = (*HEAD_PARAMS, EMBED_PARAMS[0])  # the MLM decoder is the word embeddings
        self._stages = [Stage("embeddings", EMBED_PARAMS, ("bert.embeddings.LayerNorm.weight",))]
        self._stages += [Stage(f"layer.{i}", n, n) for i, n in enumerate(self._layer_names)]
        self._stages.append(Stage("heads", heads, heads))
        self._arena: np.ndarray | None = None
        self._batch = 0
        self._offsets: dict[str, int] = {}
        self._views: dict[int, _Views] = {}
        self._saved: _Views | None = None
        self._current: _Views | None = None
        self._seed = 0
        self._step: Callable[[], int] = lambda: 0
        self._dropout = False  # this forward applies dropout (training, p > 0)
        self._store = no_store  # set_precision: round what the kernels store
        self.extra_eval: dict[str, list[float]] = {
            "nsp_accuracy": [0.0, 0.0],
            "nsp_loss": [0.0, 0.0],
        }

    # -------------------------------------------------------------- training-loop hook
    def bind_step(self, seed: int, step: Callable[[], int]) -> None:
        """Dropout masks hash (seed, step(), sample index): the run passes its seed and a
        function returning the global step the next forward belongs to."""
        self._seed, self._step = int(seed), step

    # -------------------------------------------------------------- protocol: sizes
    def parameter_specs(self) -> list[ParamSpec]:
        return parameter_specs(self.config)

    def num_parameters(self) -> int:
        return num_parameters(self.config)

    def activation_bytes(self, batch_size: int) -> int:
        """The arena in float32 words, every layer's tensors (the device's layout)."""
        return activation_bytes(self.config, batch_size)

    def _arena_layout(self, batch_size: int, packed: bool) -> tuple[dict[str, int], int]:
        return arena_layout(self.config, batch_size, packed)

    def _store_layout(self, batch_size: int) -> tuple[dict[str, int], int]:
        return store_layout(self.config, batch_size)

    def flops_per_sample(self) -> int:
        return flops_per_sample(self.config)

    def kernel_costs(self, batch: int, seq: int | None = None) -> list[KernelCost]:
        return bert_costs.kernel_costs(
            self.config,
            batch,
            seq or self.config.max_seq_length,
            EMBED_PARAMS,
            HEAD_PARAMS,
            LAYER_PARAMS,
        )

    def gradient_groups(self) -> list[GradientGroup]:
        """Heads (pooler, MLM transform and bias, NSP), layers last to first, then the
        embeddings: the tied decoder writes the word embeddings' gradient first, hence held."""
        groups = [GradientGroup(HEAD_PARAMS)]
        groups += [GradientGroup(n) for n in reversed(self._layer_names)]
        groups.append(GradientGroup(EMBED_PARAMS, held=True))
        return groups

    # -------------------------------------------------------------- protocol: set-up
    def init_parameters(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """Hugging Face's BERT init: normal(0, 0.02) matrices and embeddings (padding row
        zero), zero biases, LayerNorm weight 1 and bias 0."""
        for spec in self.parameter_specs():
            p = params[spec.name]
            if len(spec.shape) >= 2:
                rng.standard_normal(out=p, dtype=np.float32)
                p *= F32(0.02)
            elif "LayerNorm.weight" in spec.name:
                p.fill(1.0)
            else:
                p.fill(0.0)
            if spec.name == EMBED_PARAMS[0]:  # one tensor at a time (ZeRO-3 initialises so)
                p[self.config.pad_token_id] = 0.0

    def allocate(self, batch_size: int) -> None:
        self._allocate_arena(batch_size)
        self._views, self._saved, self._current = {}, None, None

    # -------------------------------------------------------------- stages (forward, backward
    # and evaluate: StagedModel's loops over them)
    def stages(self) -> list[Stage]:
        """Embeddings, layers 0..L-1, heads: what forward runs in order, backward in reverse.

        The heads (MLM transform and tied decoder, pooler, NSP) read the word embeddings
        again; the embeddings' backward reads only their LayerNorm weight (its scatter-add
        reads no weights), for which ZeRO-3 and 16-bit weights load the embeddings' whole
        gradient group, their unit of loading (weight streaming streams just the weight)."""
        return list(self._stages)

    def begin(self, inputs: np.ndarray, targets: np.ndarray, training: bool = True) -> None:
        """Load a micro-batch for ``forward_stage``; ``training``: apply dropout (when the
        config has it), whose masks hash the step ``bind_step`` gives."""
        v = self._load_batch(inputs, targets)
        cfg = self.config
        self._dropout = training and (
            cfg.hidden_dropout_prob > 0 or cfg.attention_probs_dropout_prob > 0
        )
        if self._dropout:
            sample_keys(self._seed, self._step(), inputs[:, 2, 0], v.keys)
        self._current = v
        self._saved = None  # the arena is being overwritten: no backward until the heads ran

    def forward_stage(self, k: int, params) -> float | None:
        """Run stage ``k``'s forward; the heads (last stage) return the mean sample loss."""
        v = self._current
        if v is None:
            raise RuntimeError("forward_stage without begin(inputs, targets)")
        L = self.config.num_hidden_layers
        if k == 0:
            self._embed_forward(v, params)
        elif k <= L:
            self._layer_forward(v, params, k - 1)
        else:
            self._heads_forward(v, params)
            self._saved = v
            return float(self._sample_losses(v).mean(dtype=np.float64))
        return None

    def eval_stats(self) -> tuple[float, int]:
        """(sum of the MLM token losses, correct MLM predictions) of the last forward; its
        NSP correct predictions and loss sum are added to ``extra_eval``."""
        v = self._current
        if v is None:
            raise RuntimeError("eval_stats without a forward")
        loss_sum = float(v.mlm_losses.sum(dtype=np.float64))
        correct = int(np.count_nonzero(v.logits.argmax(axis=1) == v.labels))
        nsp_ok = int(np.count_nonzero(v.nsp_logits.argmax(axis=1) == v.nsp_labels))
        nsp_loss = float(v.nsp_losses.sum(dtype=np.float64))
        for key, num in (("nsp_accuracy", nsp_ok), ("nsp_loss", nsp_loss)):
            acc = self.extra_eval[key]
            acc[0] += num
            acc[1] += v.B
        return loss_sum, correct

    def backward_stage(self, k: int, params, grads, dloss: float) -> None:
        """Stage ``k``'s backward (from the last stage down to 0 after the forward); each
        stage finishes its gradient group with ``grads.done``."""
        v = self._saved
        if v is None:
            raise RuntimeError("backward without a preceding forward")
        L = self.config.num_hidden_layers
        if k == L + 1:
            self._heads_backward(v, params, grads, dloss)  # finishes HEAD_PARAMS
        elif k >= 1:
            self._layer_backward(v, params, grads, k - 1)
            grads.done(self._layer_names[k - 1])
        else:
            self._embed_backward(v, params, grads)
            grads.done(EMBED_PARAMS)

    # -------------------------------------------------------------- pipeline boundaries
    def stage_input(self, k: int) -> list[np.ndarray]:
        """What stage ``k`` (>= 1) reads from the stages before it, as a view of the loaded
        micro-batch's arena: the previous stage's output (the embeddings' x0 before layer 0,
        a layer's output h after it; the heads gather their rows from the last h). A
        pipeline sends it after stage k - 1's forward and receives it before stage k's."""
        v = self._current
        if v is None:
            raise RuntimeError("stage_input without begin(inputs, targets)")
        L = self.config.num_hidden_layers
        return [v.layer_in[k - 1] if k <= L else v.h[L - 1]]

    def stage_input_grad(self, k: int) -> np.ndarray:
        """The gradient of stage ``k``'s input after ``backward_stage(k)``; also where
        ``backward_stage(k - 1)`` starts from (one hidden-state gradient buffer)."""
        if self._current is None:
            raise RuntimeError("stage_input_grad without begin(inputs, targets)")
        return self._current.dres

    def hold_for_backward(self) -> None:
        """A pipeline stage that ends before the heads: keep this micro-batch's activations
        for its backward (the heads' forward does this otherwise)."""
        self._saved = self._current

    def boundary_numel(self, k: int) -> tuple[int, int]:
        """Elements per sequence crossing the boundary before stage ``k``: (forward
        ``stage_input(k)``, backward ``stage_input_grad(k)``), one hidden state each way."""
        n = self.config.max_seq_length * self.config.hidden_size
        return n, n

    def stage_flops(self) -> list[int]:
        """Forward + backward FLOPs of each stage per sequence, as ``flops_per_sample``
        counts them (they add up to it): the embeddings none, a layer 3 T (8 H^2 + 4 H I +
        4 T H), the heads the pooler, NSP, MLM transform and decoder. Pipelines balance
        their split by these."""
        c = self.config
        L, H, I, V = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
        T, P = c.max_seq_length, c.max_predictions_per_seq
        layer = 3 * T * (2 * (4 * H * H + 2 * H * I) + 4 * T * H)
        heads = 3 * (2 * (H * H + 2 * H) + P * 2 * (H * H + H * V))
        return [0, *[layer] * L, heads]

    # -------------------------------------------------------------- internals
    def _sample_losses(self, v: _Views) -> np.ndarray:
        P = self.config.max_predictions_per_seq
        return v.mlm_losses.reshape(v.B, P).mean(axis=1, dtype=np.float64) + v.nsp_losses

    def _load_batch(self, inputs: np.ndarray, targets: np.ndarray) -> _Views:
        cfg = self.config
        T, P, V = cfg.max_seq_length, cfg.max_predictions_per_seq, cfg.vocab_size
        if self._arena is None:
            raise ValueError("call allocate(batch_size) before forward/evaluate")
        if inputs.ndim != 3 or inputs.shape[1:] != (3, T):
            raise ValueError(f"BERT inputs must be (B, 3, {T}); got {inputs.shape}")
        B = inputs.shape[0]
        if targets.shape != (B, 2 * P + 1):
            raise ValueError(f"BERT targets must be (B, {2 * P + 1}); got {targets.shape}")
        if B > self._batch:
            raise ValueError(f"batch of {B} sequences, but allocate({self._batch}) was called")
        v = self._views.get(B)
        if v is None:
            v = self._views[B] = _Views(self._arena, cfg, B, self._offsets, self._store_of())
            v.row_base = (np.arange(B, dtype=np.int32) * T)[:, None]  # sample b's row 0
        tok, typ, pos, lab = inputs[:, 0], inputs[:, 1], targets[:, :P], targets[:, P : 2 * P]
        # the kernels index with these unchecked: a bad id would touch wild memory
        for what, a, hi in (
            ("token ids", tok, V),
            ("token type ids", typ, cfg.type_vocab_size),
            ("masked positions", pos, T),
            ("masked labels", lab, V),
            ("NSP labels", targets[:, 2 * P], 2),
        ):
            if a.size and (a.min() < 0 or a.max() >= hi):
                raise ValueError(f"BERT {what} must lie in [0, {hi})")
        np.copyto(v.tokens, tok, casting="same_kind")
        np.copyto(v.types, typ, casting="same_kind")
        np.add(pos, v.row_base, out=v.rows.reshape(B, P), casting="same_kind")
        np.copyto(v.cls_rows, v.row_base[:, 0])  # [CLS] rows (no per-step arange)
        np.copyto(v.labels.reshape(B, P), lab, casting="same_kind")
        np.copyto(v.nsp_labels, targets[:, 2 * P], casting="same_kind")
        np.not_equal(v.tokens, cfg.pad_token_id, out=v.keep, casting="unsafe")
        return v

    def _rates(self) -> tuple[np.float32, np.float32]:
        """(hidden, attention-probability) dropout rates of this pass (0: none)."""
        cfg = self.config
        if not self._dropout:
            return F32(0.0), F32(0.0)
        return F32(cfg.hidden_dropout_prob), F32(cfg.attention_probs_dropout_prob)

    def _embed_forward(self, v: _Views, params) -> None:
        ph, _ = self._rates()
        st = self._store  # mixed precision: what a kernel writes is stored half (else no-op)
        segment_embedding_forward(v.emb3, v.tokens, v.types, *(params[n] for n in EMBED_PARAMS[:3]))
        st(v.emb)
        layernorm_forward_eps(
            v.x0, v.emb_mean, v.emb_rstd, v.emb,
            params["bert.embeddings.LayerNorm.weight"], params["bert.embeddings.LayerNorm.bias"],
            F32(self.config.layer_norm_eps),
        )  # fmt: skip
        if ph > 0:
            dropout_forward(_rows(v.x0, v.B), _rows(v.x0, v.B), v.keys, 0, ph)
        st(v.x0)

    def _layer_forward(self, v: _Views, params, i: int) -> None:
        ph, pa = self._rates()
        st = self._store
        eps, NH = F32(self.config.layer_norm_eps), self.config.num_attention_heads
        (qw, qb, kw, kb, vw, vb, ow, ob, l1w, l1b, iw, ib, o2w, o2b, l2w, l2b) = self._layer_names[
            i
        ]
        if i:
            v.pack(i - 1, ("h",))  # layer i - 1's output, final (perhaps received)
        x = v.layer_in[i]
        linear_hf_forward(v.q[i], x, params[qw], params[qb])
        linear_hf_forward(v.k[i], x, params[kw], params[kb])
        linear_hf_forward(v.v[i], x, params[vw], params[vb])
        st(v.q[i], v.k[i], v.v[i])
        mha_forward(
            v.ctx3[i], v.att[i], v.q3[i], v.k3[i], v.v3[i], v.keep, v.att_scratch,
            v.att_dscores, NH, False, v.keys, _site(i, 0), pa,
        )  # fmt: skip
        st(v.ctx[i])  # the probabilities stay float32, as a fused attention keeps them
        linear_hf_forward(v.res1[i], v.ctx[i], params[ow], params[ob])
        if ph > 0:
            dropout_forward(_rows(v.res1[i], v.B), _rows(v.res1[i], v.B), v.keys, _site(i, 1), ph)
        st(v.res1[i])
        residual_layernorm_forward_eps(
            v.res1[i], v.a1[i], v.a1_mean[i], v.a1_rstd[i], x, v.res1[i], params[l1w],
            params[l1b], eps,
        )  # fmt: skip
        st(v.res1[i], v.a1[i])
        linear_hf_forward(v.inter[i], v.a1[i], params[iw], params[ib])
        st(v.inter[i])
        gelu_erf_forward(_flat(v.inter_g[i]), _flat(v.inter[i]))
        st(v.inter_g[i])
        linear_hf_forward(v.res2[i], v.inter_g[i], params[o2w], params[o2b])
        if ph > 0:
            dropout_forward(_rows(v.res2[i], v.B), _rows(v.res2[i], v.B), v.keys, _site(i, 2), ph)
        st(v.res2[i])
        residual_layernorm_forward_eps(
            v.res2[i], v.h[i], v.h_mean[i], v.h_rstd[i], v.a1[i], v.res2[i], params[l2w],
            params[l2b], eps,
        )  # fmt: skip
        st(v.res2[i], v.h[i])
        v.pack(i, OWN_PACKED)  # before layer i + 1 reuses the working copies

    def _heads_forward(self, v: _Views, params) -> None:
        st = self._store
        eps = F32(self.config.layer_norm_eps)
        out = v.h[self.config.num_hidden_layers - 1]
        # MLM head on the masked rows; decoder tied to the word embeddings
        gather_rows_forward(v.mlm_in, out, v.rows)
        linear_hf_forward(
            v.t_dense, v.mlm_in, params["cls.predictions.transform.dense.weight"],
            params["cls.predictions.transform.dense.bias"],
        )  # fmt: skip
        st(v.t_dense)
        gelu_erf_forward(_flat(v.t_gelu), _flat(v.t_dense))
        st(v.t_gelu)
        layernorm_forward_eps(
            v.t_ln, v.t_mean, v.t_rstd, v.t_gelu,
            params["cls.predictions.transform.LayerNorm.weight"],
            params["cls.predictions.transform.LayerNorm.bias"], eps,
        )  # fmt: skip
        st(v.t_ln)
        linear_hf_forward(v.logits, v.t_ln, params[EMBED_PARAMS[0]], params["cls.predictions.bias"])
        st(v.logits)  # the loss reads them in float32
        softmax_cross_entropy_forward(v.mlm_losses, v.probs, v.logits, v.labels)
        # pooler ([CLS] row) and NSP
        gather_rows_forward(v.cls, out, v.cls_rows)
        linear_hf_forward(
            v.pooled_pre,
            v.cls,
            params["bert.pooler.dense.weight"],
            params["bert.pooler.dense.bias"],
        )
        st(v.pooled_pre)
        tanh_forward(_flat(v.pooled), _flat(v.pooled_pre))
        st(v.pooled)
        linear_hf_forward(
            v.nsp_logits, v.pooled, params["cls.seq_relationship.weight"],
            params["cls.seq_relationship.bias"],
        )  # fmt: skip
        st(v.nsp_logits)
        softmax_cross_entropy_forward(v.nsp_losses, v.nsp_probs, v.nsp_logits, v.nsp_labels)

    def _heads_backward(self, v: _Views, params, g, dloss: float) -> None:
        """MLM (per-sample loss = mean of its P token losses) and NSP; finishes the heads'
        gradient group, then leaves d(last layer's output) in ``dres``."""
        P = self.config.max_predictions_per_seq
        st = self._store
        wte = params[EMBED_PARAMS[0]]
        softmax_cross_entropy_backward(v.probs, v.probs, v.labels, F32(dloss / P))
        st(v.probs)
        linear_hf_backward(
            v.dm1, g[EMBED_PARAMS[0]], g["cls.predictions.bias"], v.probs, v.t_ln, wte
        )
        st(v.dm1)
        layernorm_backward(
            v.dm2,
            g["cls.predictions.transform.LayerNorm.weight"],
            g["cls.predictions.transform.LayerNorm.bias"],
            v.dm1,
            v.t_gelu,
            params["cls.predictions.transform.LayerNorm.weight"],
            v.t_mean,
            v.t_rstd,
        )
        st(v.dm2)
        gelu_erf_backward(_flat(v.dm1), _flat(v.t_dense), _flat(v.dm2))
        st(v.dm1)
        linear_hf_backward(
            v.dm2,
            g["cls.predictions.transform.dense.weight"],
            g["cls.predictions.transform.dense.bias"],
            v.dm1,
            v.mlm_in,
            params["cls.predictions.transform.dense.weight"],
        )
        st(v.dm2)
        softmax_cross_entropy_backward(v.nsp_probs, v.nsp_probs, v.nsp_labels, F32(dloss))
        st(v.nsp_probs)
        linear_hf_backward(
            v.db1,
            g["cls.seq_relationship.weight"],
            g["cls.seq_relationship.bias"],
            v.nsp_probs,
            v.pooled,
            params["cls.seq_relationship.weight"],
        )
        st(v.db1)
        tanh_backward(_flat(v.db2), _flat(v.pooled), _flat(v.db1))
        st(v.db2)
        linear_hf_backward(
            v.db1,
            g["bert.pooler.dense.weight"],
            g["bert.pooler.dense.bias"],
            v.db2,
            v.cls,
            params["bert.pooler.dense.weight"],
        )
        st(v.db1)
        g.done(HEAD_PARAMS)  # before the scatter into dres: their reduction starts sooner
        v.dres.fill(0.0)
        gather_rows_backward(v.dres, v.dm2, v.rows)
        gather_rows_backward(v.dres, v.db1, v.cls_rows)
        st(v.dres)

    def _embed_backward(self, v: _Views, params, g) -> None:
        """``dres`` holds d x0."""
        ph, _ = self._rates()
        st = self._store
        if ph > 0:
            dropout_backward(_rows(v.dres, v.B), _rows(v.dres, v.B), v.keys, 0, ph)
            st(v.dres)
        layernorm_backward(
            v.dln,
            g["bert.embeddings.LayerNorm.weight"],
            g["bert.embeddings.LayerNorm.bias"],
            v.dres,
            v.emb,
            params["bert.embeddings.LayerNorm.weight"],
            v.emb_mean,
            v.emb_rstd,
        )
        st(v.dln)
        dwpe, dwtt = g[EMBED_PARAMS[1]], g[EMBED_PARAMS[2]]
        dwpe.fill(0.0)
        dwtt.fill(0.0)
        segment_embedding_backward_accumulate(
            g[EMBED_PARAMS[0]], dwpe, dwtt, v.dln.reshape(v.B, -1, self.config.hidden_size),
            v.tokens, v.types, self.config.pad_token_id,
        )  # fmt: skip

    def _layer_backward(self, v: _Views, params, g, i: int) -> None:
        """``dres`` holds d(layer i's output); leaves d(its input) there."""
        ph, pa = self._rates()
        cfg = self.config
        (qw, qb, kw, kb, vw, vb, ow, ob, l1w, l1b, iw, ib, o2w, o2b, l2w, l2b) = self._layer_names[
            i
        ]
        B = v.B
        st = self._store
        v.unpack(i, OWN_PACKED)
        if i:
            v.unpack(i - 1, ("h",))  # layer i's input (layer_in)
        # h = LN2(res2), res2 = a1 + drop(dense(gelu(dense(a1)))); dres = d h
        layernorm_backward(
            v.dln, g[l2w], g[l2b], v.dres, v.res2[i], params[l2w], v.h_mean[i], v.h_rstd[i]
        )
        st(v.dln)
        if ph > 0:
            dropout_backward(_rows(v.dres, B), _rows(v.dln, B), v.keys, _site(i, 2), ph)
            st(v.dres)
            d_out = v.dres
        else:
            d_out = v.dln
        linear_hf_backward(v.dinter_g, g[o2w], g[o2b], d_out, v.inter_g[i], params[o2w])
        st(v.dinter_g)
        gelu_erf_backward(_flat(v.dinter), _flat(v.inter[i]), _flat(v.dinter_g))
        st(v.dinter)
        linear_hf_backward(v.dres, g[iw], g[ib], v.dinter, v.a1[i], params[iw])
        residual_forward(_flat(v.dres), _flat(v.dres), _flat(v.dln))  # + the skip path
        st(v.dres)
        # a1 = LN1(res1), res1 = x + drop(dense(attn(x)))
        layernorm_backward(
            v.dln, g[l1w], g[l1b], v.dres, v.res1[i], params[l1w], v.a1_mean[i], v.a1_rstd[i]
        )
        st(v.dln)
        if ph > 0:
            dropout_backward(_rows(v.dres, B), _rows(v.dln, B), v.keys, _site(i, 1), ph)
            st(v.dres)
            d_out = v.dres
        else:
            d_out = v.dln
        linear_hf_backward(v.dctx, g[ow], g[ob], d_out, v.ctx[i], params[ow])
        st(v.dctx)
        mha_backward(
            v.dq3, v.dk3, v.dv3, v.dctx3, v.q3[i], v.k3[i], v.v3[i], v.att[i], v.att_scratch,
            v.att_dscores, cfg.num_attention_heads, False, v.keys, _site(i, 0), pa,
        )  # fmt: skip
        st(v.dq, v.dk, v.dv)
        x = v.layer_in[i]
        linear_hf_backward(v.dres, g[qw], g[qb], v.dq, x, params[qw])
        linear_hf_backward(v.dctx, g[kw], g[kb], v.dk, x, params[kw])
        residual_forward(_flat(v.dres), _flat(v.dres), _flat(v.dctx))
        linear_hf_backward(v.dctx, g[vw], g[vb], v.dv, x, params[vw])
        residual_forward(_flat(v.dres), _flat(v.dres), _flat(v.dctx))
        residual_forward(_flat(v.dres), _flat(v.dres), _flat(v.dln))  # + the skip path
        st(v.dres)


def _site(layer: int, which: int) -> int:
    """Dropout site of a layer: 0 attention probabilities, 1 attention output, 2 FFN output
    (site 0 of all is the embeddings' dropout, hence the + 1)."""
    return 1 + 3 * layer + which


def _rows(a: np.ndarray, B: int) -> np.ndarray:
    """(N, H) with N = B * T as (B, T * H): one row per sample for the dropout kernels."""
    return a.reshape(B, -1)
