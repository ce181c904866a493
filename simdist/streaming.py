"""Weight-streaming execution (Cerebras MemoryX / SwarmX) on MPI ranks.

``runconfig.execution_mode: weight_streaming`` (``--execution_mode``) splits the ranks into
roles (``simdist.comm.groups``): W weight servers (``--weight_servers``) hold the
parameters, the gradients and the optimizer state, sharded among themselves; R devices run
the model; optional input workers feed the devices. The devices hold no parameters: the
weights of each stage (``simdist.models.stages``; for GPT-2 the embedding, each block, the
head) arrive just in time, forward and again in backward, and leave with the stage.

Servers. Server s owns a contiguous run of whole gradient groups (balanced by size), so
every group has one owner: ``StreamPlan.ranges``. It owns that flat range of the
parameters (a slice of the same flat ``Layout`` data parallelism uses) and the optimizer
state for it, and applies the optimizer to it after every step.

Communicators. ``stream[s]`` = server s + all devices: s broadcasts each piece of a stage's
weights it owns there (``MPI_Ibcast``); ``grads[s]``: same members, devices send s the
reduced gradient pieces of s's groups; ``devices``: the reduce-scatter among devices;
``servers``: the norm chain and checkpoint gathers; ``active`` (servers + devices): the
per-step agreement on loss, norm and stop.

Streaming window. A device preallocates ``prefetch_depth + 1`` weight slots, each the size
of the largest stage, accounted as ``streaming_window``: while it computes stage j, the
weights of stages j+1 .. j+depth are in flight (posted Ibcasts). Gradient sink: two
gradient slots (double buffering: one group's gradients go out while the next is computed)
plus a region for held groups (GPT-2's tied embeddings: written by the head's backward,
finished by the embedding's). A device's accounted memory is that window, the activation
arena and the collectives' scratch: never the model.

Reduction order (bitwise parity with data parallelism). When a stage's backward finishes a
gradient group, the devices reduce-scatter it over their own communicator with the slice
boundaries of the data-parallel layout for R ranks, exactly as ZeRO-2 does, and each device
sends its reduced block to the group's owner. Every element is summed in the order DP's
all-reduce over R ranks sums it (``simdist.parallel``), and averaged the same way. The
gradient norm for clipping is the same float64 sum: DP adds, per slice, squares in four
interleaved lanes (``sum_of_squares``) and then the slices in rank order; the servers
rebuild those lane sums by passing the lane accumulators along the server chain in flat
order (``lane_sum_of_squares``), then add the slices in the same order. The update is
element-wise. So R devices train to the same bits as DP (ZeRO 0/1/2) on R ranks with
``grad_accum_steps = 1``, and as ZeRO-2 with accumulation (per-micro-batch reduction).

Simulated time (``simulate_step``): the device's compute per stage from the model's kernel
costs and the profile, weight transfers over the profile's streaming bandwidth (MemoryX to
system; one transfer at a time, into a free slot, so ``prefetch_depth`` decides the
overlap), gradients out over the other direction of the same full-duplex link (SwarmX
reduces them on the way). Exposed streaming time = step time - compute time. Not modelled:
the servers' optimizer time (MemoryX publishes no compute figure) and link latency where the
profile gives none.
"""

from __future__ import annotations

import json
import resource
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from simdist import checkpoint
from simdist.arena import Layout
from simdist.comm import Collectives
from simdist.comm import groups as g
from simdist.comm.groups import DEVICE, SERVER, WORKER, Groups, Roles
from simdist.config import ConfigError, Params, batch_sizes, dump_yaml
from simdist.device import CostModel, DeviceMemory, ProfileError, format_bytes, load_profile
from simdist.kernels._jit import kernel
from simdist.lr_schedule import parse_schedule
from simdist.models.base import GradientGroup, GradientViews
from simdist.models.stages import Stage
from simdist.run import RunLog, write_summary

F32 = np.float32
GRADIENT_SLOTS = 2  # one group's gradients in flight while the next is computed
CHAIN_TAG = 0x57  # server-chain lane accumulators on the servers' communicator


@dataclass(frozen=True)
class StreamingOptions:
    """The runconfig keys of weight streaming (read by ``options_from``)."""

    execution_mode: str = "pipelined"
    weight_servers: int = 1
    prefetch_depth: int = 1
    input_workers_per_replica: int = 0


def options_from(params: Params, **override: Any) -> StreamingOptions:
    """The streaming keys of ``params.runconfig`` (defaults where absent), then overrides."""
    r = params.runconfig
    values = {
        f: getattr(r, f, getattr(StreamingOptions, f))
        for f in StreamingOptions.__dataclass_fields__
    }
    values.update({k: v for k, v in override.items() if v is not None})
    opts = StreamingOptions(**values)
    if opts.execution_mode not in ("pipelined", "weight_streaming"):
        raise ConfigError(
            f"runconfig.execution_mode: {opts.execution_mode!r} is not one of pipelined, "
            "weight_streaming"
        )
    if opts.execution_mode == "weight_streaming" and opts.weight_servers < 1:
        raise ConfigError(
            f"runconfig.weight_servers must be >= 1 in weight streaming, got {opts.weight_servers}"
        )
    if opts.prefetch_depth < 0:
        raise ConfigError(f"runconfig.prefetch_depth must be >= 0, got {opts.prefetch_depth}")
    if opts.input_workers_per_replica < 0:
        raise ConfigError(
            "runconfig.input_workers_per_replica must be >= 0, got "
            f"{opts.input_workers_per_replica}"
        )
    return opts


# ------------------------------------------------------------------------- the plan (no MPI)
@dataclass(frozen=True)
class Piece:
    """Flat parameter range [lo, hi), owned by ``server``, at ``at`` in a window slot."""

    server: int
    lo: int
    hi: int
    at: int


@dataclass(frozen=True)
class Item:
    """One transfer into the window: the weights a stage's forward or backward reads."""

    index: int
    stage: int
    phase: str  # "forward" | "backward"
    names: tuple[str, ...]
    pieces: tuple[Piece, ...]
    size: int  # elements


@dataclass(frozen=True)
class GroupRange:
    names: tuple[str, ...]
    lo: int
    hi: int
    held: bool
    owner: int


