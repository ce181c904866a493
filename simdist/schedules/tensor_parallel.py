"""Tensor parallelism in weight mode (``runconfig.tensor_parallel: T``,
``tensor_parallel_mode: weight``): GPT-2's layers split Megatron-style over T ranks of one
node (``simdist.models.gpt2_tp``), composed with data parallelism (ZeRO 0-2) on the
outer axis. (With a pipeline, ``simdist.schedules.pipeline`` runs the split on each stage
and shares this module's norm, row-share and checkpoint helpers.)

Placement, as ``pipeline`` places it without stages: world = D x T, tensor-parallel ranks
innermost, so rank d T + t is shard t of replica d. Two sub-communicators: the group's T
ranks (the model's all-reduces, through simdist's collectives) and the D ranks holding the
same shard t (the data-parallel gradient sync). Everything else is ``DataParallel``'s, run
on shard-sized buffers: each rank's flat layout is its shard's parameters
(``GPT2TP.parameter_specs``), reduced, ZeRO-partitioned, updated and checked over its D
replicas exactly as data parallelism does over the whole model.

Replicated parameters (LayerNorms, ``wpe``, the row-parallel biases) get bit-identical
gradients on the T ranks (the model computes them from all-reduced, hence identical,
inputs), every shard-t data-parallel group reduces them with the same algorithm over the
same flat offsets, and the optimizer updates them identically: the copies never drift, and
``check_replicas`` compares their hash across the group at every summary. The clipping norm
counts them once: each rank's share is its sharded elements plus, on shard 0 only, its
replicated ones, summed over the group and then over the replicas.

Checkpoints hold whole tensors (Hugging Face shapes, the one-rank flat layout): rank 0
gathers every shard's parameters and optimizer state and writes them as a one-rank run
would, with ``tensor_parallel`` and ``tensor_parallel_mode`` recorded. A run refuses a
checkpoint of another degree; ``python -m simdist.checkpoint reshard`` only rewrites the
recorded degree, since each rank takes its slice of the whole tensors when it resumes.

Sequence parallelism (``runconfig.sequence_parallel``, ``gpt2_tp``'s docstring): the
group's collectives around the split layers are reduce-scatters and all-gathers; the
LayerNorms' and ``wpe``'s gradients are each rank's share of the token rows, summed over
the group once per step (one all-reduce of those gradients, as Megatron does) after the
data-parallel reduction (sums in either order; with ZeRO-2 the bucket's reduce-scatter
has already left only this rank's slice, the same offsets on every shard) and before the
norm and the update, so the copies again receive the same bits.

Mixed precision (``runconfig.precision`` bf16 / fp16) is data parallelism's
(``simdist.precision``): the fp32 master is optimizer state of the shard's update range,
the weights its half rounding, the gradients stored half and reduced in half unless
``fp32_allreduce`` (the sequence-parallel row shares' sum over the group too); the model
stores its activations half and runs the group's activation collectives on a half wire
(``GPT2TP.set_precision``). Where that takes less host memory the shard's weights are
16-bit words read through a float32 stage window, as data parallelism holds them
(``simdist.packed_params``), and its saved activations too (``saved_words``): the same
bits as float32 words. fp16 scales the loss: an Inf or NaN in any shard's gradients
reaches the whole group through the norm's sum over it, and every replica through the
per-step agreement, so every rank skips the same steps. Checkpoints record the precision
and the scaler; the master is saved whole like the other optimizer state.

The simulated device: each rank's memory holds its shard (parameters, gradients,
optimizer state) and its shard's activation arena; its kernels are the shard's
(``gpt2_tp.kernel_costs``); the group's all-reduces are recorded during forward and
backward like any collective and placed on the virtual clock after that phase's kernels,
exposed (Megatron's are blocking), and in the Chrome trace. (With ZeRO-2 the backward's
reduce-scatters are then placed after the backward too, not overlapped, and the
simulation notes it.)
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from simdist import simulate
from simdist.arena import Layout
from simdist.comm import Collectives
from simdist.comm.topology import Placement, placement
from simdist.config import ConfigError
from simdist.data.datasets import build_dataset
from simdist.device.collective import Network
from simdist.faults import nonfinite_text
from simdist.kernels.blas import half_operands
from simdist.kernels.optim import sum_of_squares
from simdist.loss_scale import scaler_for, scaler_report
from simdist.memplan import DeviceAllocator, check_device_memory
from simdist.models import gpt2_tp
from simdist.models.gpt2 import build_gpt2, parameter_specs
from simdist.models.gpt2_tp import GPT2TP, extract, insert, shard_index
from simdist.precision import Precision, canonical
from simdist.schedules.base import StateShard, StepResult
from simdist.schedules.data_parallel import DataParallel, tensor_parallel_groups

F32 = np.float32


def sub_placement(place: Placement, members: list[int], index: int) -> Placement:
    """The placement of the sub-communicator of world ranks ``members`` (this rank is
    ``members[index]``), nodes renumbered in order of first member."""
    nodes: dict[int, int] = {}
    return Placement(index, tuple(nodes.setdefault(place.node_of[m], len(nodes)) for m in members))


def shard_of_whole(
    index: dict[str, Any], whole: Layout, flat: np.ndarray, shard: Layout
) -> np.ndarray:
    """A shard's flat buffer (layout ``shard``) cut from whole tensors ``flat`` (layout
    ``whole``, the one-rank model's): what a weight-mode rank takes from a checkpoint.
    ``index``: the shard's ``shard_index``."""
    local = np.zeros(shard.padded, F32)
    views, src = shard.views(local), whole.views(flat)
    for name, split in index.items():
        views[name][...] = extract(src[name], split)
    return local


