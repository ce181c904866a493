"""What a rank will hold on its simulated device, known before anything is allocated.

``rank_entries`` lists every device tensor ``Run.build`` creates, in creation order, with
its exact size: the flat parameters (ZeRO-3: this rank's slice plus the two gather windows
of ``simdist.param_gather``), the gradients (whole buffer, or ZeRO-2/3's slice plus
bucket), the model's activation arena, the input micro-batch where the model reads it in
place, the optimizer state over this rank's update range, and the collectives' reused
scratch. ``check_device_memory`` reserves that list on a scratch ``DeviceMemory`` of the
profile's capacity: if it does not fit, a ``DeviceOutOfMemoryError`` (a
``SimulatedOutOfMemoryError`` and a ``ConfigError``: the CLI exits with code 2 and one
message, nothing written) says what was being allocated, the breakdown, and what would fit,
computed with this same list: a higher ZeRO level, or the largest micro-batch (also with
gradient accumulation keeping the global batch).

The run then allocates the real buffers through ``DeviceAllocator`` (an adapter with the
old ``alloc(category, name, n)`` call sites), and ``plan_matches`` compares the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from simdist.arena import Layout
from simdist.config import ConfigError
from simdist.device import DeviceMemory, SimulatedOutOfMemoryError, format_bytes
from simdist.models.base import ParamSpec
from simdist.param_gather import GatherPlan


class DeviceOutOfMemoryError(SimulatedOutOfMemoryError, ConfigError):
    """The configuration does not fit on the simulated device (raised during set-up)."""


@dataclass(frozen=True)
class Entry:
    category: str
    name: str
    nbytes: int


@dataclass(frozen=True)
class RankSetup:
    """What decides a rank's device memory (all from params, model and data shapes)."""

    numel_specs: tuple[tuple[str, int], ...]  # parameter (name, numel) in layout order
    groups: tuple[tuple[tuple[str, ...], bool], ...]  # gradient groups: (names, held)
    world: int
    rank: int
    zero_level: int
    accum: int
    optimizer_type: str
    micro_batch: int
    algorithm: str
    activation_bytes: Any  # callable: micro-batch -> bytes of the model's arena
    input_bytes_per_sample: int  # 0 when the model copies its inputs into the arena
    window_elements: int = 0  # ZeRO-3: one gather window (param_gather.GatherPlan.window)
    # mixed precision: weights, gradients and activations at 2 bytes, plus an fp32 master
    # copy in the optimizer state (simdist.precision)
    weight_bytes: int = 4


def bucket_elements(layout: Layout, groups) -> int:
    """ZeRO-2's bucket: held groups side by side plus one region for the largest other."""
    numel = {s.name: s.numel for s in layout.specs}
    held = shared = 0
    for names, is_held in groups:
        size = sum(numel[n] for n in names)
        if is_held:
            held += size
        else:
            shared = max(shared, size)
    return held + shared


def scratch_bytes(setup: RankSetup, layout: Layout) -> int:
    """Largest scratch the p2p layer will ask for: a pipelined receive uses DEPTH segments,
    a smaller one at most a segment; MPI's reduce-scatter lands a rank's block there;
    hierarchical stages the buffer in chunk order (``comm/hierarchical.py``)."""
    if setup.world == 1:
        return 0
    from simdist.comm.p2p import DEPTH, SEGMENT  # here: that module starts MPI, plan mode not

    need = DEPTH * SEGMENT
    if setup.algorithm == "native":
        need = max(need, layout.shard_size)
    if setup.algorithm == "hierarchical":  # + the two sub-rings' scratch + the staging copy
        need = 3 * DEPTH * SEGMENT + layout.padded
    return 4 * need