class StreamPlan:
    """Ownership of the flat parameter range by the servers and the transfers of a step.

    ``layout`` is the data-parallel ``Layout`` for R replicas: its offsets place every
    tensor, its ``bounds`` are the reduce-scatter blocks that make the sums match DP.
    """

    def __init__(
        self,
        layout: Layout,
        stages: list[Stage],
        groups: list[GradientGroup],
        servers: int,
    ):
        self.layout, self.stages, self.servers = layout, list(stages), servers
        specs = {s.name: s for s in layout.specs}
        self.specs = specs
        spans = []
        for grp in groups:
            lo = layout.offsets[grp.names[0]]
            hi = lo
            for n in grp.names:
                if layout.offsets[n] != hi:
                    raise ValueError(f"gradient group {grp.names} is not contiguous")
                hi += specs[n].numel
            spans.append((grp, lo, hi))
        flat = sorted(spans, key=lambda s: s[1])
        edge = 0
        for _, lo, hi in flat:
            if lo != edge:
                raise ValueError("gradient groups must tile the parameters without gaps")
            edge = hi
        if edge != layout.numel:
            raise ValueError("gradient groups must name every parameter once")
        if servers > len(flat):
            raise ConfigError(
                f"runconfig.weight_servers={servers} exceeds the model's {len(flat)} weight "
                "groups (a server owns whole groups); use fewer servers"
            )
        cuts = _balanced_cuts([hi - lo for _, lo, hi in flat], servers)
        self.ranges: list[tuple[int, int]] = []
        owner_of: dict[tuple[str, ...], int] = {}
        for s in range(servers):
            a, b = cuts[s], cuts[s + 1]
            self.ranges.append((flat[a][1], flat[b - 1][2]))
            for grp, _, _ in flat[a:b]:
                owner_of[grp.names] = s
        # in the model's order (the order backward finishes them): index = message tag
        self.groups = [
            GroupRange(grp.names, lo, hi, grp.held, owner_of[grp.names]) for grp, lo, hi in spans
        ]
        self.group_of = {n: i for i, gr in enumerate(self.groups) for n in gr.names}
        self.forward_items: list[Item] = []
        self.backward_items: list[Item] = []
        for k, st in enumerate(self.stages):
            self.forward_items.append(self._item(len(self.forward_items), k, "forward", st))
        nf = len(self.forward_items)
        for k in range(len(self.stages) - 1, -1, -1):
            st = self.stages[k]
            if st.backward_params:
                idx = nf + len(self.backward_items)
                self.backward_items.append(self._item(idx, k, "backward", st))
        self.backward_item_of = {it.stage: it for it in self.backward_items}
        self.slot_size = max(it.size for it in self.forward_items + self.backward_items)
        # gradient slots: groups that are not held share them; held ones have their own
        self.shared_group_size = max(
            (gr.hi - gr.lo for gr in self.groups if not gr.held), default=0
        )
        self.held_size = sum(gr.hi - gr.lo for gr in self.groups if gr.held)
        # which stage's backward finishes each group: the last one (lowest k) reading all of it
        self.finishes: dict[int, list[int]] = {k: [] for k in range(len(self.stages))}
        for i, gr in enumerate(self.groups):
            ks = [k for k, st in enumerate(self.stages) if set(gr.names) <= set(st.forward_params)]
            if ks:
                self.finishes[min(ks)].append(i)

    def owner(self, index: int) -> int:
        for s, (lo, hi) in enumerate(self.ranges):
            if lo <= index < hi:
                return s
        raise IndexError(index)

    def _item(self, index: int, k: int, phase: str, st: Stage) -> Item:
        names = st.forward_params if phase == "forward" else st.backward_params
        spans = sorted(
            (self.layout.offsets[n], self.layout.offsets[n] + self.specs[n].numel) for n in names
        )
        merged: list[list[int]] = []
        for lo, hi in spans:  # adjacent tensors with one owner travel as one piece
            if merged and merged[-1][1] == lo and self.owner(lo) == self.owner(merged[-1][0]):
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        pieces, at = [], 0
        for lo, hi in merged:
            while lo < hi:  # a piece never crosses a server boundary
                s = self.owner(lo)
                end = min(hi, self.ranges[s][1])
                pieces.append(Piece(s, lo, end, at))
                at += end - lo
                lo = end
        return Item(index, k, phase, tuple(names), tuple(pieces), at)

    def views(self, item: Item, slot: np.ndarray) -> dict[str, np.ndarray]:
        """Named parameter views of ``item``'s weights in a window slot."""
        out = {}
        for n in item.names:
            off, spec = self.layout.offsets[n], self.specs[n]
            p = next(p for p in item.pieces if p.lo <= off < p.hi)
            start = p.at + off - p.lo
            out[n] = slot[start : start + spec.numel].reshape(spec.shape)
        return out

    def train_items(self, accum: int) -> list[Item]:
        return (self.forward_items + self.backward_items) * accum

    def streamed_elements(self, accum: int = 1) -> dict[str, int]:
        """The analysis: per device and step, elements in (weights) and out (gradients)."""
        fwd = sum(it.size for it in self.forward_items)
        bwd = sum(it.size for it in self.backward_items)
        return {
            "weights_in_forward": accum * fwd,
            "weights_in_backward": accum * bwd,
            "weights_in": accum * (fwd + bwd),
            "gradients_out": accum * self.layout.numel,
        }

    def describe(self) -> str:
        parts = []
        for s, (lo, hi) in enumerate(self.ranges):
            names = [gr.names[0].rsplit(".", 2)[0] for gr in self.groups if gr.owner == s]
            parts.append(f"server {s}: {hi - lo:,} parameters ({len(names)} groups)")
        return "; ".join(parts)


def _balanced_cuts(sizes: list[int], parts: int) -> list[int]:
    """Indices cutting ``sizes`` into ``parts`` non-empty contiguous runs of similar sums."""
    prefix = np.concatenate([[0], np.cumsum(sizes)])
    total, n = prefix[-1], len(sizes)
    cuts = [0]
    for k in range(1, parts):
        lo, hi = cuts[-1] + 1, n - (parts - k)
        target = total * k / parts
        best = min(range(lo, hi + 1), key=lambda c: abs(prefix[c] - target))
        cuts.append(best)
    cuts.append(n)
    return cuts