def assemble_whole(
    cfg: Any,
    T: int,
    shard: Layout,
    whole: Layout,
    parts: list[tuple],
    params: np.ndarray,
    state: dict[str, np.ndarray],
) -> None:
    """Rank 0 of a weight-mode run before a checkpoint: whole tensors (layout ``whole``)
    written into ``params`` and ``state`` from every rank's pieces of its shard's flat
    layout ``shard``. ``parts``: per rank (shard t, flat index of its parameters,
    parameters or None, [lo, hi) of its optimizer state, that state by key, maybe empty)."""
    local = [np.zeros(shard.padded, F32) for _ in range(T)]
    local_state = {k: [np.zeros(shard.padded, F32) for _ in range(T)] for k in state}
    for t, plo, values, lo, hi, st in parts:
        if values is not None:
            local[t][plo : plo + values.size] = values
        for k, v in st.items():
            local_state[k][t][lo:hi] = v
    out = whole.views(params)
    out_state = {k: whole.views(state[k]) for k in state}
    for t in range(T):
        views = shard.views(local[t])
        state_views = {k: shard.views(local_state[k][t]) for k in local_state}
        for name, split in shard_index(cfg, T, t).items():
            insert(out[name], views[name], split)
            for k in out_state:
                insert(out_state[k][name], state_views[k][name], split)


def whole_staging(
    comm, shard: StateShard | None, whole: Layout, keys, size: int | None = None
) -> StateShard:
    """Whole-model buffers (layout ``whole``; host memory, not the device's) for ``Run``'s
    checkpoint reader and writer in weight mode: every rank holds them while it resumes,
    rank 0 for each save. ``shard``: the object ``Run`` holds, refilled in place (None: a
    new one); ``keys``: the optimizer state's; ``size``: 0 releases them."""
    n = whole.padded if size is None else size
    state = {k: np.zeros(n, F32) for k in keys}
    if shard is None:
        return StateShard(comm, 0, 1, 0, n, state, sharded=False, params=np.zeros(n, F32))
    shard.state, shard.params = state, np.zeros(n, F32)
    return shard


def shards_agree(comm, views: dict[str, np.ndarray], names: list[str]) -> bool:
    """Collective over the group ``comm``: do its ranks hold the same bits in the
    replicated parameters ``names`` (a hash of each rank's ``views`` compared)?"""
    digest = 0
    for name in names:
        digest = zlib.crc32(np.ascontiguousarray(views[name]).view(np.uint8), digest)
    return len(set(comm.allgather(digest))) == 1