def rank_entries(setup: RankSetup, **override: Any) -> list[Entry]:
    """Device tensors of one rank in ``Run.build``'s order; ``override`` replaces fields of
    ``setup`` (e.g. ``zero_level=2`` or ``micro_batch=4``) for what-if hints."""
    s = dataclasses.replace(setup, **override)
    layout = Layout([ParamSpec(n, (k,), True) for n, k in s.numel_specs], s.world)
    f32, w = 4, s.weight_bytes
    if s.zero_level == 3:  # 4 psi / N of parameters and the gathered working set
        out = [
            Entry("parameters", "param_slice", w * layout.shard_size),
            Entry("parameters", "param_window", w * 2 * s.window_elements),
        ]
    else:
        out = [Entry("parameters", "params", w * layout.padded)]
    if s.zero_level >= 2:
        out.append(Entry("gradients", "grad_slice", w * layout.shard_size))
        out.append(Entry("buckets", "grad_bucket", w * bucket_elements(layout, s.groups)))
    else:
        out.append(Entry("gradients", "grads", w * layout.padded))
        if s.accum > 1:
            out.append(Entry("gradients", "micro_grads", w * layout.padded))
    arena = int(s.activation_bytes(s.micro_batch)) * w // f32
    out.append(Entry("activations", "model.arena", arena))
    if s.input_bytes_per_sample:
        out.append(Entry("activations", "input.batch", s.input_bytes_per_sample * s.micro_batch))
    owned = layout.shard_size if s.zero_level > 0 else layout.padded
    if s.optimizer_type == "adamw":
        out += [
            Entry("optimizer_state", "exp_avg", f32 * owned),
            Entry("optimizer_state", "exp_avg_sq", f32 * owned),
        ]
    else:
        out.append(Entry("optimizer_state", "momentum_buffer", f32 * owned))
    if w != f32:
        out.append(Entry("optimizer_state", "master", f32 * owned))
    scratch = scratch_bytes(s, layout)
    if scratch:
        out.append(Entry("workspace", "collectives.scratch", scratch))
    return out


def total_bytes(entries: list[Entry]) -> int:
    return sum(e.nbytes for e in entries)