def device_footprint(model, replicas: int, micro_batch: int, depth: int) -> dict[str, int]:
    """Bytes a weight-streaming device will account, by entry (what ``StreamingRun``
    allocates; nothing is allocated here)."""
    from simdist.comm.p2p import DEPTH, SEGMENT

    layout = Layout(model.parameter_specs(), replicas)
    plan = StreamPlan(layout, model.stages(), model.gradient_groups(), 1)
    out = {
        "window.weights": 4 * (depth + 1) * plan.slot_size,
        "window.gradients": 4 * GRADIENT_SLOTS * plan.shared_group_size,
        "window.held_gradients": 4 * plan.held_size,
        "model.arena": int(model.activation_bytes(micro_batch)),
    }
    if replicas > 1:
        out["collectives.scratch"] = 4 * DEPTH * SEGMENT
    return out


def weight_streaming_tip(model, params: Params, micro_batch: int, replicas: int, capacity: int):
    """The out-of-memory hint of a pipelined run: would weight streaming fit, and how big
    is its device footprint? Empty for models without stages."""
    if not hasattr(model, "stages"):
        return ""
    depth = options_from(params).prefetch_depth
    need = sum(device_footprint(model, replicas, micro_batch, depth).values())
    verdict = "would fit" if need <= capacity else "would still need"
    return (
        f"runconfig.execution_mode=weight_streaming {verdict} {format_bytes(need)} per device "
        f"(weights stay on --weight_servers ranks; the device holds a streaming window of "
        f"prefetch_depth + 1 = {depth + 1} blocks and the activations)"
    )


# ------------------------------------------------------------------------- simulated time
@dataclass
class StepTime:
    """One simulated step of one device (seconds, bytes)."""

    total_s: float = 0.0
    compute_s: float = 0.0
    weight_wait_s: float = 0.0  # compute stalled for weights not yet in the window
    gradient_wait_s: float = 0.0  # stalled for a free gradient slot
    drain_s: float = 0.0  # after the last compute, until the last gradient is out
    weights_in_bytes: float = 0.0
    gradients_out_bytes: float = 0.0

    @property
    def exposed_streaming_s(self) -> float:
        return self.total_s - self.compute_s


def simulate_step(
    work: list[tuple[float, float, float]],
    depth: int,
    bandwidth: float | None,
    latency: float = 0.0,
    gradient_slots: int = GRADIENT_SLOTS,
) -> StepTime:
    """Replay one step: ``work`` lists (weight bytes in, compute seconds, gradient bytes
    out) per stage execution, in order. A weight transfer starts when the inbound link is
    free and its slot is (the slot's previous stage, depth + 1 transfers back, has
    computed); a stage computes when the previous one is done and its weights have arrived;
    a stage that produces gradients also needs a free gradient slot (the transfer
    ``gradient_slots`` groups back has left). ``bandwidth`` None: transfers take no time."""
    t = StepTime()
    beta = 0.0 if not bandwidth else 1.0 / bandwidth
    slots = depth + 1
    in_free = out_free = end = 0.0
    weight_done: list[float] = []  # compute end of each stage that used a weight slot
    grad_out: list[float] = []  # transfer end of each gradient
    for w_bytes, compute, g_bytes in work:
        ready = end
        if w_bytes > 0:
            i = len(weight_done)
            slot_free = weight_done[i - slots] if i >= slots else 0.0
            start = max(in_free, slot_free)
            in_free = start + latency + w_bytes * beta
            if in_free > ready:
                t.weight_wait_s += in_free - ready
                ready = in_free
            t.weights_in_bytes += w_bytes
        if g_bytes > 0 and len(grad_out) >= gradient_slots:
            free = grad_out[-gradient_slots]
            if free > ready:
                t.gradient_wait_s += free - ready
                ready = free
        end = ready + compute
        t.compute_s += compute
        if w_bytes > 0:
            weight_done.append(end)
        if g_bytes > 0:
            out_free = max(out_free, end) + latency + g_bytes * beta
            grad_out.append(out_free)
            t.gradients_out_bytes += g_bytes
    t.total_s = max(end, out_free)
    t.drain_s = t.total_s - end
    return t


def stage_compute_times(model, stages: list[Stage], cost: CostModel, batch: int) -> tuple:
    """(forward seconds, backward seconds) per stage on the simulated device, from the
    model's ``kernel_costs`` where it has them (kernel names start with the stage's name;
    the embedding's and the head's are recognised by theirs), else 6 N FLOPs per token.
    Returns (fwd, bwd, note)."""
    nst = len(stages)
    fwd, bwd = [0.0] * nst, [0.0] * nst
    if not cost.profile.has_peak("matmul", cost.dtype):
        return fwd, bwd, f"{cost.profile.name} publishes no {cost.dtype} peak: compute not modelled"
    index = {st.name: k for k, st in enumerate(stages)}
    costs = getattr(model, "kernel_costs", None)
    if costs is not None:
        for kc in costs(batch):
            head = kc.name.split(".")
            key = ".".join(head[:2]) if head[0] == "h" else head[0]
            if key in index:
                k = index[key]
            elif head[0] in ("tokens", "embedding", "wte", "wpe"):
                k = 0
            else:
                k = nst - 1
            secs = kc.count * cost.compute_time(
                kc.flops, kc.bytes, kc.kind, shape=kc.shape, serial_flops=kc.serial_flops
            )
            (fwd if kc.phase == "forward" else bwd)[k] += secs
        return fwd, bwd, "compute: the model's kernel costs on the profile"
    specs = {s.name: s for s in model.parameter_specs()}
    tokens = batch * getattr(getattr(model, "config", None), "block_size", 1)
    for k, st in enumerate(stages):
        n = sum(specs[p].numel for p in st.forward_params if len(specs[p].shape) >= 2)
        fwd[k] = cost.compute_time(2.0 * tokens * n, 4.0 * n)
        bwd[k] = 2 * fwd[k]
    return fwd, bwd, "compute: 2 FLOPs per weight and token forward, twice that backward"


# ------------------------------------------------------------------------- kernels
@kernel
def lane_sum_of_squares(x, first_lane, acc):
    """acc[(first_lane + j) % 4] += float64(x[j])**2 in order: continues the four lanes of
    ``sum_of_squares`` across pieces of one slice, so the servers rebuild its exact sum."""
    for j in range(x.size):
        v = np.float64(x[j])
        lane = (first_lane + j) % 4
        acc[lane] += v * v


def _warm() -> None:
    lane_sum_of_squares(np.ones(5, F32), 1, np.zeros(4))