def norm_share(grads: np.ndarray, parts: list[tuple[int, int]], acc: float = 0.0) -> float:
    """``acc`` plus the float64 sums of squares of ``grads[a:b]`` for each part, added in
    order: a rank's share of the clipping norm (its split elements, the replicated ones on
    shard 0 only). A pipeline passes ``acc`` from stage to stage, so its last stage holds
    the bits one weight-mode rank computes over the same parts."""
    for a, b in parts:
        acc += sum_of_squares(grads[a:b])
    return acc


def sum_row_shares(
    coll, grads: np.ndarray, parts: list[tuple[int, int]], buf: np.ndarray, store=None
) -> None:
    """Sequence parallelism: the LayerNorms' and wpe's gradients ``grads[a:b]`` summed over
    the group ``coll`` in one all-reduce of ``buf`` (packed; simdist's algorithms leave the
    same bits on every rank, so the replicated copies stay equal). ``store``: on a half
    wire, the precision's rounding, applied first: a half wire sums half values, and under
    ZeRO-2 with accumulation these gradients are float32 sums of the micro-batches' (left
    unrounded, a rank's own operand would enter its blocks' sums at full precision and the
    others' rounded, so the bits would depend on how the buffer is cut into blocks)."""
    o = 0
    for a, b in parts:
        buf[o : o + b - a] = grads[a:b]
        o += b - a
    if store is not None:
        store(buf)
    coll.allreduce(buf)
    o = 0
    for a, b in parts:
        grads[a:b] = buf[o : o + b - a]
        o += b - a


class WholeTensorCheckpoint:
    """Weight mode's checkpoints hold whole tensors, as a one-rank run writes them (for
    ``TensorParallelWeight`` and weight mode on a pipeline): world rank 0 assembles them
    from every rank's pieces into a host staging buffer ``Run`` writes."""

    def _staging(self, size: int | None = None) -> None:
        self.state_shard = whole_staging(
            self.comm, self.state_shard, self.checkpoint_layout, self.optimizer.state, size
        )

    def _gather_whole(self, part: tuple) -> None:
        """Collective over every rank: ``part`` (this rank's pieces, as ``assemble_whole``
        takes them) gathered to world rank 0, which writes the whole tensors."""
        parts = self.comm.gather(part, root=0)
        if parts is None:
            return
        self._staging()
        own = self.state_shard
        assemble_whole(self.model.config, self.T, self.layout, self.checkpoint_layout, parts,
                       own.params, own.state)  # fmt: skip


