"""Plan mode's analytic step for what simdist does not run itself: Megatron-LM's schedule.

Mixed precision, tensor and pipeline parallelism, ZeRO-3, recompute and weight streaming
(the formulas and the overlap rules are in ``simdist.sim.plan``'s docstring): each kernel
through the same ``CostModel.compute_time`` and each collective through the same closed
forms (``simdist.device.collective_cost``) as a run, put together with Megatron's and
DDP's published overlap rules instead of ``simdist.sim.step``'s, since no simdist run
exists to replay. ``AnalyticStep`` is a mixin of ``simdist.sim.plan.Planner``: it uses the
planner's ``cfg``, ``profile``, ``cost``, ``dtype``, ``elem`` and ``notes``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from simdist.device.collective_cost import collective_time
from simdist.device.profile import Link, ProfileError

from .plan_shapes import MLPSpec, TransformerSpec, layer_activation_bytes, model_state_bytes

DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP bucket_cap_mb default (torch docs)


# -- kernels of one layer ------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # matmul | vector | comm
    flops: float = 0.0
    bytes: float = 0.0
    collective: str = ""  # for comm ops
    count: int = 1  # identical kernels (e.g. the two backward GEMMs)


def transformer_layer_ops(
    spec: TransformerSpec, b: int, s: int, t: int, sp: bool, e: int, cross: bool = False
) -> tuple[list[Op], list[Op]]:
    """(forward, backward) kernels of one layer on one TP rank, per micro-batch.

    Grouped-query attention narrows the K/V projections to kv_heads/heads of Q's width; a
    gated MLP's first GEMM produces gate and up (2 d_ff) and its activation multiplies
    them; ``cross`` adds a decoder layer's cross-attention block (LayerNorm, Q/K/V from
    the decoder and encoder streams, the attention core, projection, residual) after the
    self-attention block, with one sequence length for both streams."""
    h, f, a = spec.d_model, spec.ffn, spec.n_head
    tok = b * s
    hs, fs, heads = h / t, f / t, a / t
    rows = tok / t if sp else tok  # sequence-parallel regions hold 1/t of the tokens
    scores = b * heads * s * s
    act = e * tok * h  # bytes of one full [s, b, h] activation
    mha = spec.kv_heads == a
    qkv_out = 3 * hs if mha else hs + 2 * hs * spec.kv_heads / a
    kv_s = hs if mha else hs * spec.kv_heads / a  # K (or V) width on this rank

    def gemm(name: str, m: float, k: float, n: float) -> Op:
        return Op(name, "matmul", 2 * m * k * n, e * (m * k + k * n + m * n))

    def ew(name: str, n: float, flops_per: float, bytes_per: float) -> Op:
        return Op(name, "vector", n * flops_per, n * bytes_per)

    tp_out = "reduce_scatter" if sp else "allreduce"

    def attention(p: str, ln: str) -> list[Op]:
        ops = [ew(ln, rows * h, 8, 2 * e)]
        if sp and t > 1:
            ops.append(Op(f"tp.allgather.{p}", "comm", bytes=act, collective="allgather"))
        ops += [
            gemm("qkv" if p == "attn" else f"{p}.qkv", tok, h, qkv_out),
            Op(f"{p}.qk", "matmul", 2 * scores * (h / a), e * (tok * (hs + kv_s) + scores)),
            ew(f"{p}.softmax", scores, 5, 2 * e),
            ew(f"{p}.dropout", scores, 1, 2 * e + 1),
            Op(f"{p}.av", "matmul", 2 * scores * (h / a), e * (scores + tok * (kv_s + hs))),
            gemm(f"{p}.proj", tok, hs, h),
        ]
        if t > 1:
            ops.append(Op(f"tp.{tp_out}.{p}", "comm", bytes=act, collective=tp_out))
        return ops + [ew(f"{p}.dropout_residual", rows * h, 2, 3 * e + 1)]

    fwd: list[Op] = attention("attn", "ln1")
    if cross:
        fwd += attention("xattn", "ln_x")
    fwd.append(ew("ln2", rows * h, 8, 2 * e))
    if sp and t > 1:
        fwd.append(Op("tp.allgather.mlp", "comm", bytes=act, collective="allgather"))
    if spec.gated:  # gate and up in one GEMM; act(gate) * up reads two, writes one
        fwd += [gemm("mlp.fc1", tok, h, 2 * fs), ew("mlp.gelu", tok * fs, 9, 3 * e)]
    else:
        fwd += [gemm("mlp.fc1", tok, h, fs), ew("mlp.gelu", tok * fs, 8, 2 * e)]
    fwd.append(gemm("mlp.fc2", tok, fs, h))
    if t > 1:
        fwd.append(Op(f"tp.{tp_out}.mlp", "comm", bytes=act, collective=tp_out))
    fwd.append(ew("mlp.dropout_residual", rows * h, 2, 3 * e + 1))

    # a bias's gradient is the output gradient summed over the tokens (grad_output.sum(0) in
    # Megatron-LM's linear layers, a reduction kernel reading it once): column-parallel
    # GEMMs own 1/t of the width, row-parallel ones add their bias after the TP reduction
    biased: dict[str, float] = {}
    if spec.attn_bias:
        for p in ("", "xattn.") if cross else ("",):
            biased[f"{p}qkv"] = tok * qkv_out
            biased[f"{p or 'attn.'}proj"] = rows * h
    if spec.mlp_bias:
        biased["mlp.fc1"] = tok * fs * (2 if spec.gated else 1)
        biased["mlp.fc2"] = rows * h

    bwd: list[Op] = []
    for op in reversed(fwd):
        if op.kind == "matmul":  # data gradient and weight gradient, same size each
            bwd.append(dataclasses.replace(op, name=op.name + ".bwd", count=2))
            if op.name in biased:
                bwd.append(ew(op.name + ".bias_grad", biased[op.name], 1, e))
        elif op.kind == "vector":  # read grad + saved input, write grad: ~1.5x the bytes
            bwd.append(dataclasses.replace(op, name=op.name + ".bwd", bytes=1.5 * op.bytes))
        else:  # the conjugate collective (Megatron's f/g operators)
            conj = {"allreduce": "allreduce", "reduce_scatter": "allgather"}
            bwd.append(
                dataclasses.replace(
                    op, name=op.name + ".bwd", collective=conj.get(op.collective, "reduce_scatter")
                )
            )
            if sp and op.collective == "allgather":  # redo the gather for the weight gradient
                bwd.append(dataclasses.replace(op, name=op.name + ".redo"))
    return fwd, bwd


ATTENTION_CORE = ("attn.qk", "attn.softmax", "attn.dropout", "attn.av")


def _attention_core(fwd: list[Op]) -> list[Op]:
    """The kernels selective recompute re-runs (Korthikanti §5)."""
    core = {n.split(".")[1] for n in ATTENTION_CORE}
    return [
        op
        for op in fwd
        if op.name in ATTENTION_CORE
        or (op.name.startswith("xattn.") and op.name.split(".")[1] in core)
    ]


class AnalyticStep:
    """The step-time methods of ``Planner`` for the analytic (Megatron / DDP) schedule."""

    cfg: Any
    profile: Any
    cost: Any
    dtype: str
    elem: int
    notes: list[str]

    def _dp_link(self, dp: int) -> tuple[Link, int]:
        """Link a data-parallel ring sees and how many DP ranks share a node."""
        prof, c = self.profile, self.cfg
        mp = c.tp * c.pp
        k_dp = max(1, prof.devices_per_node // mp) if mp < prof.devices_per_node else 1
        if dp <= k_dp:
            return prof.intra, k_dp
        if mp == 1:  # the DP group fills whole nodes: the flat multi-node ring
            return self.cost.link("inter", dp), k_dp
        nic = prof.inter
        if not nic.known:
            return nic, k_dp
        # the DP groups of a node share its NICs: this group gets k_dp/devices_per_node of them
        share = k_dp / prof.devices_per_node
        usable = nic.effective_bandwidth * prof.nics_per_node * share
        if k_dp > 1 and prof.intra.known:
            usable = min(usable, prof.intra.effective_bandwidth)
        return Link("dp", usable, nic.latency, 1.0, nic.gamma), k_dp

    def _dp_time(self, op: str, nbytes: float, dp: int) -> float:
        if dp <= 1 or nbytes <= 0:
            return 0.0
        c = self.cfg
        key = ("dp", op, nbytes, dp, c.tp, c.pp, c.algorithm)
        return self._memo(key, lambda: self._dp_time_uncached(op, nbytes, dp))

    def _dp_time_uncached(self, op: str, nbytes: float, dp: int) -> float:
        link, k_dp = self._dp_link(dp)
        alg = self.cfg.algorithm
        if alg in ("hierarchical", "auto") and 1 < k_dp < dp:
            rail = self.cost.rail(self.profile.devices_per_node)
            return collective_time(
                op, alg, nbytes, dp, self.profile.intra, inter=rail, devices_per_node=k_dp
            )
        return collective_time(op, "ring" if alg == "hierarchical" else alg, nbytes, dp, link)

    def _op_time(self, op: Op) -> float:
        if op.kind == "comm":
            return op.count * self.cost.collective_time(
                op.collective, "ring", op.bytes, self.cfg.tp, "intra"
            )
        return op.count * self.cost.compute_time(op.flops, op.bytes, op.kind, self.dtype)

    def _ops_time(self, ops: list[Op]) -> tuple[float, float]:
        """(compute seconds, exposed TP-communication seconds)."""
        comp = comm = 0.0
        for op in ops:
            if op.kind == "comm":
                comm += self._op_time(op)
            else:
                comp += self._op_time(op)
        return comp, comm

    def _layer_times(
        self, spec: TransformerSpec, micro: int, seq: int, t: int, sp: bool, cross: bool
    ) -> tuple[float, float, float, float, float, float]:
        """(forward, forward TP comm, backward, backward TP comm, recompute, recompute TP
        comm) seconds of one layer and one micro-batch; memoised per planner (a search
        evaluates many configurations with the same layer shapes)."""
        key = (spec, micro, seq, t, sp, cross, self.elem, self.dtype, self.cfg.recompute,
               self._ws())  # fmt: skip
        cache = self.__dict__.setdefault("_layer_cache", {})
        if key not in cache:
            fwd, bwd = transformer_layer_ops(spec, micro, seq, t, sp, self.elem, cross)
            f_c, f_tp = self._ops_time(fwd)
            b_c, b_tp = self._ops_time(bwd)
            r_c = r_tp = 0.0
            if self.cfg.recompute == "full":
                r_c, r_tp = f_c, f_tp
            elif self.cfg.recompute == "selective":
                r_c, r_tp = self._ops_time(_attention_core(fwd))
            cache[key] = (f_c, f_tp, b_c, b_tp, r_c, r_tp)
        return cache[key]

    def _grad_accumulate(self, n: float) -> float:
        """Seconds to add one micro-batch's weight gradients of ``n`` parameters into the
        gradient buffer. Megatron-LM's DDP runs ``param.main_grad.add_(param.grad)`` in a
        backward hook of every parameter after every micro-batch (megatron/model/
        distributed.py since 2021; megatron/core/distributed today): it reads the new
        gradient and reads and writes the buffer, e bytes each (the buffer has the
        parameters' dtype unless --accumulate-allreduce-grads-in-fp32; with gradient-
        accumulation fusion the weight-gradient GEMM reads and writes an fp32 buffer
        instead of writing e bytes: as many bytes or more). One memory-bound pass."""
        return self._memo(
            ("gacc", n),
            lambda: self.cost.compute_time(n, 3 * self.elem * n, "vector", self.dtype),
        )

    def _memo(self, key: tuple, compute: Any) -> Any:
        """``compute()`` once per key and planner (the key names what the value depends on
        besides the profile, the dtype and, for working-set-keyed profiles, the working set)."""
        cache = self.__dict__.setdefault("_memo_cache", {})
        key = (*key, self.elem, self.dtype, self._ws())
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    def _ws(self) -> float | None:
        """The working set, where the profile's memory efficiency depends on it."""
        return (
            self.cost.working_set if self.profile.memory_efficiency_key == "working_set" else None
        )

    def _head(self, spec: TransformerSpec, tok: int) -> tuple[float, float, float, float]:
        """(logits + loss forward, their backward, embedding forward, its backward) seconds
        of one micro-batch of ``tok`` tokens (vocab-parallel over the TP ranks)."""
        e, t, h, vcb = self.elem, self.cfg.tp, spec.d_model, spec.vocab
        cast = e + 4 if e < 4 else 0  # bytes per logit of a cast to fp32
        head = [
            Op(
                "logits",
                "matmul",
                2 * tok * h * vcb / t,
                e * (tok * h + h * vcb / t + tok * vcb / t),
            ),
            # Megatron-LM's vocab-parallel cross-entropy on fp32 logits, pass by pass
            # (mpu/cross_entropy.py): cast half logits (e in, 4 out), max (4), subtract it
            # in place (4 + 4), exp in place (4 + 4), sum (4), divide in place (4 + 4);
            # backward: scale in place (4 + 4), cast back (4 in, e out)
            Op("cross_entropy", "vector", 5 * tok * vcb / t, (cast + 32) * tok * vcb / t),
        ]
        ce_bwd = dataclasses.replace(head[1], bytes=(cast + 8) * tok * vcb / t)
        head_bwd = [dataclasses.replace(head[0], count=2), ce_bwd]
        emb = [Op("embedding", "vector", tok * h, 3 * e * tok * h)]
        hf_c, _ = self._ops_time(head)
        hb_c, _ = self._ops_time(head_bwd)
        ef_c, _ = self._ops_time(emb)
        eb_c, _ = self._ops_time([dataclasses.replace(emb[0], bytes=2 * emb[0].bytes)])
        # the embedding's gradient is dense: its backward (PyTorch's
        # embedding_dense_backward) zero-fills the whole [V/t, h] table, then adds the rows
        # of this micro-batch's tokens
        eb_c += self.cost.compute_time(0.0, e * h * vcb / t, "vector", self.dtype)
        if t > 1:  # vocab-parallel cross-entropy: all-reduce of max and sum per token
            hf_c += 2 * self.cost.collective_time("allreduce", "ring", 4 * tok, t, "intra")
        return hf_c, hb_c, ef_c, eb_c

    def _p2p(self, tok: int, h: int) -> float:
        """Pipeline transfers of one micro-batch on one stage: scatter-gather p2p (Narayanan
        §4.1), 1/t of the activation per TP rank, forward and backward per virtual stage."""
        e, t, pp, v = self.elem, self.cfg.tp, self.cfg.pp, self.cfg.interleave
        nbytes = e * tok * h / t
        dpn = self.profile.devices_per_node
        link = self.cost.rail(dpn) if t * pp > dpn else self.profile.intra
        one = collective_time("p2p", "ring", nbytes, 2, link)
        if t > 1:
            one += self.cost.collective_time("allgather", "ring", nbytes * t, t, "intra")
        return 2 * v * one  # forward activation and backward gradient per virtual stage

    def _transformer(
        self, spec: TransformerSpec, mem: dict, dp: int, m: int, micro: int, seq: int, out: dict
    ) -> tuple[float | None, float]:
        c, e = self.cfg, self.elem
        t, pp, v = c.tp, c.pp, c.interleave
        sp = c.sequence_parallel and t > 1
        if spec.n_layer % pp:
            self.notes.append(f"{spec.n_layer} layers do not split evenly over pp={pp}")
        layers = math.ceil(spec.n_layer / pp)

        # activations: first stage holds min(pp, m) micro-batches of its layers
        per_layer = layer_activation_bytes(
            spec, micro, seq, tp=t, sequence_parallel=sp, recompute=c.recompute, elem=e
        )
        x_frac = spec.cross_layers / spec.n_layer  # encoder-decoder: the decoder's share
        if x_frac:  # a stage holds the mean layer (the split of encoder/decoder not modelled)
            x_layer = layer_activation_bytes(
                spec, micro, seq, tp=t, sequence_parallel=sp, recompute=c.recompute, elem=e,
                cross=True,
            )  # fmt: skip
            per_layer = int((1 - x_frac) * per_layer + x_frac * x_layer)
            self.notes.append(
                f"encoder-decoder: {spec.n_layer - spec.cross_layers} encoder + "
                f"{spec.cross_layers} decoder layers (with cross-attention) at one sequence "
                f"length; each pipeline stage is planned with the mean layer"
            )
        in_flight = min(pp, m)
        factor = 1 + (pp - 1) / (pp * v) if v > 1 and pp > 1 else 1.0
        stored = per_layer * layers * in_flight * factor
        working = 0
        if c.recompute != "none":  # the layer being recomputed holds its full set again
            working = layer_activation_bytes(
                spec, micro, seq, tp=t, sequence_parallel=sp, recompute="none", elem=e,
                cross=bool(x_frac),
            )  # fmt: skip
        tok = micro * seq
        logits = tok * spec.vocab / t * (e + 4)  # logits + fp32 cross-entropy (vocab-parallel)
        embed = tok * spec.d_model * (e + 1) / (t if sp else 1)
        first = stored + working + embed + (logits if pp == 1 else 0)
        last = per_layer * layers * factor + working + logits
        mem["activations"] = int(max(first, last))
        coef = (
            f"sbh({16 * e + 2} + {2 * e + 1}as/h)" if spec.ffn == 4 * spec.d_model else "sbh(...)"
        )
        self.notes.append(
            f"activations: Korthikanti et al. 2022, {coef} bytes per layer before TP/SP/"
            f"recompute ({e}-byte elements, 1-byte dropout masks), {layers} layers x "
            f"{in_flight} micro-batch(es) in flight, + logits"
            + (", + the working set of the layer being recomputed" if working else "")
        )

        # compute of one micro-batch on one stage
        f_c, f_tp, b_c, b_tp, r_c, r_tp = self._layer_times(spec, micro, seq, t, sp, False)
        if x_frac:
            xt = self._layer_times(spec, micro, seq, t, sp, True)
            f_c, f_tp, b_c, b_tp, r_c, r_tp = (
                (1 - x_frac) * p + x_frac * x
                for p, x in zip((f_c, f_tp, b_c, b_tp, r_c, r_tp), xt, strict=True)
            )
        h, vcb = spec.d_model, spec.vocab
        hf_c, hb_c, ef_c, eb_c = self._memo(("head", spec, tok, t), lambda: self._head(spec, tok))
        # every micro-batch's weight gradients go into the gradient buffer
        # (``_grad_accumulate``): the whole buffer of this TP rank with DP and ZeRO-1
        # (Megatron-LM), the rank's 1/dp shard after each micro-batch's reduce-scatter with
        # ZeRO-2/3 (DeepSpeed); the output layer (the last stage's copy of a tied embedding,
        # or an untied head) and the embedding likewise
        shard = t * (dp if c.zero >= 2 else 1)
        b_c += self._grad_accumulate((spec.layer_params() + x_frac * spec.cross_params()) / shard)
        table_acc = self._grad_accumulate(h * vcb / shard)
        hb_c += table_acc
        eb_c += table_acc
        layer_f = layers * (f_c + f_tp)
        layer_b = layers * (b_c + b_tp + r_c + r_tp)
        first_stage = layer_f + layer_b + ef_c + eb_c + (hf_c + hb_c if pp == 1 else 0)
        last_stage = layer_f + layer_b + hf_c + hb_c
        stage = max(first_stage, last_stage)
        p2p = self._memo(("p2p", tok, h, t, pp, v), lambda: self._p2p(tok, h)) if pp > 1 else 0.0
        per_micro = stage + p2p
        pipeline = (m + (pp - 1) / v) * per_micro if pp > 1 else m * per_micro
        out["forward_compute"] = m * layers * f_c
        out["backward_compute"] = m * layers * b_c
        out["recompute"] = m * layers * r_c
        out["head_and_embedding"] = m * (stage - layer_f - layer_b)
        out["tp_comm"] = m * layers * (f_tp + b_tp + r_tp)
        out["pp_p2p"] = m * p2p
        out["pp_bubble"] = pipeline - m * per_micro

        # data parallel and optimizer
        params_dev = math.ceil(spec.param_count() / (t * pp))
        dp_exposed, dp_total = self._dp_sync(params_dev, dp, m, f_c * layers, b_c * layers)
        out["dp_comm_total"] = dp_total
        out["dp_comm_exposed"] = dp_exposed
        self._overlap_note(dp)
        opt = self._optimizer_time(params_dev, dp)
        out["optimizer"] = opt
        step = pipeline + dp_exposed + opt
        # model FLOPs (no recompute) per step, whole job: Narayanan eq. (3) with 72
        gb = c.batch * dp
        nl = spec.n_layer
        # per token: 3 passes x (layers x (QKV+proj 8h^2, MLP 4hf, scores 4sh) + logits 2hV);
        # for f = 4h this is Narayanan et al. eq. (3) without recompute (factor 72)
        ff = spec.ffn
        if spec.kv_heads == spec.n_head and not spec.gated and not spec.cross_layers:
            per_tok = nl * (8 * h * h + 4 * h * ff + 4 * seq * h)
        else:  # 2 FLOPs per weight of every GEMM, plus the two attention-core matmuls
            kv = 2 * (h // spec.n_head) * spec.kv_heads
            attn = 2 * h * h + h * kv
            mlp = (3 if spec.gated else 2) * h * ff
            per_tok = 2 * (nl * (attn + mlp) + spec.cross_layers * attn)
            per_tok += 4 * seq * h * (nl + spec.cross_layers)
        model_flops = 3.0 * gb * seq * (per_tok + 2 * h * vcb)
        return step, model_flops

    def _dp_sync(
        self, params_dev: int, dp: int, m: int, fwd_s: float, bwd_s: float
    ) -> tuple[float, float]:
        """(exposed, total) seconds of data-parallel communication per step."""
        c = self.cfg
        if dp <= 1:
            return 0.0, 0.0
        try:
            g = (2 if c.precision == "mixed" else 4) * params_dev
            w = self.elem * params_dev
            bucket = min(1.0, c.bucket_bytes / g) if g else 1.0
            window = bwd_s * (1 - bucket) if c.overlap else 0.0

            def hidden(t_comm: float, win: float) -> float:
                return max(t_comm - win, t_comm * bucket) if c.overlap else t_comm

            if c.zero == 0:
                t_ar = self._dp_time("allreduce", g, dp)
                return hidden(t_ar, window), t_ar
            t_rs = self._dp_time("reduce_scatter", g, dp)
            t_ag = self._dp_time("allgather", w, dp)
            if c.zero in (1, 2):
                n_rs = m if c.zero == 2 else 1  # ZeRO-2 reduces every micro-batch
                return n_rs * hidden(t_rs, window) + t_ag, n_rs * t_rs + t_ag
            # ZeRO-3: per micro-batch gather for forward and backward, reduce-scatter grads
            first = t_ag / max(1, self._spec_layers())
            fwd_exp = max(first, t_ag - fwd_s) if c.overlap else t_ag
            bwd_exp = max(0.0, t_ag + t_rs - bwd_s) if c.overlap else t_ag + t_rs
            return m * (fwd_exp + bwd_exp), m * (2 * t_ag + t_rs)
        except ProfileError as err:
            self.notes.append(f"data-parallel communication not modelled: {err}")
            return 0.0, 0.0

    def _overlap_note(self, dp: int) -> None:
        c = self.cfg
        if dp <= 1:
            return
        if not c.overlap:
            self.notes.append("overlap: none (--no-overlap): all DP communication is exposed")
            return
        rule = {
            0: "gradient all-reduce hidden behind the last micro-batch's backward except one "
            f"{c.bucket_bytes / 2**20:g} MiB bucket",
            1: "gradient reduce-scatter hidden as for DP; parameter all-gather after the "
            "optimizer step exposed",
            2: "reduce-scatter every micro-batch, hidden behind its backward except one bucket; "
            "parameter all-gather after the step exposed",
            3: "parameter all-gathers hidden behind forward/backward compute except the first "
            "layer's; gradient reduce-scatter behind backward",
        }[c.zero]
        self.notes.append(f"overlap: {rule}; compute slowdown from overlap not modelled")

    def _spec_layers(self) -> int:
        spec = self._spec()
        return spec.n_layer if isinstance(spec, TransformerSpec) else 1

    def _optimizer_time(self, params_dev: int, dp: int) -> float:
        """One memory-bound pass over the owned parameters (fused Adam / SGD)."""
        c = self.cfg
        owned = math.ceil(params_dev / dp) if c.zero >= 1 else params_dev
        # bytes per parameter read + written by the update: Adam 28 (fp32 g,p,m,v in;
        # p,m,v out), SGD 20
        per = 28 if c.optimizer == "adam" else 20
        if c.precision == "mixed":
            # fp32 master weights (Megatron-LM's FP16 optimizer, apex amp O2 alike): the half
            # gradients are copied into fp32 (2 in, 4 out) and unscaled with the inf/NaN
            # check (4 in, 4 out) before the update, and the updated master weights copied
            # back to half (4 in, 2 out) after it: 20 more
            per += 20
        return self._memo(
            ("opt", owned, per),
            lambda: self.cost.compute_time(
                12 * owned, per * owned, "vector", "fp32", optimizer=c.optimizer == "adam"
            ),
        )

    # ---- MLP
    def _mlp(
        self, spec: MLPSpec, mem: dict, dp: int, m: int, micro: int, out: dict
    ) -> tuple[float, float]:
        e = self.elem
        sizes = spec.sizes
        # same workspace as simdist.models.fc_mnist: outputs, hidden grads, probs, losses
        elems = micro * (sum(sizes[1:]) + sum(sizes[1:-1]) + sizes[-1] + 1)
        mem["activations"] = e * elems
        f = b = 0.0
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
            gemm = Op(
                f"fc{i}",
                "matmul",
                2 * micro * n_in * n_out,
                e * (micro * n_in + n_in * n_out + micro * n_out),
            )
            act = Op(f"act{i}", "vector", 2 * micro * n_out, 3 * e * micro * n_out)
            f += self._op_time(gemm) + self._op_time(act)
            b += 2 * self._op_time(gemm) + self._op_time(act)
        loss = Op("softmax_ce", "vector", 5 * micro * sizes[-1], 3 * e * micro * sizes[-1])
        f += self._op_time(loss)
        b += self._op_time(loss)
        params = spec.param_count()
        dp_exp, dp_total = self._dp_sync(params, dp, m, f, b)
        self._overlap_note(dp)
        opt = self._optimizer_time(params, dp)
        out.update(
            forward_compute=m * f,
            backward_compute=m * b,
            dp_comm_total=dp_total,
            dp_comm_exposed=dp_exp,
            optimizer=opt,
        )
        flops = 6 * params * micro * m * dp
        return m * (f + b) + dp_exp + opt, float(flops)

    # ---- weight streaming (Cerebras)
    def _weight_store_note(self, spec: Any) -> None:
        c, store_link = self.cfg, self.profile.streaming
        if store_link is None:
            return
        store = sum(model_state_bytes(spec.param_count(), 1, 0, c.precision, c.optimizer).values())
        if store > store_link.capacity_bytes:
            self.notes.append(
                f"model states {store / 1e12:.2f} TB exceed the weight store "
                f"({store_link.capacity_bytes / 1e12:.1f} TB)"
            )

    def _weight_streaming(
        self, spec: Any, mem: dict, micro: int, seq: int, m: int, out: dict
    ) -> tuple[float, None]:
        c, e, prof = self.cfg, self.elem, self.profile
        params = spec.param_count()
        self._weight_store_note(spec)
        layer = spec.layer_params() if isinstance(spec, TransformerSpec) else params
        mem["parameters"] = e * layer  # one streamed layer on the wafer at a time
        mem["gradients"] = e * layer
        if isinstance(spec, TransformerSpec):
            per_layer = layer_activation_bytes(spec, micro, seq, recompute=c.recompute, elem=e)
            mem["activations"] = per_layer * spec.n_layer
        self.notes.append(
            "weight streaming: optimizer state and master weights live in the weight store "
            "(MemoryX); the step below is the streaming I/O bound"
        )
        assert prof.streaming is not None
        io = prof.streaming.bandwidth
        w = e * params
        # per micro-batch: weights in for forward, in again for backward while the gradients
        # (same size) stream out on the other direction of the full-duplex links
        t_io = m * 2 * w / io
        out["weight_streaming_io"] = t_io
        if not prof.has_peak("matmul", self.dtype):
            self.notes.append(f"{prof.name} publishes no {self.dtype} peak: compute not modelled")
        return t_io, None


__all__ = [
    "ATTENTION_CORE",
    "DDP_BUCKET_BYTES",
    "AnalyticStep",
    "Op",
    "transformer_layer_ops",
]