# ------------------------------------------------------------------------- device side
class WeightWindow:
    """A device's ``prefetch_depth + 1`` weight slots; transfer j lands in slot j % slots."""

    def __init__(self, plan: StreamPlan, stream: list, depth: int, memory: DeviceMemory):
        self.plan, self.stream, self.depth = plan, stream, depth
        self.nslots = depth + 1
        self.buf = memory.allocate(
            "streaming_window", "window.weights", (self.nslots * plan.slot_size,), F32
        )
        self.slots = [
            self.buf[i * plan.slot_size : (i + 1) * plan.slot_size] for i in range(self.nslots)
        ]
        self._views: dict[tuple[int, int], dict] = {}
        self.items: list[Item] = []
        self.reqs: dict[int, list] = {}
        self.bytes_in = 0
        self.wait_s = 0.0

    def start(self, items: list[Item]) -> None:
        self.items, self.reqs = items, {}
        for j in range(min(self.nslots, len(items))):
            self._post(j)

    def _post(self, j: int) -> None:
        item, slot = self.items[j], self.slots[j % self.nslots]
        self.reqs[j] = [
            g.ibcast(self.stream[p.server], slot[p.at : p.at + p.hi - p.lo], 0) for p in item.pieces
        ]
        self.bytes_in += 4 * item.size

    def get(self, j: int) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        g.wait_all(self.reqs.pop(j))
        self.wait_s += time.perf_counter() - t0
        item, s = self.items[j], j % self.nslots
        key = (item.index, s)
        if key not in self._views:
            self._views[key] = self.plan.views(item, self.slots[s])
        return self._views[key]

    def release(self, j: int) -> None:
        if j + self.nslots < len(self.items):
            self._post(j + self.nslots)


class GradientStream(GradientViews):
    """A device's gradient sink: each finished group is reduce-scattered among the devices
    (DP's slice boundaries) and this device's block goes to the group's owner server."""

    def __init__(
        self,
        plan: StreamPlan,
        coll: Collectives,
        grads_comms: list,
        algorithm: str,
        memory: DeviceMemory,
    ):
        super().__init__()
        self.plan, self.coll, self.comms, self.algorithm = plan, coll, grads_comms, algorithm
        shared = plan.shared_group_size
        self.buf = memory.allocate(
            "streaming_window", "window.gradients", (GRADIENT_SLOTS * shared,), F32
        )
        self.held = memory.allocate(
            "streaming_window", "window.held_gradients", (plan.held_size,), F32
        )
        self.region: list[tuple[int, np.ndarray]] = []  # per group: (region id, buffer)
        position, held_at = 0, 0
        for gr in plan.groups:
            n = gr.hi - gr.lo
            if gr.held:
                self.region.append((-1 - len(self.region), self.held[held_at : held_at + n]))
                held_at += n
            else:  # shared slots in the order backward finishes the groups
                s = position % GRADIENT_SLOTS
                self.region.append((s, self.buf[s * shared : s * shared + n]))
                position += 1
            rid, region = self.region[-1]
            for name in gr.names:
                off = plan.layout.offsets[name] - gr.lo
                spec = plan.specs[name]
                self[name] = region[off : off + spec.numel].reshape(spec.shape)
        self.pending: dict[int, Any] = {}
        self.bytes_to_servers = 0

    def prepare(self, names) -> None:
        """Before a backward writes the gradients of ``names``: their regions' previous
        blocks must have left."""
        for n in names:
            rid = self.region[self.plan.group_of[n]][0]
            req = self.pending.pop(rid, None)
            if req is not None:
                g.wait(req)

    def done(self, names) -> None:
        i = self.plan.group_of[names[0]]
        gr = self.plan.groups[i]
        rid, region = self.region[i]
        bounds = np.clip(self.plan.layout.bounds - gr.lo, 0, gr.hi - gr.lo)
        mine = self.coll.reduce_scatter(
            region, bounds=bounds, average=True, algorithm=self.algorithm
        )
        if mine.size:
            self.pending[rid] = g.isend(self.comms[gr.owner], mine, 0, i)
            self.bytes_to_servers += mine.nbytes

    def flush(self) -> None:
        g.wait_all(list(self.pending.values()))
        self.pending.clear()


# ------------------------------------------------------------------------- server side
class ServerShard:
    """A weight server's flat range [lo, hi): parameters, summed gradients, optimizer."""

    def __init__(self, plan: StreamPlan, index: int, groups: Groups, accum: int, memory):
        self.plan, self.index, self.groups_comm = plan, index, groups
        self.lo, self.hi = plan.ranges[index]
        n = self.hi - self.lo
        self.params = memory.allocate("parameters", "server.params", (n,), F32)
        self.grads = memory.allocate("gradients", "server.grads", (n,), F32)
        self.scratch = (
            memory.allocate("gradients", "server.micro_grads", (n,), F32) if accum > 1 else None
        )
        self.mine = [i for i, gr in enumerate(plan.groups) if gr.owner == index]
        self.stream = groups.stream[index]
        self.comm = groups.grads[index]
        self.bytes_out = 0

    def post_stream(self, items: list[Item]) -> list:
        """Ibcast every piece of ``items`` this server owns, in order."""
        reqs = []
        for item in items:
            for p in item.pieces:
                if p.server == self.index:
                    reqs.append(g.ibcast(self.stream, self.params[p.lo - self.lo : p.hi - self.lo]))
                    self.bytes_out += 4 * (p.hi - p.lo)
        return reqs

    def receive(self, micro: int) -> None:
        """Micro-batch ``micro``'s reduced blocks of every owned group, from every device
        whose slice meets the group; summed over micro-batches as ZeRO-2 sums them."""
        target = self.grads if micro == 0 else self.scratch
        bounds, reqs, spans = self.plan.layout.bounds, [], []
        for i in self.mine:
            gr = self.plan.groups[i]
            for p in range(len(bounds) - 1):
                a, b = max(gr.lo, int(bounds[p])), min(gr.hi, int(bounds[p + 1]))
                if a < b:
                    piece = target[a - self.lo : b - self.lo]
                    reqs.append(g.irecv(self.comm, piece, 1 + p, i))
                    spans.append((a - self.lo, b - self.lo))
        g.wait_all(reqs)
        if micro > 0:
            for a, b in spans:
                np.add(self.grads[a:b], self.scratch[a:b], out=self.grads[a:b])

    def sum_of_squares(self, servers_comm) -> float:
        """DP's global sum of squares of the averaged gradient, bit for bit (collective
        over the servers; the last server returns it, the others 0.0)."""
        bounds = self.plan.layout.bounds
        R = len(bounds) - 1
        acc = np.zeros((R, 4), np.float64)
        W = self.plan.servers
        if self.index > 0:
            g.recv(servers_comm, acc, self.index - 1, CHAIN_TAG)
        for p in range(R):
            a, b = max(self.lo, int(bounds[p])), min(self.hi, int(bounds[p + 1]))
            if a < b:
                lane_sum_of_squares(
                    self.grads[a - self.lo : b - self.lo], (a - bounds[p]) % 4, acc[p]
                )
        if self.index < W - 1:
            g.send(servers_comm, acc, self.index + 1, CHAIN_TAG)
            return 0.0
        partial = (acc[:, 0] + acc[:, 1]) + (acc[:, 2] + acc[:, 3])
        total = np.float64(partial[0])
        for p in range(1, R):  # slices in rank order, as allreduce_scalars adds them
            total += partial[p]
        return float(total)


