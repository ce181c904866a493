"""Weight streaming (Cerebras MemoryX / SwarmX): the plan and its footprint.

This module needs no MPI: what each server owns and what each step streams
(``StreamPlan``), a device's memory footprint and the kernel the servers' norm chain
uses; its simulated step time is ``simdist.sim.streaming_step`` (shared with plan mode).
The schedule that runs it on MPI ranks is ``simdist.schedules.weight_streaming`` (with
``simdist.schedules.streaming_io``).

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
gradient norm for clipping is the same float64 sum: DP adds, per slice, squares in LANES
interleaved lanes (``sum_of_squares``) and then the slices in rank order; the servers
rebuild those lane sums by passing the lane accumulators along the server chain in flat
order (``lane_sum_of_squares``), then add the slices in the same order. The update is
element-wise. So R devices train to the same bits as DP (ZeRO 0/1/2) on R ranks with
``grad_accum_steps = 1``, and as ZeRO-2 with accumulation (per-micro-batch reduction).

Simulated time (``simdist.sim.streaming_step``): the device's compute per stage from the
model's kernel costs and the profile, weight transfers over the profile's streaming
bandwidth (MemoryX to system; one transfer at a time, into a free slot, so
``prefetch_depth`` decides the overlap), gradients out over the other direction of the
same full-duplex link (SwarmX reduces them on the way). Exposed streaming time = step time
- compute time. Not modelled: the servers' optimizer time (MemoryX publishes no compute
figure) and link latency where the profile gives none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from simdist.arena import Layout
from simdist.config import ConfigError, Params
from simdist.device import format_bytes
from simdist.kernels.optim import LANES, lane_sum_of_squares
from simdist.models.base import GradientGroup
from simdist.models.stages import Stage
from simdist.sim.streaming_step import device_footprint, finishing_stage

F32 = np.float32


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
            k = finishing_stage(self.stages, gr.names)
            if k is not None:
                self.finishes[k].append(i)

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


def warm_kernels() -> None:
    lane_sum_of_squares(np.ones(5, F32), 1, np.zeros(LANES))