def by_category(entries: list[Entry]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        out[e.category] = out.get(e.category, 0) + e.nbytes
    return out


def setup_for(run: Any) -> RankSetup:
    """The ``RankSetup`` of a ``simdist.run.Run`` whose model and data are built."""
    p, r = run.params, run.params.runconfig
    model, data = run.model, run.data
    per_sample = 0
    if not getattr(model, "inputs_in_activations", False):
        # the model reads the dataset's batch buffers in place: they are device tensors
        for buf in (getattr(data, "_x", None), getattr(data, "_y", None)):
            if isinstance(buf, np.ndarray) and buf.shape[0]:
                per_sample += buf.nbytes // buf.shape[0]
    algorithm = r.collective_algorithm
    if algorithm == "auto":  # what GradientSync will resolve it to
        padded = Layout(model.parameter_specs(), run.world).padded
        shared = getattr(run, "shared_buffers", False)
        algorithm = run.coll.choose("reduce_scatter", 4 * padded, shared)
    return RankSetup(
        numel_specs=tuple((s.name, s.numel) for s in model.parameter_specs()),
        groups=tuple((tuple(g.names), g.held) for g in model.gradient_groups()),
        world=run.world,
        rank=run.rank,
        zero_level=run.zero_level,  # the schedule's, read once from the config
        accum=p.optimizer.grad_accum_steps,
        optimizer_type=p.optimizer.optimizer_type,
        micro_batch=run.micro_batch,
        algorithm=algorithm,
        activation_bytes=model.activation_bytes,
        input_bytes_per_sample=per_sample,
        window_elements=window_elements(model, run.world),
        weight_bytes=run.precision.weight_bytes if hasattr(run, "precision") else 4,
    )


def window_elements(model: Any, world: int) -> int:
    """Elements of one ZeRO-3 gather window for ``model`` at ``world`` ranks (0: the model
    has no stages, so it cannot run ZeRO-3)."""
    if not hasattr(model, "stages"):
        return 0
    layout = Layout(model.parameter_specs(), world)
    return GatherPlan(layout, model.stages(), model.gradient_groups()).window


def suggestions(setup: RankSetup, capacity: int) -> str:
    """What would fit, each option computed with ``rank_entries``."""
    tips: list[str] = []
    if setup.world > 1:
        top = 4 if setup.window_elements else 3  # ZeRO-3 needs a model with stages
        for z in range(setup.zero_level + 1, top):
            need = total_bytes(rank_entries(setup, zero_level=z))
            if need <= capacity:
                tips.append(
                    f"runconfig.zero_opt_level={z} would fit ({format_bytes(need)} per rank)"
                )
                break
    micro = setup.micro_batch
    if micro > 1:
        # largest micro-batch with the same settings (memory grows with the batch)
        lo, hi = 0, micro - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if total_bytes(rank_entries(setup, micro_batch=mid)) <= capacity:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            tips.append(f"train_input.batch_size={lo} would fit")
        # the same global batch through accumulation (level 0/1 then add a gradient buffer)
        samples = micro * setup.accum
        for b in range(micro - 1, 0, -1):
            if samples % b == 0:
                accum = samples // b
                if total_bytes(rank_entries(setup, micro_batch=b, accum=accum)) <= capacity:
                    tips.append(
                        f"train_input.batch_size={b} with optimizer.grad_accum_steps={accum} "
                        "keeps the global batch and fits"
                    )
                    break
    if not tips:
        best = (3 if setup.window_elements else 2) if setup.world > 1 else 0
        floor = rank_entries(setup, micro_batch=1, zero_level=best)
        tips.append(
            f"even micro-batch 1{f' with ZeRO-{best}' if best else ''} needs "
            f"{format_bytes(total_bytes(floor))}: use more ranks with ZeRO, a smaller model, "
            "or a device profile with more memory"
        )
    return "; ".join(tips)


def check_device_memory(run: Any, extra_hint: Callable[[int], str] | None = None) -> list[Entry]:
    """Raise ``DeviceOutOfMemoryError`` if this rank's tensors exceed the device; else the
    plan (also stored as ``run.memory.planned``). Allocates nothing. ``extra_hint(capacity)``:
    the caller's own tip for the message (the run's: would weight streaming fit), so this
    module needs nothing from the execution modes."""
    setup = setup_for(run)
    entries = rank_entries(setup)
    mem: DeviceMemory = run.memory.device_memory
    trial = DeviceMemory(mem.capacity, mem.profile_name)
    try:
        for e in entries:
            trial.reserve(e.category, e.name, e.nbytes)
    except SimulatedOutOfMemoryError as err:
        tip = extra_hint(mem.capacity) if extra_hint else ""
        tip = f"; {tip}" if tip else ""
        raise DeviceOutOfMemoryError(
            profile_name=err.profile_name,
            capacity=err.capacity,
            in_use=err.in_use,
            category=err.category,
            name=err.name,
            nbytes=err.nbytes,
            hint=f"{suggestions(setup, mem.capacity)}{tip} (planned per rank: "
            + ", ".join(f"{c} {format_bytes(b)}" for c, b in by_category(entries).items())
            + f" = {format_bytes(total_bytes(entries))})",
        ) from None
    run.memory.planned = entries
    return entries


class DeviceAllocator:
    """``Run.memory``: the old ``alloc(category, name, n)`` interface over a ``DeviceMemory``.

    ``alloc`` accounts, then allocates float32 zeros (raising before allocating if the device
    would overflow); ``reserve`` accounts a tensor that something else allocates (the model's
    arena, the p2p scratch).
    """

    def __init__(self, device_memory: DeviceMemory, coll: Any = None):
        self.device_memory = device_memory
        self.coll = coll  # Collectives: ``shared`` allocations come from its buffer()
        self.planned: list[Entry] = []
        self._unnamed = 0

    def alloc(
        self, category: str, name: str, n: int, shared: bool = False, elem: int = 4
    ) -> np.ndarray:
        """``shared``: a buffer the collectives reduce in place (``Collectives.buffer``;
        collective: every rank must allocate it, in the same order). ``elem``: bytes per
        element on the device (2: a half-precision tensor the host holds in float32 words)."""
        if not (shared and self.coll is not None) and elem == 4:
            return self.device_memory.allocate(category, name, (int(n),), np.float32)
        self.device_memory.reserve(category, name, elem * int(n))  # simulated OOM first
        if not (shared and self.coll is not None):
            return np.zeros(int(n), np.float32)
        return self.coll.buffer(int(n))

    def reserve(self, category: str, name: str, nbytes: int) -> None:
        self.device_memory.reserve(category, name, int(nbytes))

    def add(self, category: str, nbytes: int) -> None:
        """Old interface: account ``nbytes`` under an automatic name."""
        self._unnamed += 1
        self.reserve(category, f"{category}.{self._unnamed}", nbytes)

    @property
    def bytes(self) -> dict[str, int]:
        """Bytes held now per category (categories holding nothing left out)."""
        cur = self.device_memory.current
        return {k: v for k, v in cur.items() if k != "total" and v}

    def plan_matches(self) -> bool:
        """Did the real allocations come to exactly the planned bytes per category?"""
        return by_category(self.planned) == self.bytes


__all__ = [
    "DeviceAllocator",
    "DeviceOutOfMemoryError",
    "Entry",
    "RankSetup",
    "by_category",
    "check_device_memory",
    "rank_entries",
    "setup_for",
    "suggestions",
    "total_bytes",
    "window_elements",
]