# ------------------------------------------------------------------------- the run
class StreamingRun:
    """A server or device rank of a weight-streaming job: set-up, loop, eval, checkpoints,
    artifacts. Rank 0 (server 0) prints and writes everything, as in pipelined mode."""

    own_loop = True  # simdist.train calls train() instead of the data-parallel loop

    def __init__(self, params: Params, groups: Groups, started: float, opts: StreamingOptions):
        from simdist.run import Timers

        self.params, self.groups, self.opts = params, groups, opts
        self.roles: Roles = groups.roles
        self.role = groups.role
        self.comm = groups.comm
        self.rank = self.comm.Get_rank()
        self.is_main = self.rank == 0
        self.timers = Timers(started)
        r = params.runconfig
        self.model_dir = Path(r.model_dir)
        R = self.roles.replicas
        self.micro_batch, self.global_batch = batch_sizes(params, R)
        self.accum = params.optimizer.grad_accum_steps
        self.step = 0
        o = params.optimizer
        self.learning_rate = parse_schedule(o.learning_rate, o.warmup_steps)  # rate of a step
        self.events = None
        self._log = RunLog(self.model_dir, self.is_main)
        self.device_times: list[StepTime] = []
        self.note = ""

    # ----------------------------------------------------------------- set-up
    def build(self) -> None:
        from simdist.kernels.registry import warm_all
        from simdist.models import build_model
        from simdist.optim import Optimizer

        p, r = self.params, self.params.runconfig
        R, W = self.roles.replicas, self.roles.servers
        self.model = build_model(p.model)
        if not hasattr(self.model, "stages"):
            raise ConfigError(
                f"model {self.model.name!r} has no stages, so it cannot stream its weights; "
                "use runconfig.execution_mode=pipelined (weight streaming supports gpt2)"
            )
        try:
            self.profile = load_profile(r.device_profile)
        except ProfileError as e:
            raise ConfigError(f"runconfig.device_profile: {e}") from None
        self.layout = Layout(self.model.parameter_specs(), R)
        self.plan = StreamPlan(self.layout, self.model.stages(), self.model.gradient_groups(), W)
        self.active = Collectives(self.groups.active)
        self.log(
            f"simdist: weight streaming, {W} weight server(s) + {R} device(s)"
            + (
                f" + {R * self.roles.workers_per_replica} input worker(s)"
                if self.roles.workers_per_replica
                else ""
            )
            + f", model {self.model.name}, micro-batch {self.micro_batch} x {self.accum} "
            f"accumulation, global batch {self.global_batch}, prefetch depth "
            f"{self.opts.prefetch_depth}, device profile {self.profile.name}"
        )
        if self.is_main:
            self.timers.compile_time = warm_all()
            _warm()
        self.groups.active.Barrier()
        if not self.is_main:
            self.timers.compile_time = warm_all()
            _warm()
        if self.role == SERVER:
            self._build_server(Optimizer)
        else:
            self._build_device()
        self.log(
            f"parameters: {self.layout.numel:,} ({format_bytes(4 * self.layout.numel)}); "
            f"{self.plan.describe()}; largest stage {self.plan.slot_size:,} parameters"
        )

    def _build_server(self, optimizer_cls) -> None:
        p, r = self.params, self.params.runconfig
        prof = self.profile
        cap = prof.streaming.capacity_bytes if prof.streaming else 1 << 62
        self.memory = DeviceMemory(cap, f"{prof.name} weight store")
        self.shard = ServerShard(self.plan, self.groups.index, self.groups, self.accum, self.memory)
        sh = self.shard

        def alloc(category: str, name: str, n: int) -> np.ndarray:
            return self.memory.allocate(category, f"server.{name}", (n,), F32)

        self.optimizer = optimizer_cls(p.optimizer, self.layout, sh.lo, sh.hi, alloc)
        # every server draws the whole initialisation (one rng stream, as DP) and keeps its
        # range: the parameters then equal DP's bit for bit
        full = np.zeros(self.layout.padded, F32)
        self.model.init_parameters(self.layout.views(full), np.random.default_rng(r.seed))
        sh.params[...] = full[sh.lo : sh.hi]
        del full

    def _build_device(self) -> None:
        from simdist.data.datasets import build_dataset
        from simdist.data.sampler import DistributedSampler

        p, r = self.params, self.params.runconfig
        d = self.groups.index
        hint = (
            f"weight streaming keeps {self.opts.prefetch_depth + 1} weight slot(s) of the "
            f"largest stage ({format_bytes(4 * self.plan.slot_size)} each), "
            f"{GRADIENT_SLOTS} gradient slots and the activations on the device: lower "
            "runconfig.prefetch_depth or train_input.batch_size"
        )
        self.memory = DeviceMemory.from_profile(self.profile, hint=hint)
        self.coll = Collectives(self.groups.devices, r.collective_algorithm, r.check_collectives)
        R = self.roles.replicas
        algorithm = r.collective_algorithm
        if algorithm == "auto":  # as GradientSync: by the whole padded buffer
            algorithm = self.coll.choose("reduce_scatter", 4 * self.layout.padded)
        self.window = WeightWindow(
            self.plan, self.groups.stream, self.opts.prefetch_depth, self.memory
        )
        self.sink = GradientStream(self.plan, self.coll, self.groups.grads, algorithm, self.memory)
        self.memory.reserve(
            "activations", "model.arena", self.model.activation_bytes(self.micro_batch)
        )
        self.model.allocate(self.micro_batch)
        if R > 1:
            from simdist.comm.p2p import DEPTH, SEGMENT

            scratch = self.coll.reserve_scratch(4 * DEPTH * SEGMENT)
            self.memory.reserve("workspace", "collectives.scratch", scratch)
        self.data = build_dataset(p, self.micro_batch)
        self.sampler = DistributedSampler(
            self.data.num_train,
            self.global_batch,
            R,
            d,
            r.seed,
            p.train_input.shuffle,
            self.accum,
        )
        self.cost = CostModel(self.profile, "fp32")
        self.fwd_s, self.bwd_s, self.note = stage_compute_times(
            self.model, self.plan.stages, self.cost, self.micro_batch
        )

    def connect(self) -> None:
        """Resume (servers read the checkpoint), check model_dir, agree with every rank of
        the world (input workers included) on success and the first step."""
        error, step = None, -1
        try:
            if self.role == SERVER:
                step = self._resume()
            if self.is_main:
                self._check_model_dir()
        except (ConfigError, checkpoint.CheckpointError) as e:
            error = str(e)
        results = self.comm.allgather((error, step))
        failed = [e for e, _ in results if e]
        if failed:
            raise ConfigError(failed[0])
        self.step = max(0, max(s for _, s in results))
        if self.role == DEVICE:
            from simdist.input_workers import device_input

            self.data = device_input(
                self.data, self.groups, self.micro_batch, self.step, self.params
            )
        if self.is_main:
            self._log.open()
            self.log(f"model_dir: {self.model_dir}")

    def _check_model_dir(self) -> None:
        import os

        try:
            self.model_dir.mkdir(parents=True, exist_ok=True)
            probe = self.model_dir / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ConfigError(
                f"runconfig.model_dir {str(self.model_dir)!r} is not writable: {e}"
            ) from None

    def _resume(self) -> int:
        r = self.params.runconfig
        path = None
        if r.checkpoint_path:
            path = Path(r.checkpoint_path)
        elif r.autoload:
            path = checkpoint.latest_checkpoint(self.model_dir)
        if path is None:
            return 0
        shapes = {s.name: s.shape for s in self.layout.specs}
        step, tensors, attrs = checkpoint.load(path, shapes, self.model.name)
        sh = self.shard
        for seg in self.layout.segments(sh.lo, sh.hi):
            off = self.layout.offsets[seg.name]
            flat = tensors[seg.name].reshape(-1)
            sh.params[seg.lo - sh.lo : seg.hi - sh.lo] = flat[seg.lo - off : seg.hi - off]
        if not checkpoint.optimizer_keys(path, attrs):
            self.log(f"{path} holds no optimizer state: the optimizer starts fresh")
        else:
            for key, buf in self.optimizer.state.items():
                buf[...] = checkpoint.read_optimizer_range(path, attrs, key, sh.lo, sh.hi)
        mode = attrs.get("execution_mode", "pipelined")
        self.log(
            f"resumed from {path} at global_step = {step} (written in {mode} mode, world size "
            f"{attrs.get('world_size')})"
        )
        return step

    # ----------------------------------------------------------------- training
    def train(self) -> None:
        from simdist.faults import NonFiniteError, Preempted, StopSignals

        r = self.params.runconfig
        self._start_training()
        signals = StopSignals()
        signals.install()
        vals = np.zeros(3, np.float64)
        try:
            for step in range(self.step, r.max_steps):
                n = step + 1
                if self.role == SERVER:
                    sumsq = self._server_step()
                    vals[:] = (sumsq, 0.0, 0.0)
                else:
                    loss = self._device_step(step)
                    vals[:] = (0.0, loss, 0.0)
                vals[2] = 1.0 if signals.received else 0.0
                total = self.active.allreduce_scalars(vals)
                if not (np.isfinite(total[0]) and np.isfinite(total[1])):
                    raise NonFiniteError(
                        f"non-finite loss or gradients in step {n}: the update of step {n} was "
                        "not applied and no checkpoint was written for it. Lower "
                        "optimizer.learning_rate, set optimizer.max_gradient_norm, or check "
                        "the input data."
                    )
                norm = self._update(float(total[0]), n)
                self.step = n
                stop = bool(total[2] > 0)
                self._after_step(float(total[1]) / self.roles.replicas, norm, stop)
                if stop:
                    raise Preempted(
                        f"stopped at global_step {n} by a signal; checkpoint saved. Run the "
                        "same command again to resume."
                    )
        finally:
            signals.restore()
        self._finish_training()

    def _server_step(self) -> float:
        sh = self.shard
        reqs = sh.post_stream(self.plan.train_items(self.accum))
        for micro in range(self.accum):
            sh.receive(micro)
        g.wait_all(reqs)
        return sh.sum_of_squares(self.groups.servers)

    def _device_step(self, step: int) -> float:
        model, window, sink, plan = self.model, self.window, self.sink, self.plan
        stages = plan.stages
        dloss = 1.0 / (self.micro_batch * self.accum)  # as the data-parallel loop
        window.start(plan.train_items(self.accum))
        loss, j = 0.0, 0
        for indices in self.sampler.indices(step):
            x, y = self.data.train_batch(indices)
            model.begin(x, y)
            for k in range(len(stages)):
                out = model.forward_stage(k, window.get(j))
                window.release(j)
                j += 1
            loss += out / self.accum
            for k in range(len(stages) - 1, -1, -1):
                sink.prepare(stages[k].forward_params)
                if stages[k].backward_params:
                    model.backward_stage(k, window.get(j), sink, dloss)
                    window.release(j)
                    j += 1
                else:
                    model.backward_stage(k, {}, sink, dloss)
        sink.flush()
        self.device_times.append(self._simulate())
        return loss

    def _simulate(self) -> StepTime:
        work = []
        nst = len(self.plan.stages)
        for _ in range(self.accum):
            for k in range(nst):
                work.append((4.0 * self.plan.forward_items[k].size, self.fwd_s[k], 0.0))
            for k in range(nst - 1, -1, -1):
                item = self.plan.backward_item_of.get(k)
                gbytes = 4.0 * sum(
                    self.plan.groups[i].hi - self.plan.groups[i].lo for i in self.plan.finishes[k]
                )
                work.append((4.0 * item.size if item else 0.0, self.bwd_s[k], gbytes))
        prof = self.profile
        bw = prof.streaming.bandwidth if prof.streaming else prof.host.bandwidth
        lat = prof.host.latency if prof.streaming is None else 0.0
        return simulate_step(work, self.opts.prefetch_depth, bw, lat)

    def _update(self, sumsq: float, n: int) -> float | None:
        """Servers: clip as ``Run.clip`` does and apply the optimizer to their range."""
        o = self.params.optimizer
        norm = float(np.sqrt(sumsq)) if o.max_gradient_norm is not None else None
        if self.role != SERVER:
            return norm
        sh = self.shard
        if norm is not None:
            coef = o.max_gradient_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            if coef < 1.0:
                np.multiply(sh.grads, np.float32(coef), out=sh.grads)
        self.optimizer.step(sh.params, sh.grads, n, self.learning_rate(n - 1))
        return norm

    def _start_training(self) -> None:
        from simdist.events import EventWriter

        r = self.params.runconfig
        if self.is_main:
            (self.model_dir / "params.yaml").write_text(dump_yaml(self.params))
            self.events = EventWriter(str(self.model_dir))
        self.groups.active.Barrier()
        now = time.perf_counter()
        self.timers.programming_time = now - self.timers.started
        self.timers.train_start = now
        self.timers.first_step = self.step
        self._summary_t = (now, self.step)
        if self.role == DEVICE:
            self.window.bytes_in = 0
            self.sink.bytes_to_servers = 0
            self._rs_bytes0 = self.coll.bytes_sent
            self.memory.reset_peak()
        if self.step >= r.max_steps:
            self.log(f"nothing to train: global_step {self.step} >= max_steps {r.max_steps}")

    def _after_step(self, mean_loss: float, norm: float | None, stop: bool) -> None:
        r, step = self.params.runconfig, self.step
        last = step == r.max_steps or stop
        if self.is_main and (step % r.save_summary_steps == 0 or last):
            write_summary(self, step, mean_loss, norm)
        if stop or r.save_checkpoints_steps and (step % r.save_checkpoints_steps == 0 or last):
            self.save_checkpoint()

    def _finish_training(self) -> None:
        from simdist.input_workers import input_report

        self.groups.active.Barrier()
        t = self.timers
        t.train_time = time.perf_counter() - t.train_start
        steps = self.step - t.first_step
        dev = {}
        if self.role == DEVICE:
            sim = self.device_times[-steps:] if steps else []
            dev = {
                "memory": self.memory.summary(),
                "weights_in_bytes": self.window.bytes_in,
                "gradients_to_servers_bytes": self.sink.bytes_to_servers,
                "gradients_reduce_scatter_bytes": self.coll.bytes_sent - self._rs_bytes0,
                "weight_wait_s": self.window.wait_s,
                "sim_total_s": sum(s.total_s for s in sim),
                "sim_compute_s": sum(s.compute_s for s in sim),
                "sim_weight_wait_s": sum(s.weight_wait_s for s in sim),
                "sim_gradient_wait_s": sum(s.gradient_wait_s for s in sim),
                "sim_drain_s": sum(s.drain_s for s in sim),
                "note": self.note,
            }
            inputs = input_report(
                self.groups.devices,
                self.data.wait_s,
                t.train_time,
                self.roles.workers_per_replica,
            )
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        gathered = self.groups.active.gather((self.role, dev, peak_rss), root=0)
        if self.role == DEVICE and self.groups.index == 0:
            self.groups.active.send(inputs, dest=0, tag=11)
        if not self.is_main:
            return
        inputs = self.groups.active.recv(source=self.roles.servers, tag=11)
        devices = [d for role, d, _ in gathered if role == DEVICE]
        per = max(steps, 1)
        samples = steps * self.global_batch
        rate = samples / t.train_time if t.train_time > 0 else 0.0
        self.log(
            f"Training finished with {samples} samples in {t.train_time:.3f} seconds, "
            f"{rate:.2f} samples/second."
        )
        analysis = {k: 4 * v for k, v in self.plan.streamed_elements(self.accum).items()}
        d0 = devices[0]
        sim_step = d0["sim_total_s"] / per
        perf = {
            "execution_mode": "weight_streaming",
            "weight_servers": self.roles.servers,
            "replicas": self.roles.replicas,
            "prefetch_depth": self.opts.prefetch_depth,
            "device_profile": self.profile.name,
            "total_samples": samples,
            "total_time": t.train_time,
            "samples_per_sec": rate,
            "compile_time": t.compile_time,
            "programming_time": t.programming_time,
            "steps": steps,
            "global_step": self.step,
            "world_size": self.roles.world,
            "global_batch_size": self.global_batch,
            "micro_batch_size": self.micro_batch,
            "grad_accum_steps": self.accum,
            "parameters": self.layout.numel,
            "parameter_bytes": 4 * self.layout.numel,
            "step_time_s": t.train_time / per,
            "simulated_step_time_s": sim_step,
            "simulated_compute_s_per_step": d0["sim_compute_s"] / per,
            "exposed_streaming_time_s": (d0["sim_total_s"] - d0["sim_compute_s"]) / per,
            "exposed_weight_wait_s": d0["sim_weight_wait_s"] / per,
            "exposed_gradient_wait_s": d0["sim_gradient_wait_s"] / per,
            "exposed_gradient_drain_s": d0["sim_drain_s"] / per,
            "measured_weight_wait_s_per_step": max(d["weight_wait_s"] for d in devices) / per,
            "streamed_bytes_per_step": {
                "weights_in": d0["weights_in_bytes"] / per,
                "gradients_out": (
                    d0["gradients_to_servers_bytes"] + d0["gradients_reduce_scatter_bytes"]
                )
                / per,
                "gradients_to_servers": d0["gradients_to_servers_bytes"] / per,
                "gradients_among_devices": d0["gradients_reduce_scatter_bytes"] / per,
            },
            "streamed_bytes_analysis": analysis,
            "streaming_bandwidth_bytes_per_s": (
                self.profile.streaming.bandwidth if self.profile.streaming else None
            ),
            "compute_model": d0["note"],
            "not_modelled": "server-side optimizer time; link latency (none published)",
            "device_capacity_bytes": d0["memory"]["capacity_bytes"],
            "device_peak_bytes": max(d["memory"]["peak_bytes"]["total"] for d in devices),
            "device_memory": [d["memory"] for d in devices],
            "server_memory_bytes": self.memory.summary()["peak_bytes"]["total"],
            "peak_rss_bytes": max(rss for _, _, rss in gathered),
            **inputs,
            "host": socket.gethostname(),
        }
        (self.model_dir / "performance.json").write_text(json.dumps(perf, indent=1))

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        """Servers write their optimizer ranges as shards and send rank 0 their parameters;
        rank 0 writes the main file: the same format pipelined runs write and read."""
        layout = self.layout.describe()
        if self.role == SERVER:
            sh = self.shard
            shard = checkpoint.save_optimizer_shard(
                self.model_dir,
                self.step,
                self.groups.index,
                self.roles.servers,
                sh.lo,
                sh.hi,
                layout,
                self.optimizer.state,
            )
            shards = self.groups.servers.gather(shard, root=0)
            params = self.groups.servers.gather(sh.params, root=0)
            if self.is_main:
                full = np.zeros(self.layout.padded, F32)
                for s, part in enumerate(params):
                    lo, hi = self.plan.ranges[s]
                    full[lo:hi] = part
                attrs = {
                    "model": self.model.name,
                    "world_size": self.roles.replicas,
                    "zero_opt_level": 0,
                    "optimizer_type": self.params.optimizer.optimizer_type,
                    "layout": layout,
                    "execution_mode": "weight_streaming",
                    "weight_servers": self.roles.servers,
                }
                path = checkpoint.save(
                    self.model_dir,
                    self.step,
                    self.layout.views(full),
                    None,
                    attrs,
                    self.params.runconfig.keep_checkpoint_max,
                    shards,
                )
                self.log(f"saved checkpoint {path}")
        self.groups.active.Barrier()

    # ----------------------------------------------------------------- eval
    def evaluate(self) -> dict:
        """Each device scores a contiguous share of the held-out set (as pipelined DP does),
        in chunks of the micro-batch, the weights streamed for each chunk."""
        R = self.roles.replicas
        chunks: list[tuple[int, int, bool]] = []  # (lo, hi, last chunk of an eval batch)
        meta = np.zeros(2, np.float64)
        if self.role == DEVICE:
            n = self.data.num_eval
            d = self.groups.index
            lo, hi = n * d // R, n * (d + 1) // R
            batch = self.params.eval_input.batch_size
            for start in range(lo, hi, batch):
                stop = min(start + batch, hi)
                for c in range(start, stop, self.micro_batch):
                    chunks.append(
                        (c, min(c + self.micro_batch, stop), c + self.micro_batch >= stop)
                    )
            if d == 0:
                meta[:] = (n, self.data.targets_per_sample)
        rounds = max(self.groups.active.allgather(len(chunks)))
        items = self.plan.forward_items * rounds
        loss_sum, correct = 0.0, 0
        if self.role == SERVER:
            g.wait_all(self.shard.post_stream(items))
        else:
            self.window.start(items)
            nst = len(self.plan.stages)
            batch_loss, batch_correct = 0.0, 0
            for rnd in range(rounds):
                work = rnd < len(chunks)
                if work:
                    c_lo, c_hi, closes = chunks[rnd]
                    x, y = self.data.eval_batch(c_lo, c_hi)
                    self.model.begin(x, y)
                for k in range(nst):
                    j = rnd * nst + k
                    params = self.window.get(j)
                    if work:
                        self.model.forward_stage(k, params)
                    self.window.release(j)
                if work:
                    # sums in the order Run.evaluate and GPT2.evaluate add them
                    l, c = self.model.eval_stats()
                    batch_loss, batch_correct = batch_loss + l, batch_correct + c
                    if closes:
                        loss_sum, correct = loss_sum + batch_loss, correct + batch_correct
                        batch_loss, batch_correct = 0.0, 0
        totals = self.active.allreduce_scalars(
            np.array([loss_sum, correct, meta[0], meta[1]], np.float64)
        )
        count = totals[2] * totals[3]
        result = {
            "global_step": self.step,
            "accuracy": totals[1] / count,
            "loss": totals[0] / count,
            "eval_samples": int(totals[2]),
        }
        if self.is_main:
            self.log(f"eval: accuracy = {result['accuracy']:.4f}, loss = {result['loss']:.6f}")
            self.model_dir.mkdir(parents=True, exist_ok=True)
            (self.model_dir / "eval.json").write_text(json.dumps(result, indent=1))
        return result

    def close(self) -> None:
        if self.role == DEVICE:
            self.data.close()
        if self.events:
            self.events.close()

    def log(self, message: str) -> None:
        self._log(message)


