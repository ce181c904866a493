"""The moving parts of weight streaming (``simdist.schedules.weight_streaming``): a device's
weight window (stages' weights in, ``prefetch_depth`` ahead), its gradient stream (finished
groups reduce-scattered among the devices, each block out to its owner server), and a
server's shard (its flat range of parameters, summed gradients and the chained sum of
squares). The plan they follow is ``simdist.streaming.StreamPlan``.

In mixed precision (``simdist.precision``) the weights travel as 16-bit words of the half
format (the server keeps their half rounding of its fp32 master, packed once per update;
a device unpacks each slot as it takes it) and, unless ``runconfig.fp32_allreduce``, so do
the gradient blocks: half the bytes of fp32 on every link, as on the hardware. The device
holds the words (accounted at two bytes); the float32 slots the kernels read are the host's
unpacked copy, as activations are kept.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from simdist.comm import Collectives
from simdist.comm import groups as g
from simdist.comm.groups import Groups
from simdist.device import DeviceMemory
from simdist.kernels.half import pack_half, unpack_half
from simdist.kernels.optim import LANES, combine_lanes, lane_sum_of_squares
from simdist.models.base import GradientViews
from simdist.precision import FP32, Precision
from simdist.sim.streaming_step import GRADIENT_SLOTS
from simdist.streaming import Item, StreamPlan

F32 = np.float32
CHAIN_TAG = 0x57  # server-chain lane accumulators on the servers' communicator


# ------------------------------------------------------------------------- device side
class WeightWindow:
    """A device's ``prefetch_depth + 1`` weight slots; transfer j lands in slot j % slots.
    ``fmt`` (``kernels.half``; 0: float32): the weights arrive as half words."""

    def __init__(
        self, plan: StreamPlan, stream: list, depth: int, memory: DeviceMemory, fmt: int = 0
    ):
        self.plan, self.stream, self.depth, self.fmt = plan, stream, depth, fmt
        self.nslots = depth + 1
        size = self.nslots * plan.slot_size
        if fmt:
            # the device's slots hold the words; the kernels read their float32 values from
            # one host working copy, unpacked by ``get`` (a stage uses its slot between
            # ``get`` and ``release``, one at a time)
            self.words = memory.allocate("streaming_window", "window.weights", (size,), np.uint16)
            self.buf = np.zeros(plan.slot_size, F32)
            wire = self.words
            self.slots = [self.buf] * self.nslots
        else:
            self.buf = memory.allocate("streaming_window", "window.weights", (size,), F32)
            wire = self.buf
            self.slots = [
                self.buf[i * plan.slot_size : (i + 1) * plan.slot_size] for i in range(self.nslots)
            ]
        self.wire = [
            wire[i * plan.slot_size : (i + 1) * plan.slot_size] for i in range(self.nslots)
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
        item, slot = self.items[j], self.wire[j % self.nslots]
        self.reqs[j] = [
            g.ibcast(self.stream[p.server], slot[p.at : p.at + p.hi - p.lo], 0) for p in item.pieces
        ]
        self.bytes_in += slot.itemsize * item.size

    @property
    def host_bytes(self) -> int:
        """Bytes of the slots on this host: float32 slots, or the words and one float32 copy."""
        return self.buf.nbytes + (self.words.nbytes if self.fmt else 0)

    def get(self, j: int) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        g.wait_all(self.reqs.pop(j))
        self.wait_s += time.perf_counter() - t0
        item, s = self.items[j], j % self.nslots
        if self.fmt:
            for p in item.pieces:
                n = p.hi - p.lo
                unpack_half(self.slots[s][p.at : p.at + n], self.wire[s][p.at : p.at + n], self.fmt)
        key = (item.index, s)
        if key not in self._views:
            self._views[key] = self.plan.views(item, self.slots[s])
        return self._views[key]

    def release(self, j: int) -> None:
        if j + self.nslots < len(self.items):
            self._post(j + self.nslots)


class GradientStream(GradientViews):
    """A device's gradient sink: each finished group is reduce-scattered among the devices
    (DP's slice boundaries) and this device's block goes to the group's owner server. In
    mixed precision a group is stored half before its reduction (as data parallelism's
    ZeRO-2 stores each group), reduced on ``wire`` and sent as half words when ``wire``."""

    def __init__(
        self,
        plan: StreamPlan,
        coll: Collectives,
        grads_comms: list,
        algorithm: str,
        memory: DeviceMemory,
        precision: Precision = FP32,
        wire: int = 0,
    ):
        super().__init__()
        self.plan, self.coll, self.comms, self.algorithm = plan, coll, grads_comms, algorithm
        self.precision, self.wire = precision, wire
        shared = plan.shared_group_size

        def alloc(name: str, n: int) -> np.ndarray:  # half: the device holds 16-bit words
            if precision.half is None:
                return memory.allocate("streaming_window", name, (n,), F32)
            memory.reserve("streaming_window", name, 2 * n)
            return np.zeros(n, F32)

        self.buf = alloc("window.gradients", GRADIENT_SLOTS * shared)
        self.held = alloc("window.held_gradients", plan.held_size)
        # outgoing half words of each region's block (kept until its send completes)
        self.out_words: dict[int, np.ndarray] = {}
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
        self.precision.store(region)
        with self.coll.half_wire(self.wire):
            mine = self.coll.reduce_scatter(
                region, bounds=bounds, average=True, algorithm=self.algorithm
            )
        if mine.size:
            out = mine
            if self.wire:  # the region's previous block has left (``prepare``)
                words = self.out_words.get(rid)
                if words is None or words.size < mine.size:
                    words = self.out_words[rid] = np.empty(region.size, np.uint16)
                out = words[: mine.size]
                pack_half(out, mine, self.wire)
            self.pending[rid] = g.isend(self.comms[gr.owner], out, 0, i)
            self.bytes_to_servers += out.nbytes

    def flush(self) -> None:
        g.wait_all(list(self.pending.values()))
        self.pending.clear()


# ------------------------------------------------------------------------- server side
class ServerShard:
    """A weight server's flat range [lo, hi): parameters, summed gradients, optimizer.

    Mixed precision (``fmt``, ``kernels.half``): ``params`` are the half rounding of the
    optimizer's fp32 master and ``words`` their 16-bit form, what the server streams
    (``pack``, once per update); gradient blocks arrive as half words when ``wire``."""

    def __init__(
        self,
        plan: StreamPlan,
        index: int,
        groups: Groups,
        accum: int,
        memory,
        fmt: int = 0,
        wire: int = 0,
    ):
        self.plan, self.index, self.groups_comm = plan, index, groups
        self.fmt, self.wire = fmt, wire
        self.lo, self.hi = plan.ranges[index]
        n = self.hi - self.lo
        if fmt:  # the store holds the half weights (2 bytes each): ``words`` here; the
            # float32 ``params`` holding the same values are the host's copy for checkpoints
            memory.reserve("parameters", "server.params", 2 * n)
            self.params, self.words = np.zeros(n, F32), np.zeros(n, np.uint16)
        else:
            self.params = memory.allocate("parameters", "server.params", (n,), F32)
            self.words = None
        self.grads = memory.allocate("gradients", "server.grads", (n,), F32)
        self.scratch = (
            memory.allocate("gradients", "server.micro_grads", (n,), F32) if accum > 1 else None
        )
        self.wire_in = np.empty(n, np.uint16) if wire else None  # received half words
        self.mine = [i for i, gr in enumerate(plan.groups) if gr.owner == index]
        self.stream = groups.stream[index]
        self.comm = groups.grads[index]
        self.bytes_out = 0

    def pack(self) -> None:
        """Mixed precision: the words the next step streams, from the half weights."""
        if self.words is not None:
            pack_half(self.words, self.params, self.fmt)

    def post_stream(self, items: list[Item]) -> list:
        """Ibcast every piece of ``items`` this server owns, in order."""
        source = self.params if self.words is None else self.words
        reqs = []
        for item in items:
            for p in item.pieces:
                if p.server == self.index:
                    reqs.append(g.ibcast(self.stream, source[p.lo - self.lo : p.hi - self.lo]))
                    self.bytes_out += source.itemsize * (p.hi - p.lo)
        return reqs

    def receive(self, micro: int) -> None:
        """Micro-batch ``micro``'s reduced blocks of every owned group, from every device
        whose slice meets the group; summed over micro-batches as ZeRO-2 sums them."""
        target = self.grads if micro == 0 else self.scratch
        into = target if self.wire_in is None else self.wire_in
        bounds, reqs, spans = self.plan.layout.bounds, [], []
        for i in self.mine:
            gr = self.plan.groups[i]
            for p in range(len(bounds) - 1):
                a, b = max(gr.lo, int(bounds[p])), min(gr.hi, int(bounds[p + 1]))
                if a < b:
                    piece = into[a - self.lo : b - self.lo]
                    reqs.append(g.irecv(self.comm, piece, 1 + p, i))
                    spans.append((a - self.lo, b - self.lo))
        g.wait_all(reqs)
        if self.wire_in is not None:
            for a, b in spans:
                unpack_half(target[a:b], self.wire_in[a:b], self.wire)
        if micro > 0:
            for a, b in spans:
                np.add(self.grads[a:b], self.scratch[a:b], out=self.grads[a:b])

    def sum_of_squares(self, servers_comm) -> float:
        """DP's global sum of squares of the averaged gradient, bit for bit (collective
        over the servers; the last server returns it, the others 0.0)."""
        bounds = self.plan.layout.bounds
        R = len(bounds) - 1
        acc = np.zeros((R, LANES), np.float64)
        W = self.plan.servers
        if self.index > 0:
            g.recv(servers_comm, acc, self.index - 1, CHAIN_TAG)
        for p in range(R):
            a, b = max(self.lo, int(bounds[p])), min(self.hi, int(bounds[p + 1]))
            if a < b:
                lane_sum_of_squares(
                    self.grads[a - self.lo : b - self.lo], (a - bounds[p]) % LANES, acc[p]
                )
        if self.index < W - 1:
            g.send(servers_comm, acc, self.index + 1, CHAIN_TAG)
            return 0.0
        partial = [combine_lanes(lanes) for lanes in acc]
        total = np.float64(partial[0])
        for p in range(1, R):  # slices in rank order, as allreduce_scalars adds them
            total += partial[p]
        return float(total)