class TensorParallelWeight(WholeTensorCheckpoint, DataParallel):
    name = "pipelined"

    def __init__(self, comm, tp: int):
        world = comm.Get_size()
        if world % tp:
            raise ConfigError(
                f"runconfig.tensor_parallel={tp} must divide the {world} ranks (groups of {tp} "
                "consecutive ranks); start a multiple of it",
                "runconfig.tensor_parallel",
            )
        r = comm.Get_rank()
        self.T, self.D = tp, world // tp
        self.tp_rank, self.dp_rank = r % tp, r // tp
        self.tp_comm = comm.Split(self.dp_rank, self.tp_rank)  # this replica's T shards
        self.dp_comm = comm.Split(self.tp_rank, self.dp_rank)  # shard t of every replica
        super().__init__(comm)
        self.replicas, self.ranks = self.D, world
        self.world_rank, self.world_size = r, world
        # the data-parallel axis: sampler, flat-layout slices, memory plan, gradient sync
        self.rank, self.world = self.dp_rank, self.D

    # ----------------------------------------------------------------- set-up
    def prepare(self, run) -> None:
        self.params, r = run.params, run.params.runconfig
        self.zero_level = r.zero_opt_level
        self.micro_batch = run.micro_batch
        self.tensor_parallel = self.T
        place = (
            placement(self.comm)
            if r.ranks_per_node is None
            else Placement.blocks(self.world_rank, self.world_size, r.ranks_per_node)
        )
        self.tp_groups = tensor_parallel_groups(place, self.T)  # one node each, else exit 2
        self.world_placement = place
        dp_members = [d * self.T + self.tp_rank for d in range(self.D)]
        tp_members = [self.dp_rank * self.T + t for t in range(self.T)]
        dp_place = sub_placement(place, dp_members, self.dp_rank)
        if r.collective_algorithm == "hierarchical" and not dp_place.uniform:
            raise ConfigError(
                "runconfig.collective_algorithm=hierarchical needs the same number of "
                "data-parallel ranks on every node",
                "runconfig.collective_algorithm",
            )
        if r.collective_algorithm == "shm" and dp_place.num_nodes > 1:
            raise ConfigError(
                "runconfig.collective_algorithm=shm needs every rank on one node",
                "runconfig.collective_algorithm",
            )
        self.placement = dp_place
        self.coll = Collectives(
            self.dp_comm, r.collective_algorithm, r.check_collectives, placement=dp_place
        )
        # the group sits on one node. simdist's ring, rhd and shm leave the same bits on
        # every rank of the group, which the replicated parameters rely on; MPI's native
        # all-reduce does not promise it (and hierarchical needs several nodes): auto there
        tp_alg = (
            r.collective_algorithm if r.collective_algorithm in ("ring", "rhd", "shm") else "auto"
        )
        self.tp_coll = Collectives(
            self.tp_comm,
            tp_alg,
            r.check_collectives,
            placement=sub_placement(place, tp_members, self.tp_rank),
        )
        # mixed precision as data parallelism runs it (``DataParallel.prepare``): fp32
        # master, half weights and activations, gradients reduced in half unless
        # fp32_allreduce; the group's activation collectives in half (``GPT2TP.set_precision``)
        self.precision = Precision(canonical(r.precision) or "fp32")
        self.scaler = scaler_for(r, self.precision.name)
        self.skipped_steps_at_start = 0
        half = self.precision.half is not None
        self.grad_wire = self.precision.fmt if half and not r.fp32_allreduce else 0
        self.param_wire = self.precision.fmt if half else 0
        self.gemm = half_operands(self.precision.fmt if half else None)
        self.device = simulate.create_device(run.profile, self.comm, place, self.precision.half)
        self.memory = DeviceAllocator(self.device.memory, self.coll)
        whole = build_gpt2(self.params.model).config
        self.model = GPT2TP(whole, self.T, self.tp_rank, r.sequence_parallel)
        self.model.set_precision(self.precision)
        self.data = build_dataset(self.params, self.micro_batch)
        self._choose_shared_buffers(run)
        check_device_memory(self)  # the shard's tensors, before any buffer exists
        t = self.params.train_input
        origin = "global given" if t.global_batch_size is not None else "per replica given"
        groups = " ".join(f"{list(g)}" for g in self.tp_groups)
        C, H, V = whole.n_embd, whole.n_head, whole.vocab_size
        run.log(
            f"simdist: tensor parallel (weight mode), {self.D} replica(s) x {self.T} shards "
            f"(rank r: shard r % {self.T}, replica r // {self.T}); groups on one node: "
            f"{groups}; each shard holds {H // self.T} of {H} heads, {4 * C // self.T} of "
            f"{4 * C} MLP columns, {V // self.T} of {V} vocabulary rows"
            + (
                f"; sequence parallel: 1/{self.T} of each micro-batch's token rows between "
                "the split layers"
                if r.sequence_parallel
                else ""
            )
        )
        run.log(
            f"simdist: {self.D} replica(s), model {self.model.name}, micro-batch "
            f"{self.micro_batch} x {self.params.optimizer.grad_accum_steps} accumulation, "
            f"global batch {run.global_batch} ({origin}), ZeRO-{self.zero_level} on the "
            f"data-parallel axis, collectives {r.collective_algorithm}, precision "
            f"{self.precision.name}{self._precision_note()}; data: {self.data.source}"
        )

    def warm(self) -> None:
        gpt2_tp._warm()  # the vocab-parallel softmax (rank 0 first, as every kernel)

    def allocate(self, run) -> None:
        super().allocate(run)
        sim = self.sim
        # the group's all-reduces on this rank's clock and trace, costed over the group
        tp_rec = simulate.RecordingCollectives(self.tp_coll, sim, False, 0)
        self.model.bind(tp_rec)
        self.tp_rec = tp_rec
        place = self.world_placement
        nodes = tuple(tuple(place.members(m)) for m in range(place.num_nodes))
        # collectives are costed on their own blocks; the network names every rank
        sim.model.net = Network(self.world_size, self.world_rank, place.link_class(), nodes)
        sim.world, sim.rank = self.world_size, self.world_rank  # trace: one track per rank
        # the replicated and the split parts of this rank's flat range (for the norm)
        lo, hi = self.sync.partition
        split = self.model.index
        self._norm_parts = [
            (seg.lo - self.sync.update_range[0], seg.hi - self.sync.update_range[0])
            for seg in self.layout.segments(lo, hi)
            if split[seg.name] is not None or self.tp_rank == 0
        ]
        self._replicated = [n for n, s in split.items() if s is None]
        # sequence parallelism: the row-share gradients inside this rank's update range
        ulo, uhi = self.sync.update_range
        partial = set(self.model.sequence_parallel_names())
        self._row_share_parts = [
            (seg.lo - ulo, seg.hi - ulo)
            for seg in self.layout.segments(ulo, uhi)
            if seg.name in partial
        ]
        # host scratch (a few rows of C floats per layer, plus wpe), not the device arena
        self._row_share = np.zeros(sum(b - a for a, b in self._row_share_parts), F32)
        if self._row_share_parts:  # its all-reduce on the clock as a gradient sync
            sim.hook(self, "_sum_row_shares", "sync")
        # checkpoints: whole tensors in the one-rank layout (``Run`` reads and writes it)
        self.checkpoint_layout = Layout(parameter_specs(self.model.config), 1)
        self.state_shard = None  # data parallelism's (the shard's range) is not Run's
        self._staging()

    def restore(self, run, path, attrs: dict[str, Any], loaded: set[str]) -> None:
        """This rank's slice of the whole tensors ``Run`` read: parameters, and the
        optimizer state of its update range (mixed precision: the fp32 master among it);
        then ``DataParallel.restore``: the loss scaler, and the master of a checkpoint
        written in fp32 taken from its parameters."""
        own, full, index = self.state_shard, self.checkpoint_layout, self.model.index
        shard = shard_of_whole(index, full, own.params, self.layout)
        if self.packed is not None:  # 16-bit words, and the master of the update range
            self._write_packed(0, shard)
        else:
            self.params_flat[...] = shard
        lo, hi = self.sync.update_range
        for key in loaded:
            self.optimizer.state[key][...] = shard_of_whole(index, full, own.state[key],
                                                            self.layout)[lo:hi]  # fmt: skip
        super().restore(run, path, attrs, loaded)

    def feed(self, run) -> None:
        super().feed(run)
        self._staging(0)  # release the resume staging

    # ----------------------------------------------------------------- the step
    def step(self, run, step: int, guard) -> StepResult:
        n = step + 1
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss = self._forward_backward(step, guard, scale)  # the data-parallel step's
        with self.coll.half_wire(self.grad_wire):
            grads, _ = self.sync.reduce_gradients(self.grads)  # averaged over the D replicas
        if self._row_share_parts:
            with self.tp_coll.half_wire(self.grad_wire):  # a gradient collective too
                self._sum_row_shares(grads)
        if scale != 1.0:  # unscaled before the norm, clipping and the update (GradScaler)
            np.multiply(grads, F32(1.0 / scale), out=grads)
        # this replica slice's share of the norm: split elements of every shard, the
        # replicated ones once (shard 0's); the same total on every rank of the group (an
        # overflow anywhere in the group makes it Inf or NaN on all of them)
        split = norm_share(grads, self._norm_parts)
        own_sumsq = float(self.tp_rec.allreduce_scalars(np.array([split]))[0])
        # every shard holds the same loss: the agreement sums it over the D replicas; the
        # group's sum carries an overflow to every shard, the agreement to all
        explain = lambda: nonfinite_text(n)  # noqa: E731
        return self._finish_step(run, step, grads, own_sumsq, loss, guard, explain)

    def _sum_row_shares(self, grads: np.ndarray) -> None:
        store = self.precision.store if self.grad_wire else None
        sum_row_shares(self.tp_rec, grads, self._row_share_parts, self._row_share, store)

    def check_replicas(self, step: int) -> None:
        """Shard t's D replicas hold the same bits, and the T shards the same replicated
        parameters: hashes compared across each axis."""
        digest = zlib.crc32(self.params_flat.view(np.uint8))
        if len(set(self.dp_comm.allgather(digest))) != 1:
            raise RuntimeError(f"replicas of shard {self.tp_rank} diverged at global_step {step}")
        if not shards_agree(self.tp_comm, self._replicated_views(), self._replicated):
            raise RuntimeError(
                f"the replicated parameters of replica {self.dp_rank}'s shards diverged at "
                f"global_step {step}"
            )

    def _replicated_views(self) -> dict[str, np.ndarray]:
        """The replicated parameters as this rank holds them (16-bit words: their words)."""
        if self.packed is None:
            return self.pviews
        words, offsets = self.packed.words, self.layout.offsets
        specs = {s.name: s for s in self.layout.specs}
        return {n: words[offsets[n] : offsets[n] + specs[n].numel] for n in self._replicated}

    # ----------------------------------------------------------------- around the steps
    def checkpoint_attrs(self) -> dict[str, Any]:
        """Data parallelism's (precision, the loss scaler's state), in weight mode."""
        attrs = super().checkpoint_attrs()
        attrs.update({"tensor_parallel": self.T, "tensor_parallel_mode": "weight"})
        return attrs

    def checkpoint_parameters(self, run) -> dict[str, np.ndarray] | None:
        """Rank 0: the whole parameters ``before_checkpoint`` assembled."""
        if self.world_rank != 0:
            return None
        return self.checkpoint_layout.views(self.state_shard.params)

    def before_checkpoint(self, run) -> None:
        """Collective, before ``Run`` saves: rank 0 assembles whole tensors from every
        shard (parameters from replica 0, optimizer state from each replica's range) into
        the staging buffers ``Run`` writes."""
        lo, hi = self.sync.update_range
        first = self.dp_rank == 0
        params = self.params_flat
        if first and self.packed is not None:  # the shard's words as float32, for the gather
            params = self.packed.unpack(0, self.layout.padded)
        mine = (
            self.tp_rank,
            0,
            params if first else None,
            lo,
            hi,
            {k: v for k, v in self.optimizer.state.items()} if first or self.zero_level else {},
        )
        self._gather_whole(mine)

    def performance(self, run, common: dict[str, Any]) -> dict[str, Any] | None:
        tp_sent = self.tp_coll.bytes_sent - self._tp_bytes_at_start
        out = super().performance(run, common)
        steps = max(common["steps"], 1)
        per_rank = self.comm.gather(
            {
                "memory_bytes": dict(self.memory.bytes),
                "parameters": self.layout.numel,
                "tp_bytes": tp_sent / steps,
                **scaler_report(self.scaler, self.skipped_steps_at_start),
            },
            root=0,
        )
        if out is None or per_rank is None:
            return out
        out.update(
            {
                "world_size": self.world_size,
                "replicas": self.D,
                "tensor_parallel": self.T,
                "tensor_parallel_mode": "weight",
                "parameters": self.checkpoint_layout.numel,  # the whole model
                "parameters_per_rank": self.layout.numel,
                "parameters_padded_per_rank": self.layout.padded,
                "memory_bytes_per_rank": [x["memory_bytes"] for x in per_rank],
                "tensor_parallel_bytes_sent_per_step": max(x["tp_bytes"] for x in per_rank),
                "comm_bytes_sent_per_step": out["comm_bytes_sent_per_step"] + tp_sent / steps,
            }
        )
        if self.scaler is not None:  # every rank's scaler (the same when they agreed)
            out["loss_scale_per_rank"] = [x["loss_scale"] for x in per_rank]
            out["skipped_steps_per_rank"] = [x["skipped_steps"] for x in per_rank]
        return out

    def start(self, run) -> None:
        super().start(run)
        self._tp_bytes_at_start = self.tp_coll.bytes_sent