def setup_roles(params: Params, comm, started: float, opts: StreamingOptions | None = None):
    """Split the world by role and build this rank's part: a ``StreamingRun`` (server or
    device) or an ``InputWorker``. Collective over ``comm`` (every rank calls it)."""
    from simdist.input_workers import InputWorker

    opts = opts or options_from(params)
    W = opts.weight_servers if opts.execution_mode == "weight_streaming" else 0
    roles = Roles.plan(comm.Get_size(), W, opts.input_workers_per_replica)
    if not params.runconfig.enable_data_parallel and roles.replicas > 1:
        raise ConfigError(
            f"runconfig.enable_data_parallel is false but the ranks make {roles.replicas} "
            "replicas; enable data parallelism or use fewer ranks"
        )
    groups = Groups(comm, roles)
    if groups.role == WORKER:
        worker = InputWorker(params, groups, started)
        error = None
        try:
            worker.build()
        except ConfigError as e:  # reported through the agreement below, not alone
            error = str(e)
        results = comm.allgather((error, -1))
        failed = [e for e, _ in results if e]
        if failed:
            raise ConfigError(failed[0])
        worker.step = max(0, max(s for _, s in results))
        return worker
    if opts.execution_mode == "weight_streaming":
        run = StreamingRun(params, groups, started, opts)
        run.build()
        run.connect()
        return run
    return _pipelined_with_workers(params, groups, started)


def _pipelined_with_workers(params: Params, groups: Groups, started: float):
    """Pipelined data parallelism over the device ranks, fed by input workers."""
    from simdist.input_workers import device_input
    from simdist.run import Run

    run = Run(params, groups.devices, started)
    error = None
    try:
        run.build()
    except (ConfigError, checkpoint.CheckpointError) as e:  # reported through the agreement
        error = str(e)
    results = groups.comm.allgather((error, run.step if error is None else -1))
    failed = [e for e, _ in results if e]
    if failed:
        raise ConfigError(failed[0])
    run.data = device_input(run.data, groups, run.micro_batch, run.step, params)
    return run
