"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017), llm.c-style.

The sibling of ``t5.py`` and ``bert.py`` (configuration, presets and arena layout in
``transformer_shapes.py``, the kernel list in ``transformer_costs.py``): an encoder-decoder
on the same kernels, parameters in ``torch.nn.Transformer``'s state-dict names and layouts
(``in_proj_weight`` (3D, D) holds q, k and v; ``nn.Linear`` weights (out, in) with biases)
plus ``embedding.weight``, the one table shared by source, target and output projection
(section 3.4). Embeddings are multiplied by sqrt(d_model) and added to sinusoidal
positions (``kernels/positions.py``); layers are post-LN as in the paper,
x -> LN(x + drop(attn(x))) [-> LN(. + drop(cross(., enc)))] -> LN(. + drop(ffn(.))), the
FFN ReLU; each stack ends in a LayerNorm as ``nn.Transformer``'s does (the paper's text
names none; it is the reference the parity test builds). LayerNorm eps 1e-5, attention
scaled by 1/sqrt(d_k). The output projection is the shared table, unscaled; the loss is
label-smoothed cross-entropy (``kernels/label_smoothing.py``, eps 0.1).

Inputs (``simdist.data.transformer`` makes them): ``inputs`` (B, Te + 2) int32: the
source ids (pad 0), the sample's global index (the dropout masks hash it) and a flag:
1 = evaluation also decodes this sample greedily. ``targets`` (B, Td) int32: the target
ids ending in EOS, then padding; the decoder reads BOS followed by the targets shifted
right. Padded source keys are masked out of self- and cross-attention; padded targets
carry no loss (the decoder's causal mask keeps them out of every real position). A
sample's loss is the mean over its real targets; the micro-batch loss is the mean over
samples.

Dropout (``dropout`` on the embeddings, attention probabilities, every sublayer output
and inside the FFN, where ``nn.Transformer`` puts it) hashes (seed, global step, sample
index, site): never the rank or world size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from simdist.kernels.activation import relu_backward, relu_forward
from simdist.kernels.attention import mha_attend_backward, mha_attend_forward
from simdist.kernels.dropout import dropout_backward, dropout_forward, sample_keys
from simdist.kernels.label_smoothing import (
    smoothed_cross_entropy_backward,
    smoothed_cross_entropy_forward,
)
from simdist.kernels.layernorm import (
    layernorm_backward,
    layernorm_forward,
    residual_layernorm_forward,
)
from simdist.kernels.linear_hf import (
    linear_hf_backward,
    linear_hf_backward_accumulate,
    linear_hf_forward,
)
from simdist.kernels.linear_nobias import linear_nobias_backward, linear_nobias_forward
from simdist.kernels.positions import (
    scaled_embedding_backward_accumulate,
    scaled_embedding_forward,
    sinusoid_table,
)
from simdist.kernels.residual import residual_forward
from simdist.precision import no_store

from . import transformer_costs
from .base import GradientGroup, KernelCost, ParamSpec
from .saved_words import PacksSavedActivations, SavedWords, SavedWordsViews
from .stages import Stage, StagesByKind
from .transformer_shapes import (  # noqa: F401  (re-exported: tests and plan mode import them)
    EMBED,
    FIELDS,
    PER_LAYER,
    TransformerConfig,
    activation_bytes,
    activation_shapes,
    arena_layout,
    final_norm_names,
    flops_per_sample,
    layer_names,
    num_parameters,
    own_packed,
    packed_names,
    parameter_specs,
    plan_models,
    plan_shape,
    resolve_config,
    saved_shapes,
    sites,
    store_layout,
)

F32 = np.float32


def build_transformer(config) -> Transformer:
    """From params.yaml's model section (``simdist.model_config.TransformerModelConfig``)."""
    return Transformer(resolve_config(config.preset, **{k: getattr(config, k) for k in FIELDS}))


class Views(SavedWordsViews):
    """Named views of the arena for one micro-batch size B (per-layer tensors as lists)."""

    def __init__(
        self,
        arena: np.ndarray,
        cfg: TransformerConfig,
        B: int,
        offsets: dict,
        store: tuple[np.ndarray, dict[str, int], int] | None = None,
    ):
        """``store``: mixed precision's (uint16 store, its offsets, half format); the
        arena then holds ``working_copies`` layers of the packed tensors."""
        self.B = B
        Te, Td = cfg.max_seq_length, cfg.target_length
        self.Ne, self.Nd = B * Te, B * Td
        self.enc_own, self.dec_own = own_packed()
        self._words: SavedWords | None = None
        if store is not None:
            self._words = SavedWords(store[0], store[1], saved_shapes(cfg, B), store[2])
        packed = packed_names() if store is not None else ()
        for name, (shape, dtype) in activation_shapes(cfg, B, store is not None).items():
            lo = offsets[name]
            n = int(np.prod(shape)) * (2 if dtype == "u8" else 1)
            flat = arena[lo : lo + n]
            if dtype == "i4":
                flat = flat.view(np.int32)
            elif dtype == "u8":
                flat = flat.view(np.uint64)
            arr = flat.reshape(shape)
            if name in packed:  # layer i: working copy i % w
                arr = self._words.working(name, arr)
            elif name in PER_LAYER:
                arr = list(arr)
            setattr(self, name, arr)
        self.ds_ee = self.att_ds[: Te * Te].reshape(Te, Te)
        self.ds_dd = self.att_ds[: Td * Td].reshape(Td, Td)
        self.ds_de = self.att_ds[: Td * Te].reshape(Td, Te)
        self.dec_keep.fill(1.0)  # causal: a real position never sees a padded one
        sinusoid_table(self.pe)
        self._te, self._td = Te, Td

    def enc3(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(self.B, self._te, -1)

    def dec3(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(self.B, self._td, -1)


def _qkv(w: np.ndarray, D: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The q, k, v row blocks of an in_proj weight (3D, D) or bias (3D,): contiguous views."""
    return w[:D], w[D : 2 * D], w[2 * D :]


class Transformer(PacksSavedActivations, StagesByKind):
    """The Model protocol (``simdist.models.base``) for the AIAYN encoder-decoder, as a
    model of stages (``simdist.models.stages``): ZeRO-3, weight streaming and mixed
    precision's 16-bit weights run it as they run T5; in mixed precision it holds its
    layers' saved activations as 16-bit words."""

    # simdist.kernels modules it calls (warmed before training; tests/test_imports.py)
    kernel_modules = (
        "activation",
        "attention",
        "dropout",
        "label_smoothing",
        "layernorm",
        "linear_hf",
        "linear_nobias",
        "positions",
        "residual",
        "rowops",
    )

    def __init__(self, config: TransformerConfig):
        self.config = config
        self.name = "transformer"
        self._enc = [layer_names("encoder", i) for i in range(config.num_encoder_layers)]
        self._dec = [layer_names("decoder", j) for j in range(config.num_decoder_layers)]
        shared, enc_norm = (EMBED,), final_norm_names("encoder")
        head = (*final_norm_names("decoder"), EMBED)
        # (stage, which forward / backward method runs it, with which layer index)
        plan = [(Stage("encoder.embed", shared, ()), ("encoder_embed", 0))]
        plan += [(Stage(f"encoder.{i}", n, n), ("encoder", i)) for i, n in enumerate(self._enc)]
        plan.append((Stage("encoder.norm", enc_norm, enc_norm), ("encoder_norm", 0)))
        plan.append((Stage("decoder.embed", shared, ()), ("decoder_embed", 0)))
        plan += [(Stage(f"decoder.{j}", n, n), ("decoder", j)) for j, n in enumerate(self._dec)]
        plan.append((Stage("head", head, head), ("head", 0)))
        self._stages = [s for s, _ in plan]
        self._kinds = [k for _, k in plan]
        self._current: Views | None = None
        self._encoded = False  # greedy decoding: the encoder's output is already computed
        self._arena: np.ndarray | None = None
        self._batch = 0
        self._offsets: dict[str, int] = {}
        self._views: dict[int, Views] = {}
        self._saved: Views | None = None
        self._counts = np.ones(1)  # real targets per sample of the current batch
        self._seed = 0
        self._step: Callable[[], int] = lambda: 0
        self._p = F32(0.0)  # this forward's dropout probability (0 in evaluation)
        self._keys = np.zeros(1, np.uint64)
        D = config.d_model
        self._store = no_store  # set_precision: round what the kernels store
        self._emb_scale = F32(np.sqrt(np.float64(D)))
        self._att_scale = F32(1.0) / np.sqrt(F32(config.head_size))
        self.extra_eval: dict[str, list[float]] = {
            "token_accuracy": [0.0, 0.0],
            "token_loss": [0.0, 0.0],
            "exact_match": [0.0, 0.0],
            "greedy_token_accuracy": [0.0, 0.0],
        }

    def bind_step(self, seed: int, step: Callable[[], int]) -> None:
        """Dropout masks hash (seed, step(), sample index)."""
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
        return transformer_costs.kernel_costs(self.config, batch, self.gradient_groups())

    def gradient_groups(self) -> list[GradientGroup]:
        """The decoder's final norm, decoder layers last to first, the encoder's final
        norm, encoder layers last to first, then the shared embedding: written first by
        the output projection and last by the encoder's embedding, hence held."""
        groups = [GradientGroup(final_norm_names("decoder"))]
        groups += [GradientGroup(n) for n in reversed(self._dec)]
        groups.append(GradientGroup(final_norm_names("encoder")))
        groups += [GradientGroup(n) for n in reversed(self._enc)]
        groups.append(GradientGroup((EMBED,), held=True))
        return groups

    # -------------------------------------------------------------- protocol: set-up
    def init_parameters(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """``nn.Transformer``'s init: Xavier-uniform matrices, zero biases, norms 1 and 0;
        the shared embedding N(0, d_model^-1/2), so that scaled by sqrt(d_model) it enters
        with unit variance (as fairseq's Transformer initialises a tied table)."""
        D = self.config.d_model
        for spec in self.parameter_specs():
            p = params[spec.name]
            if spec.name == EMBED:
                rng.standard_normal(out=p, dtype=np.float32)
                p *= F32(D**-0.5)
            elif len(spec.shape) == 2:
                fan_out, fan_in = spec.shape
                a = np.sqrt(6.0 / (fan_in + fan_out))
                p[...] = rng.uniform(-a, a, spec.shape).astype(np.float32)
            elif ".norm" in spec.name and spec.name.endswith(".weight"):
                p.fill(1.0)
            else:
                p.fill(0.0)

    def allocate(self, batch_size: int) -> None:
        self._allocate_arena(batch_size)
        self._views, self._saved, self._current = {}, None, None

    # -------------------------------------------------------------- stages (forward, backward
    # and evaluate: StagedModel's loops over them, StagesByKind's dispatch)
    # kernel costs (``transformer_costs``) whose names do not start with their stage's name
    kernel_stages = {
        "encoder.dropout": "encoder.embed",
        "decoder.dropout": "decoder.embed",
        "decoder.norm": "head",
    }

    def stages(self) -> list[Stage]:
        """The encoder's embedding, layers and final norm, then the decoder's embedding,
        layers and head (final norm, output projection, loss): forward in order, backward
        in reverse. The shared table is read by both embeddings and the output projection;
        the embeddings' backward reads no weights. A decoder layer reads the encoder's output
        (its cross-attention keys and values) and adds to its gradient, which the encoder's
        final norm takes back through."""
        return list(self._stages)

    def begin(self, inputs: np.ndarray, targets: np.ndarray, training: bool = True) -> None:
        """Load a micro-batch for ``forward_stage``; ``training``: apply dropout (when the
        config has it), whose masks hash the step ``bind_step`` gives."""
        v = self._load_batch(inputs, targets)
        self._p = F32(self.config.dropout) if training else F32(0.0)
        if self._p > 0:
            sample_keys(self._seed, self._step(), inputs[:, -2], v.keys)
        self._scratch = v.scratch
        self._current = v
        self._saved = None  # the arena is being overwritten: no backward until the head ran

    def _skips(self, kind: str) -> bool:
        """Greedy decoding after its first position: this source's encoder output is in
        the arena already."""
        return self._encoded and kind.startswith("encoder")

    def eval_stats(self) -> tuple[float, int]:
        """(sum of the per-token losses, correctly predicted tokens) over the real targets
        of the last forward; ``extra_eval``'s token metrics accumulate the same per token."""
        v = self._current
        if v is None:
            raise RuntimeError("eval_stats without a forward")
        real = v.labels != self.config.pad_token_id
        ok = int(np.count_nonzero((v.logits.argmax(axis=1) == v.labels) & real))
        loss_sum = float(v.losses.sum(dtype=np.float64))
        n = int(np.count_nonzero(real))
        for key, num in (("token_accuracy", ok), ("token_loss", loss_sum)):
            self.extra_eval[key][0] += num
            self.extra_eval[key][1] += n
        return loss_sum, ok

    def evaluate(self, params, inputs: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
        """Teacher-forced sums over the real targets (``eval_stats``, chunk by chunk); then
        ``score_decoding`` (greedy exact match of the flagged samples: ``extra_eval``'s
        {metric: [sum, count]}, zeroed and reduced over the ranks by the run)."""
        loss_sum, correct = super().evaluate(params, inputs, targets)
        self.score_decoding(inputs, targets, lambda: self._forward_pass(params))
        return loss_sum, correct

    # -------------------------------------------------------------- greedy decoding
    def decode_passes(self, inputs: np.ndarray) -> int:
        """The most forward passes ``score_decoding`` runs on this evaluation batch: one
        per target position for each chunk of flagged samples (fewer when a chunk's rows
        all end early). Weight streaming streams the weights for this many."""
        chunks = -(-int(np.count_nonzero(inputs[:, -1])) // self._batch)
        return chunks * self.config.target_length

    def score_decoding(
        self, inputs: np.ndarray, targets: np.ndarray, forward: Callable[[], None]
    ) -> int:
        """Greedy decoding of the samples flagged in ``inputs[:, -1]``, in chunks of the
        allocated micro-batch, scored into ``extra_eval``: ``exact_match`` (the whole target
        reproduced) and ``greedy_token_accuracy`` (real target tokens decoded right, in
        place); ``forward()`` runs one evaluation forward over the stages (``_greedy``).
        Returns the passes run."""
        flagged = np.flatnonzero(inputs[:, -1])
        pad, passes = self.config.pad_token_id, 0
        for lo in range(0, flagged.size, self._batch):
            rows = flagged[lo : lo + self._batch]
            decoded, n = self._greedy(inputs[rows], forward)
            right, real = decoded == targets[rows], targets[rows] != pad
            scores = (
                ("exact_match", np.count_nonzero(right.all(axis=1)), rows.size),
                ("greedy_token_accuracy", np.count_nonzero(right & real), np.count_nonzero(real)),
            )
            for key, num, den in scores:
                self.extra_eval[key][0] += float(num)
                self.extra_eval[key][1] += int(den)
            passes += n
        self._saved = None
        return passes

    def greedy_decode(
        self, params, source: np.ndarray, forced: np.ndarray | None = None
    ) -> np.ndarray:
        """The target_length tokens greedy decoding emits for one source (Te ids), PAD
        after the first EOS; ``forced`` (Td ids): feed these as the previous tokens instead
        (every position's argmax is returned). See ``_greedy``."""
        Te = self.config.max_seq_length
        if self._arena is None:
            self.allocate(1)
        row = np.zeros((1, Te + 2), np.int32)
        row[0, :Te] = source
        forced = None if forced is None else forced[None]
        return self._greedy(row, lambda: self._forward_pass(params), forced)[0][0]

    def _greedy(
        self, inputs: np.ndarray, forward: Callable[[], None], forced: np.ndarray | None = None
    ) -> tuple[np.ndarray, int]:
        """Greedy decoding of a chunk of sources (``inputs`` rows as the data gives them):
        position by position, a forward pass over the stages with the tokens emitted so far
        as the decoder's input; the causal mask keeps the later (padding) positions out of
        the one read. Every pass is a whole evaluation forward through ``forward_stage``
        (``forward()``), so ZeRO-3's gathers, 16-bit weights' windows and weight
        streaming's window serve it as they serve evaluation; the encoder runs once per
        chunk (its output stays in the arena). Returns the tokens and the passes run."""
        cfg = self.config
        B, Td, pad = inputs.shape[0], cfg.target_length, cfg.pad_token_id
        out = np.full((B, Td), pad, np.int32)
        previous = np.full((B, Td), pad, np.int32)  # the decoder reads BOS + previous[:, :-1]
        live = np.ones(B, bool)
        passes = 0
        try:
            for pos in range(Td):
                self.begin(inputs, previous, training=False)
                forward()
                passes += 1
                self._encoded = True
                logits = self._current.logits.reshape(B, Td, -1)[:, pos]
                tokens = logits.argmax(axis=1).astype(np.int32)
                if forced is not None:
                    out[:, pos] = tokens
                    previous[:, pos] = forced[:, pos]
                    continue
                out[live, pos] = tokens[live]
                live &= tokens != cfg.eos_token_id
                previous[:, pos] = tokens
                if not live.any():
                    break
        finally:
            self._encoded = False
        self._saved = None
        return out, passes

    # -------------------------------------------------------------- internals
    def _sample_losses(self, v: Views) -> np.ndarray:
        return v.losses.reshape(v.B, -1).sum(axis=1, dtype=np.float64) / self._counts

    def _load_batch(self, inputs: np.ndarray, targets: np.ndarray) -> Views:
        cfg = self.config
        Te, Td, V, pad = cfg.max_seq_length, cfg.target_length, cfg.vocab_size, cfg.pad_token_id
        if self._arena is None:
            raise ValueError("call allocate(batch_size) before forward/evaluate")
        if inputs.ndim != 2 or inputs.shape[1] != Te + 2:
            raise ValueError(f"Transformer inputs must be (B, {Te + 2}); got {inputs.shape}")
        B = inputs.shape[0]
        if targets.shape != (B, Td):
            raise ValueError(f"Transformer targets must be (B, {Td}); got {targets.shape}")
        if B > self._batch:
            raise ValueError(f"batch of {B} samples, but allocate({self._batch}) was called")
        v = self._views.get(B)
        if v is None:
            v = self._views[B] = Views(self._arena, cfg, B, self._offsets, self._store_of())
        for what, a in (("token ids", inputs[:, :Te]), ("targets", targets)):
            if a.size and (a.min() < 0 or a.max() >= V):  # the kernels index unchecked
                raise ValueError(f"Transformer {what} must lie in [0, {V})")
        np.copyto(v.enc_ids.reshape(B, Te), inputs[:, :Te], casting="same_kind")
        np.copyto(v.labels.reshape(B, Td), targets, casting="same_kind")
        dec = v.dec_ids.reshape(B, Td)
        dec[:, 0] = cfg.bos_token_id
        dec[:, 1:] = targets[:, :-1]
        np.not_equal(v.enc_ids.reshape(B, Te), pad, out=v.enc_keep, casting="unsafe")
        real = targets != pad
        self._counts = np.maximum(real.sum(axis=1), 1).astype(np.float64)
        w = v.row_weight.reshape(B, Td)
        np.divide(real, self._counts[:, None], out=w, casting="unsafe")
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

    def _attend(self, out, att, q, k, v, keep, ds, causal, site) -> None:
        mha_attend_forward(out, att, q, k, v, keep, self._scratch, ds, self.config.nhead,
                           causal, self._keys, site, self._p, self._att_scale, att[0],
                           False)  # fmt: skip

    def _attend_back(self, dq, dk, dv, dout, q, k, v, att, ds, causal, site) -> None:
        mha_attend_backward(dq, dk, dv, att[0], dout, q, k, v, att, self._scratch, ds,
                            self.config.nhead, causal, self._keys, site, self._p,
                            self._att_scale, False)  # fmt: skip

    def _ffn(self, params, names, x, h, a, out, B, site) -> None:
        """out = linear2(drop(relu(linear1(x)))), before the sublayer's output dropout."""
        st = self._store
        w1, b1, w2, b2 = (params[n] for n in names[-8:-4])  # names end with 2 norms
        linear_hf_forward(h, x, w1, b1)
        st(h)
        relu_forward(a, h)
        self._drop(a, B, site)
        st(a)
        linear_hf_forward(out, a, w2, b2)

    # -------------------------------------------------------------- stage forwards
    def _encoder_embed_forward(self, v: Views, params, _: int) -> None:
        B = v.B
        scaled_embedding_forward(v.enc3(v.ex[0]), v.enc_ids.reshape(B, -1), params[EMBED],
                                 self._emb_scale, v.pe)  # fmt: skip
        self._drop(v.ex[0], B, sites(self.config)["enc_emb"])
        self._store(v.ex[0])  # mixed precision: what a kernel writes is stored half

    def _encoder_forward(self, v: Views, params, i: int) -> None:
        B, D = v.B, self.config.d_model
        st = self._store
        t = v.tD[: v.Ne]
        names, s0, x = self._enc[i], sites(self.config)["enc"][i], v.ex[i]
        v.pack(i, ("ex",))  # layer i's input, final
        w, b = params[names[0]], params[names[1]]
        for out, wi, bi in zip((v.e_q[i], v.e_k[i], v.e_v[i]), _qkv(w, D), _qkv(b, D),
                               strict=True):  # fmt: skip
            linear_hf_forward(out, x, wi, bi)
        st(v.e_q[i], v.e_k[i], v.e_v[i])
        self._attend(v.enc3(v.e_ctx[i]), v.e_att[i], v.enc3(v.e_q[i]), v.enc3(v.e_k[i]),
                     v.enc3(v.e_v[i]), v.enc_keep, v.ds_ee, False, s0)  # fmt: skip
        st(v.e_ctx[i])  # the probabilities stay float32, as a fused attention keeps them
        linear_hf_forward(t, v.e_ctx[i], params[names[2]], params[names[3]])
        self._drop(t, B, s0 + 1)
        st(t)
        n1w, n1b, n2w, n2b = (params[n] for n in names[-4:])
        residual_layernorm_forward(v.e_r1[i], v.e_x1[i], v.e_m1[i], v.e_s1[i], x, t, n1w, n1b)
        st(v.e_r1[i], v.e_x1[i])  # statistics from the float32 sum, as GPT-2's
        self._ffn(params, names, v.e_x1[i], v.e_h[i], v.e_a[i], t, B, s0 + 2)
        self._drop(t, B, s0 + 3)
        st(t)
        residual_layernorm_forward(v.e_r2[i], v.ex[i + 1], v.e_m2[i], v.e_s2[i], v.e_x1[i], t,
                                   n2w, n2b)  # fmt: skip
        st(v.e_r2[i], v.ex[i + 1])
        v.pack(i, v.enc_own)  # before layer i + 1 reuses the working copies

    def _encoder_norm_forward(self, v: Views, params, _: int) -> None:
        nw, nb = (params[n] for n in final_norm_names("encoder"))
        layernorm_forward(v.enc_out, v.e_mf, v.e_sf, v.ex[-1], nw, nb)
        self._store(v.enc_out)

    def _decoder_embed_forward(self, v: Views, params, _: int) -> None:
        B = v.B
        scaled_embedding_forward(v.dec3(v.dy[0]), v.dec_ids.reshape(B, -1), params[EMBED],
                                 self._emb_scale, v.pe)  # fmt: skip
        self._drop(v.dy[0], B, sites(self.config)["dec_emb"])
        self._store(v.dy[0])

    def _decoder_forward(self, v: Views, params, j: int) -> None:
        B, D = v.B, self.config.d_model
        st = self._store
        t = v.tD[: v.Nd]
        names, s0, y = self._dec[j], sites(self.config)["dec"][j], v.dy[j]
        v.pack(j, ("dy",))  # layer j's input, final
        w, b = params[names[0]], params[names[1]]
        for out, wi, bi in zip((v.s_q[j], v.s_k[j], v.s_v[j]), _qkv(w, D), _qkv(b, D),
                               strict=True):  # fmt: skip
            linear_hf_forward(out, y, wi, bi)
        st(v.s_q[j], v.s_k[j], v.s_v[j])
        self._attend(v.dec3(v.s_ctx[j]), v.s_att[j], v.dec3(v.s_q[j]), v.dec3(v.s_k[j]),
                     v.dec3(v.s_v[j]), v.dec_keep, v.ds_dd, True, s0)  # fmt: skip
        st(v.s_ctx[j])
        linear_hf_forward(t, v.s_ctx[j], params[names[2]], params[names[3]])
        self._drop(t, B, s0 + 1)
        st(t)
        n1w, n1b, n2w, n2b, n3w, n3b = (params[n] for n in names[-6:])
        residual_layernorm_forward(v.s_r[j], v.s_x[j], v.s_m[j], v.s_s[j], y, t, n1w, n1b)
        st(v.s_r[j], v.s_x[j])
        # cross-attention: keys and values from the encoder's output
        wq, wk, wv = _qkv(params[names[4]], D)
        bq, bk, bv = _qkv(params[names[5]], D)
        linear_hf_forward(v.c_q[j], v.s_x[j], wq, bq)
        linear_hf_forward(v.c_k[j], v.enc_out, wk, bk)
        linear_hf_forward(v.c_v[j], v.enc_out, wv, bv)
        st(v.c_q[j], v.c_k[j], v.c_v[j])
        self._attend(v.dec3(v.c_ctx[j]), v.c_att[j], v.dec3(v.c_q[j]), v.enc3(v.c_k[j]),
                     v.enc3(v.c_v[j]), v.enc_keep, v.ds_de, False, s0 + 2)  # fmt: skip
        st(v.c_ctx[j])
        linear_hf_forward(t, v.c_ctx[j], params[names[6]], params[names[7]])
        self._drop(t, B, s0 + 3)
        st(t)
        residual_layernorm_forward(v.c_r[j], v.c_x[j], v.c_m[j], v.c_s[j], v.s_x[j], t, n2w, n2b)
        st(v.c_r[j], v.c_x[j])
        self._ffn(params, names[:-2], v.c_x[j], v.f_h[j], v.f_a[j], t, B, s0 + 4)
        self._drop(t, B, s0 + 5)
        st(t)
        residual_layernorm_forward(v.f_r[j], v.dy[j + 1], v.f_m[j], v.f_s[j], v.c_x[j], t, n3w,
                                   n3b)  # fmt: skip
        st(v.f_r[j], v.dy[j + 1])
        v.pack(j, v.dec_own)  # before layer j + 1 reuses the working copies

    def _head_forward(self, v: Views, params, _: int) -> None:
        cfg = self.config
        nw, nb = (params[n] for n in final_norm_names("decoder"))
        layernorm_forward(v.dec_out, v.d_mf, v.d_sf, v.dy[-1], nw, nb)
        self._store(v.dec_out)
        linear_nobias_forward(v.logits, v.dec_out, params[EMBED])
        self._store(v.logits)  # the loss reads them in float32
        smoothed_cross_entropy_forward(v.losses, v.probs, v.logits, v.labels,
                                       F32(cfg.label_smoothing), cfg.pad_token_id)  # fmt: skip

    # -------------------------------------------------------------- stage backwards
    def _head_backward(self, v: Views, params, g, _: int, dloss: float) -> None:
        """Leaves d(last decoder layer's output) in ``gd`` and zeroes d(encoder output),
        which every decoder layer's cross-attention adds to."""
        cfg = self.config
        st = self._store
        smoothed_cross_entropy_backward(v.probs, v.probs, v.labels, v.row_weight, F32(dloss),
                                        F32(cfg.label_smoothing))  # fmt: skip
        st(v.probs)  # d logits
        t = v.tD[: v.Nd]
        linear_nobias_backward(t, g[EMBED], v.probs, v.dec_out, params[EMBED])
        st(t)
        nw, nb = final_norm_names("decoder")
        layernorm_backward(v.gd, g[nw], g[nb], t, v.dy[-1], params[nw], v.d_mf, v.d_sf)
        st(v.gd)
        g.done((nw, nb))
        v.g_enc.fill(0.0)

    def _decoder_backward(self, v: Views, params, g, j: int, dloss: float) -> None:
        """``gd`` holds d(layer j's output); leaves d(its input) there."""
        cfg = self.config
        B, Ne, Nd = v.B, v.Ne, v.Nd
        st = self._store
        t = v.tD[:Nd]
        names, s0 = self._dec[j], sites(cfg)["dec"][j]
        n = names[-6:]  # norm1, norm2, norm3 (weight, bias)
        v.unpack(j, (*v.dec_own, "dy"))
        # FFN sublayer: gd holds d(its output)
        self._ffn_backward(v, params, g, names[:-2], v.gd, v.f_r[j], n[4:], v.f_m[j], v.f_s[j],
                           v.c_x[j], v.f_h[j], v.f_a[j], Nd, s0 + 4)  # fmt: skip
        # cross-attention sublayer: keys and values from the encoder output
        gr = self._norm_backward(v, params, g, v.gd, v.c_r[j], n[2:4], v.c_m[j], v.c_s[j])
        d = self._undrop(t, gr, B, s0 + 3)
        st(d)
        gc = v.g_ctx[:Nd]
        linear_hf_backward(gc, g[names[6]], g[names[7]], d, v.c_ctx[j], params[names[6]])
        st(gc)
        gk, gv = v.g_k[:Ne], v.g_v[:Ne]
        self._attend_back(v.dec3(v.g_q[:Nd]), v.enc3(gk), v.enc3(gv), v.dec3(gc),
                          v.dec3(v.c_q[j]), v.enc3(v.c_k[j]), v.enc3(v.c_v[j]), v.c_att[j],
                          v.ds_de, False, s0 + 2)  # fmt: skip
        st(v.g_q[:Nd], gk, gv)
        W, gW, gb = params[names[4]], g[names[4]], g[names[5]]
        (wq, wk, wv), (dwq, dwk, dwv), (dbq, dbk, dbv) = (_qkv(a, cfg.d_model)
                                                          for a in (W, gW, gb))  # fmt: skip
        gx = v.g_x[:Nd]
        linear_hf_backward(gx, dwq, dbq, v.g_q[:Nd], v.s_x[j], wq)
        st(gx)
        linear_hf_backward_accumulate(v.g_enc, dwk, dbk, gk, v.enc_out, wk)
        linear_hf_backward_accumulate(v.g_enc, dwv, dbv, gv, v.enc_out, wv)
        st(v.g_enc)
        residual_forward(v.gd.reshape(-1), gr.reshape(-1), gx.reshape(-1))
        st(v.gd)
        # causal self-attention sublayer
        self._attention_backward(v, params, g, names, v.gd, v.s_r[j], n[:2], v.s_m[j], v.s_s[j],
                                 v.dy[j], (v.s_q[j], v.s_k[j], v.s_v[j], v.s_ctx[j], v.s_att[j]),
                                 v.dec3, v.ds_dd, True, s0)  # fmt: skip
        g.done(names)

    def _decoder_embed_backward(self, v: Views, params, g, _: int, dloss: float) -> None:
        """The shared table (the output projection wrote its gradient first)."""
        d = self._undrop(v.tD[: v.Nd], v.gd, v.B, sites(self.config)["dec_emb"])
        self._store(d)
        scaled_embedding_backward_accumulate(g[EMBED], v.dec3(d), v.dec_ids.reshape(v.B, -1),
                                             self._emb_scale)  # fmt: skip

    def _encoder_norm_backward(self, v: Views, params, g, _: int, dloss: float) -> None:
        """d(encoder output), gathered from every cross-attention, through the final norm."""
        nw, nb = final_norm_names("encoder")
        layernorm_backward(v.ge, g[nw], g[nb], v.g_enc, v.ex[-1], params[nw], v.e_mf, v.e_sf)
        self._store(v.ge)
        g.done((nw, nb))

    def _encoder_backward(self, v: Views, params, g, i: int, dloss: float) -> None:
        """``ge`` holds d(layer i's output); leaves d(its input) there."""
        names, s0 = self._enc[i], sites(self.config)["enc"][i]
        n = names[-4:]
        v.unpack(i, (*v.enc_own, "ex"))
        self._ffn_backward(v, params, g, names, v.ge, v.e_r2[i], n[2:], v.e_m2[i], v.e_s2[i],
                           v.e_x1[i], v.e_h[i], v.e_a[i], v.Ne, s0 + 2)  # fmt: skip
        self._attention_backward(v, params, g, names, v.ge, v.e_r1[i], n[:2], v.e_m1[i],
                                 v.e_s1[i], v.ex[i],
                                 (v.e_q[i], v.e_k[i], v.e_v[i], v.e_ctx[i], v.e_att[i]),
                                 v.enc3, v.ds_ee, False, s0)  # fmt: skip
        g.done(names)

    def _encoder_embed_backward(self, v: Views, params, g, _: int, dloss: float) -> None:
        d = self._undrop(v.tD[: v.Ne], v.ge, v.B, sites(self.config)["enc_emb"])
        self._store(d)
        scaled_embedding_backward_accumulate(g[EMBED], v.enc3(d), v.enc_ids.reshape(v.B, -1),
                                             self._emb_scale)  # fmt: skip
        g.done((EMBED,))

    # -------------------------------------------------------------- backward helpers
    def _norm_backward(self, v, params, g, gres, res, norm, mean, rstd) -> np.ndarray:
        """d(a post-LN sublayer's sum x + branch) from d(its output) gres: into g_r."""
        gr = v.g_r[: res.shape[0]]
        w, b = norm
        layernorm_backward(gr, g[w], g[b], gres, res, params[w], mean, rstd)
        self._store(gr)
        return gr

    def _ffn_backward(self, v, params, g, names, gres, res, norm, mean, rstd, x, h, a, N, site):
        """gres: d(LN(x + drop(ffn(x)))) in, d x out (overwritten)."""
        st = self._store
        gr = self._norm_backward(v, params, g, gres, res, norm, mean, rstd)
        d = self._undrop(v.tD[:N], gr, v.B, site + 1)
        st(d)
        gh = v.g_h[:N]
        w1, b1, w2, b2 = names[-8:-4]
        linear_hf_backward(gh, g[w2], g[b2], d, a, params[w2])
        self._undrop(gh, gh, v.B, site)
        relu_backward(gh, gh, h)
        st(gh)
        gx = v.g_x[:N]
        linear_hf_backward(gx, g[w1], g[b1], gh, x, params[w1])
        st(gx)
        residual_forward(gres.reshape(-1), gr.reshape(-1), gx.reshape(-1))
        st(gres)

    def _attention_backward(self, v, params, g, names, gres, res, norm, mean, rstd, x, acts,
                            to3, ds, causal, site):  # fmt: skip
        """gres: d(LN(x + drop(self_attn(x)))) in, d x out (overwritten)."""
        N = x.shape[0]
        q, k, vv, ctx, att = acts
        st = self._store
        gr = self._norm_backward(v, params, g, gres, res, norm, mean, rstd)
        d = self._undrop(v.tD[:N], gr, v.B, site + 1)
        st(d)
        gc = v.g_ctx[:N]
        linear_hf_backward(gc, g[names[2]], g[names[3]], d, ctx, params[names[2]])
        st(gc)
        gq, gk, gv = v.g_q[:N], v.g_k[:N], v.g_v[:N]
        self._attend_back(to3(gq), to3(gk), to3(gv), to3(gc), to3(q), to3(k), to3(vv), att, ds,
                          causal, site)  # fmt: skip
        st(gq, gk, gv)
        D = self.config.d_model
        W, dW, db = _qkv(params[names[0]], D), _qkv(g[names[0]], D), _qkv(g[names[1]], D)
        gx = v.g_x[:N]
        linear_hf_backward(gx, dW[0], db[0], gq, x, W[0])
        linear_hf_backward_accumulate(gx, dW[1], db[1], gk, x, W[1])
        linear_hf_backward_accumulate(gx, dW[2], db[2], gv, x, W[2])
        st(gx)
        residual_forward(gres.reshape(-1), gr.reshape(-1), gx.reshape(-1))
        st(gres)
