"""Cost model and virtual clock: how long the simulated device would take.

Kernel time (roofline, Williams et al. 2009, with Calculon-style size-keyed efficiencies)::

    t_compute = flops / (peak[kind, dtype] * eta_kind(flops))
    t_memory  = bytes / (mem_bw * eta_mem(bytes))
    t_kernel  = max(t_compute, t_memory)          # profile.combine == "roofline" (default)
              = t_compute + t_memory              # profile.combine == "sum" (Calculon's no_overlap)
    then      max(t_kernel, t_launch)             # launch_mode "hidden": async GPU launches
         or   t_kernel + t_launch                 # launch_mode "serial": host calls

Why max is the rule: a well-tiled kernel streams its operands while it computes (cp.async /
TMA on GPUs, double buffering everywhere), so the slower of the two pipes sets the time; the
sum is a pessimistic bound that only holds for kernels that load, then compute, then store.
Efficiency tables capture what the max leaves out (tails, small tiles, wave quantisation),
so a table must be used with the rule it was fitted under: the GPU profiles borrow
Calculon's published tables (Isaev et al. SC'23), which Calculon fitted and validated with
its additive ``no_overlap`` mode, so those profiles say ``combine: sum``; the host profile's
table is fitted here by ``simdist.calibrate`` from whole-kernel timings.

On a CPU (the host profile) the rule is per kind, as in the ECM model (Hager, Treibig,
Wellein): BLAS GEMMs pack their operands into cache before the arithmetic, so the operand
traffic is not overlapped (``sum``), while streaming loops are hidden behind the hardware
prefetcher (``roofline``); and a kernel's operands are only in cache when the whole step's
working set fits, so the memory efficiency is keyed by the step's resident bytes
(``memory.efficiency_key: working_set``), not the kernel's, and read between the sweep's
points (linear in log size: the rate falls steeply from L3 to DRAM, and a working set twice
a sample point is not at that point's rate).

Collectives use α–β (Hockney) formulas per algorithm; n is the per-rank buffer for
all-reduce and broadcast, and the *total* (gathered / scattered) size for reduce-scatter
and all-gather, as in nccl-tests. p = ranks, α = link latency per step, β = 1/(bw·eff),
γ = reduction cost per byte (0 on accelerators, where the reduction is fused in the copy).

=====================  ======================================================================
all-reduce ring        2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ             (Patarasuk & Yuan 2009)
all-reduce rhd         2·log2(q)α + 2(q−1)/q·nβ + (q−1)/q·nγ, q = 2^⌊log2 p⌋ (Rabenseifner);
                       p ≠ q adds the fold: 2α + 2nβ + nγ           (Thakur et al. 2005)
all-reduce rec. doub.  log2(q)(α + nβ + nγ), plus the same fold when p ≠ q
reduce-scatter ring    (p−1)α + (p−1)/p·n(β+γ)
reduce-scatter rhd     log2(q)α + (q−1)/q·n(β+γ); p ≠ q adds α + n(β+γ) + α + (n/p)β
all-gather ring        (p−1)α + (p−1)/p·nβ
all-gather rhd         ⌈log2 p⌉α + (p−1)/p·nβ    (recursive doubling; Bruck when p ≠ 2^k)
broadcast ring / rhd   (p−1)α + nβ (pipelined chain, large-message limit) / ⌈log2 p⌉(α + nβ)
p2p                    α + nβ
hierarchical (k per node, m nodes): all-reduce = RS_ring(n, k, intra) + AR_ring(n/k, m, rail)
                       + AG_ring(n, k, intra); each GPU drives its share of the node's NICs
=====================  ======================================================================

``VirtualClock`` accumulates one rank's simulated time per step: compute, exposed and
overlapped communication, and other time, and records events for the Chrome-trace timeline.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .profile import DeviceProfile, Link, ProfileError

OP_ALIASES = {
    "allreduce": "allreduce",
    "all_reduce": "allreduce",
    "all-reduce": "allreduce",
    "reduce_scatter": "reduce_scatter",
    "reduce-scatter": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "allgather": "allgather",
    "all_gather": "allgather",
    "all-gather": "allgather",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "p2p": "p2p",
    "sendrecv": "p2p",
}
ALGORITHMS = ("ring", "rhd", "recursive_doubling", "hierarchical", "native", "auto")
LINK_CLASSES = ("intra", "inter", "host", "auto")


def canonical_op(op: str) -> str:
    try:
        return OP_ALIASES[op.lower()]
    except KeyError:
        raise ValueError(
            f"unknown collective '{op}'; use one of {sorted(set(OP_ALIASES))}"
        ) from None


def efficiency(table: tuple[tuple[float, float], ...], size: float) -> float:
    """Efficiency of the first row (sorted by descending min size) whose min size <= size."""
    for min_size, eff in table:
        if size >= min_size:
            return eff
    return table[-1][1]


def interpolated_efficiency(table: tuple[tuple[float, float], ...], size: float) -> float:
    """``efficiency`` read as samples of a smooth curve: between two rows with nonzero min
    sizes, linear in log(size) (a measured sweep's points, where the rate falls steeply
    from one cache level to the next); the table's own value outside them (below the
    smallest nonzero size too: the row keyed 0 has lost its sample's size)."""
    for (hi_size, hi_eff), (lo_size, lo_eff) in zip(table, table[1:], strict=False):
        if 0 < lo_size <= size < hi_size:
            t = math.log(size / lo_size) / math.log(hi_size / lo_size)
            return lo_eff + t * (hi_eff - lo_eff)
    return efficiency(table, size)


def gemm_efficiency(tables, m: int, k: int, n: int, layout: str = "nn") -> float:
    """Fraction of the matrix peak for an (m, k) @ (k, n) GEMM in ``layout`` from a profile's
    ``matrix_shape_efficiency``: each table holds GEMMs with one axis small and the other
    two at the sweep's large size, whose efficiency (the first row) is the reference; every
    axis below it scales the reference by its own table's ratio, so a GEMM small on two
    axes (an attention head's 128 x 64 x 128) pays both. Layouts the profile does not
    measure use "nn"."""
    axes = tables.get(layout) or tables["nn"]
    ref = sum(axes[a][0][1] for a in "mkn") / 3  # all three axes large: the same GEMM
    eff = ref
    for axis, dim in zip("mkn", (m, k, n), strict=True):
        eff *= min(1.0, efficiency(axes[axis], dim) / ref)
    return eff


def _pow2_floor(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _native_algorithm(op: str, nbytes: float, p: int) -> str:
    """MPICH's default choice (maint/tuning/coll/mpir/generic.json, MPICH 3.x CVARs)."""
    pow2 = p == _pow2_floor(p)
    if op == "allreduce":
        return "recursive_doubling" if nbytes <= 2048 else "rhd"
    if op == "allgather":
        return "rhd" if (pow2 and nbytes < 512 * 1024) or nbytes < 80 * 1024 else "ring"
    if op == "reduce_scatter":
        return "rhd" if nbytes < 512 * 1024 else "ring"
    if op == "broadcast":
        return "rhd" if nbytes <= 12 * 1024 or p < 8 else "ring"
    return "ring"


def collective_time(
    op: str,
    algorithm: str,
    nbytes: float,
    world: int,
    link: Link,
    *,
    inter: Link | None = None,
    devices_per_node: int | None = None,
) -> float:
    """Seconds for one collective of ``nbytes`` over ``world`` ranks on ``link``.

    ``hierarchical`` also needs ``inter`` (the per-GPU share of the inter-node network) and
    ``devices_per_node``; ``auto`` takes the fastest of ring and rhd (and hierarchical when
    those are given and the group spans nodes).
    """
    op = canonical_op(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm '{algorithm}'; use one of {ALGORITHMS}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if world == 1 or nbytes == 0:
        return 0.0
    if algorithm == "native":
        algorithm = _native_algorithm(op, nbytes, world)
    if algorithm == "auto":
        options = [collective_time(op, a, nbytes, world, link) for a in ("ring", "rhd")]
        if inter is not None and devices_per_node and world > devices_per_node:
            options.append(
                collective_time(
                    op,
                    "hierarchical",
                    nbytes,
                    world,
                    link,
                    inter=inter,
                    devices_per_node=devices_per_node,
                )
            )
        return min(options)
    if algorithm == "hierarchical":
        if inter is None or not devices_per_node:
            raise ValueError("hierarchical collectives need inter= and devices_per_node=")
        return _hierarchical(op, nbytes, world, link, inter, devices_per_node)

    a, b, g = link.latency, link.beta, link.gamma
    n, p = float(nbytes), world
    q = _pow2_floor(p)
    lg_q = math.log2(q)
    lg_p_ceil = math.ceil(math.log2(p))
    if op == "p2p":
        return a + n * b
    if op == "allreduce":
        if algorithm == "ring":
            return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
        if algorithm == "rhd":
            t = 2 * lg_q * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g
        else:  # recursive doubling: every step exchanges and reduces the whole vector
            t = lg_q * (a + n * b + n * g)
        if q != p:  # fold the p - q extra ranks in before and out after (MPICH)
            t += 2 * a + 2 * n * b + n * g
        return t
    if op == "reduce_scatter":
        if algorithm == "ring":
            return (p - 1) * a + (p - 1) / p * n * (b + g)
        t = lg_q * a + (q - 1) / q * n * (b + g)
        if q != p:
            t += a + n * (b + g) + a + n / p * b
        return t
    if op == "allgather":
        if algorithm == "ring":
            return (p - 1) * a + (p - 1) / p * n * b
        return lg_p_ceil * a + (p - 1) / p * n * b
    # broadcast
    if algorithm == "ring":
        return (p - 1) * a + n * b
    return lg_p_ceil * (a + n * b)


def _hierarchical(op: str, n: float, p: int, intra: Link, rail: Link, k: int) -> float:
    k = min(k, p)
    m = math.ceil(p / k)
    if m == 1:
        return collective_time(op, "ring", n, p, intra)
    if op == "allreduce":
        return (
            collective_time("reduce_scatter", "ring", n, k, intra)
            + collective_time("allreduce", "ring", n / k, m, rail)
            + collective_time("allgather", "ring", n, k, intra)
        )
    if op == "reduce_scatter":
        return collective_time("reduce_scatter", "ring", n, k, intra) + collective_time(
            "reduce_scatter", "ring", n / k, m, rail
        )
    if op == "allgather":
        return collective_time("allgather", "ring", n / k, m, rail) + collective_time(
            "allgather", "ring", n, k, intra
        )
    if op == "broadcast":
        return collective_time("broadcast", "ring", n, m, rail) + collective_time(
            "broadcast", "ring", n, k, intra
        )
    return collective_time("p2p", "ring", n, 2, rail)


def gemm_cost(m: int, k: int, n: int, itemsize: int = 4) -> tuple[float, float]:
    """(flops, bytes) of C[m, n] = A[m, k] @ B[k, n]: 2mkn FLOPs, each operand touched once."""
    return 2.0 * m * k * n, float(itemsize) * (m * k + k * n + m * n)


def elementwise_cost(
    n: int, *, reads: int = 1, writes: int = 1, flops_per: float = 1.0, itemsize: int = 4
) -> tuple[float, float]:
    """(flops, bytes) of an elementwise kernel over ``n`` elements with the given streams."""
    return flops_per * n, float(itemsize) * n * (reads + writes)


class CostModel:
    """Times for one device profile: kernels (roofline) and collectives (α–β)."""

    def __init__(self, profile: DeviceProfile, dtype: str = "fp32", working_set: float = 0.0):
        self.profile = profile
        self.dtype = dtype
        # bytes the step keeps resident on the device; keys the memory efficiency on
        # profiles with ``memory.efficiency_key: working_set`` (set by the simulation)
        self.working_set = working_set

    # -- kernels ---------------------------------------------------------------------
    def kernel_terms(
        self,
        flops: float,
        bytes_moved: float,
        kind: str = "matmul",
        dtype: str | None = None,
        shape: tuple = (),
        serial_flops: float = 0.0,
    ) -> tuple[float, float]:
        """(compute seconds, memory seconds) before combining and launch overhead.

        ``shape``: a GEMM's (m, k, n, layout), where known; profiles with a
        ``matrix_shape_efficiency`` table then take the efficiency from it
        (``gemm_efficiency``: a GEMM of 32 rows runs at half the rate of one of the same
        FLOPs with all dimensions large, one with k = 32 at four fifths).
        ``serial_flops``: the part of a vector kernel's ``flops`` in code that does not
        vectorise (loop-carried reductions, scalar libm calls), at the profile's
        ``scalar_tflops`` where it publishes them (CPUs), else with the rest."""
        if kind not in ("matmul", "vector"):
            raise ValueError(f"kind must be 'matmul' or 'vector', got {kind!r}")
        if flops < 0 or bytes_moved < 0:
            raise ValueError("flops and bytes_moved must be >= 0")
        prof = self.profile
        dtype = dtype or self.dtype
        t_c = 0.0
        if flops > 0:
            if kind == "matmul":
                peak = prof.peak("matmul", dtype)
                if shape and prof.matrix_shape_efficiency:
                    eff = gemm_efficiency(prof.matrix_shape_efficiency, *shape)
                else:
                    eff = efficiency(prof.matrix_efficiency, flops)
                t_c = flops / (peak * eff)
            else:
                # Elementwise math on half types runs in fp32 registers where no separate
                # vector peak is published; with no vector peak at all the op is taken as
                # memory-bound (its compute term is left out).
                simd = flops
                scalar = prof.scalar_flops.get(dtype) or prof.scalar_flops.get("fp32")
                if scalar and serial_flops > 0:
                    simd = max(0.0, flops - serial_flops)
                    t_c = serial_flops / scalar
                for dt in (dtype, "fp32"):
                    if prof.has_peak("vector", dt):
                        peak = prof.peak("vector", dt)
                        t_c += simd / (peak * efficiency(prof.vector_efficiency, flops))
                        break
        t_m = 0.0
        if bytes_moved > 0 and prof.memory_bandwidth:
            if prof.memory_efficiency_key == "working_set":  # a measured sweep: interpolated
                size = max(bytes_moved, self.working_set)
                eff = interpolated_efficiency(prof.memory_efficiency, size)
            else:
                eff = efficiency(prof.memory_efficiency, bytes_moved)
            t_m = bytes_moved / (prof.memory_bandwidth * eff)
        return t_c, t_m

    def compute_time(
        self,
        flops: float,
        bytes_moved: float,
        kind: str = "matmul",
        dtype: str | None = None,
        shape: tuple = (),
        serial_flops: float = 0.0,
    ) -> float:
        """Simulated seconds of one kernel doing ``flops`` and moving ``bytes_moved``."""
        t_c, t_m = self.kernel_terms(flops, bytes_moved, kind, dtype, shape, serial_flops)
        t = max(t_c, t_m) if self.profile.combine_for(kind) == "roofline" else t_c + t_m
        if self.profile.launch_mode == "serial":
            return t + self.profile.kernel_launch
        return max(t, self.profile.kernel_launch)

    # -- links and collectives -----------------------------------------------------------
    def link(self, link_class: str, world: int = 2) -> Link:
        """The effective link a flat collective over ``world`` ranks sees.

        ``inter``: ranks fill nodes of ``devices_per_node``; NCCL-style multi-channel rings
        spread over all of a node's NICs, so a ring spanning nodes runs at the node's NIC
        aggregate (nccl-tests#119: 4 HDR NICs -> 85-96 GB/s busbw), capped by the intra link.
        """
        prof = self.profile
        if link_class == "intra":
            return prof.intra
        if link_class == "host":
            return prof.host
        if link_class != "inter":
            raise ValueError(f"unknown link class '{link_class}'; use one of {LINK_CLASSES}")
        k = max(1, min(prof.devices_per_node, world))
        nic = prof.inter
        if not nic.known:
            return nic
        usable = nic.effective_bandwidth * min(prof.nics_per_node, k)
        latency = nic.latency
        if k > 1 and prof.intra.known:
            usable = min(usable, prof.intra.effective_bandwidth)
            # m of the ring's p edges cross the network; NCCL's ring latency model charges
            # inter-node steps the network latency and the rest the NVLink latency
            # (nccl src/graph/tuning.cc): average per step
            m = math.ceil(world / k)
            latency = (nic.latency * m + prof.intra.latency * (world - m)) / world
        return Link("inter", usable, latency, 1.0, nic.gamma)

    def rail(self, world: int) -> Link:
        """One GPU's share of its node's NICs (hierarchical inter-node phase)."""
        prof = self.profile
        k = max(1, min(prof.devices_per_node, world))
        nic = prof.inter
        if not nic.known:
            return nic
        share = nic.effective_bandwidth * min(prof.nics_per_node, k) / k
        return Link("rail", share, nic.latency, 1.0, nic.gamma)

    def collective_time(
        self, op: str, algorithm: str, nbytes: float, world: int, link: str = "auto"
    ) -> float:
        """Seconds for a collective over a link class: intra, inter, host (staged) or auto.

        ``host`` is host-staged (gradients copied over PCIe, reduced by the hosts over the
        inter-node network, or over the host link within one node, copied back), as for
        SambaNova without ``--reduce-on-rdu``.
        """
        if link not in LINK_CLASSES:
            raise ValueError(f"unknown link class '{link}'; use one of {LINK_CLASSES}")
        op_c = canonical_op(op)
        if world <= 1 or nbytes == 0:
            return 0.0
        prof = self.profile
        spans_nodes = world > prof.devices_per_node
        if link == "host":
            host = prof.host
            n_in = nbytes / world if op_c == "allgather" else nbytes
            n_out = nbytes / world if op_c == "reduce_scatter" else nbytes
            copies = 2 * host.latency + (n_in + n_out) * host.beta
            net = self.link("inter", world) if spans_nodes else host
            return copies + collective_time(op_c, _flat(algorithm), nbytes, world, net)
        if link == "auto":
            link = "inter" if spans_nodes else "intra"
        if spans_nodes and link == "inter" and algorithm in ("hierarchical", "auto"):
            hier = collective_time(
                op_c,
                "hierarchical",
                nbytes,
                world,
                prof.intra,
                inter=self.rail(world),
                devices_per_node=prof.devices_per_node,
            )
            if algorithm == "hierarchical":
                return hier
            return min(hier, collective_time(op_c, "auto", nbytes, world, self.link(link, world)))
        return collective_time(op_c, _flat(algorithm), nbytes, world, self.link(link, world))


def _flat(algorithm: str) -> str:
    return "ring" if algorithm == "hierarchical" else algorithm


# -- virtual clock ----------------------------------------------------------------------


@dataclass
class StepSummary:
    """One step of one rank: ``total_s == compute_s + exposed_comm_s + other_s``."""

    step: int
    total_s: float
    compute_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    other_s: float
    flops: float
    bytes_moved: float
    comm_bytes: float
    by_name: dict[str, float] = field(default_factory=dict)

    @property
    def comm_s(self) -> float:
        return self.exposed_comm_s + self.overlapped_comm_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "comm_s": self.comm_s}


class VirtualClock:
    """Per-rank simulated time.

    The compute stream advances with every ``compute``/``advance`` call. Collectives run on
    one communication stream, in call order. ``overlappable_with`` (seconds) says how much
    compute already accounted on this clock ran *after* the collective's input was ready —
    e.g. the backward time that remained when a gradient bucket filled, for a loop that runs
    the real (blocking) MPI call after backward. The collective is placed on the comm stream
    at ``now - overlappable_with`` (not before the stream is free or the step began); the part
    that ends after ``now`` is exposed and advances the clock, the rest was overlapped.
    ``overlappable_with=0`` is a blocking collective: fully exposed.

    Not modelled: slowdown of compute by concurrent communication (SM/memory contention,
    arXiv 2507.03114 measures 18.9 % on average); the exposed/overlapped split is an ideal.
    """

    def __init__(self, cost: CostModel, rank: int = 0, *, record_events: bool = True):
        self.cost = cost
        self.rank = rank
        self.record_events = record_events
        self.now = 0.0
        self.events: list[dict[str, Any]] = []
        self.steps: list[StepSummary] = []
        self._comm_free = 0.0
        self._step_start = 0.0
        self.wall_origin = time.perf_counter()
        self._reset_step()

    def _reset_step(self) -> None:
        self._compute = self._exposed = self._overlapped = self._other = 0.0
        self._flops = self._bytes = self._comm_bytes = 0.0
        self._by_name: dict[str, float] = {}

    def _event(self, name: str, cat: str, track: str, start: float, dur: float, **args) -> None:
        if self.record_events:
            self.events.append(
                {"name": name, "cat": cat, "track": track, "start": start, "dur": dur, "args": args}
            )

    def compute(
        self,
        name: str,
        flops: float,
        bytes_moved: float,
        kind: str = "matmul",
        dtype: str | None = None,
        count: int = 1,
        seconds: float | None = None,
        serial_flops: float = 0.0,
    ) -> float:
        """Advance by ``count`` identical kernels of ``flops`` and ``bytes_moved`` each (one
        event); returns the time. Efficiency is keyed by one kernel's size, not the sum.
        ``seconds``: the total time, already computed with ``CostModel.compute_time`` (a
        caller replaying the same kernels every step caches it)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if seconds is None:
            dur = count * self.cost.compute_time(
                flops, bytes_moved, kind, dtype, serial_flops=serial_flops
            )
        elif seconds < 0:
            raise ValueError("seconds must be >= 0")
        else:
            dur = float(seconds)
        args = {"flops": count * flops, "bytes": count * bytes_moved}
        if count > 1:
            args["calls"] = count
        self._event(name, kind, "compute", self.now, dur, **args)
        self.now += dur
        self._compute += dur
        self._flops += count * flops
        self._bytes += count * bytes_moved
        self._by_name[name] = self._by_name.get(name, 0.0) + dur
        return dur

    def advance(self, name: str, seconds: float, cat: str = "other") -> float:
        """Advance by time modelled elsewhere (input pipeline, host work, optimizer tail)."""
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        self._event(name, cat, "compute", self.now, seconds)
        self.now += seconds
        self._other += seconds
        self._by_name[name] = self._by_name.get(name, 0.0) + seconds
        return seconds

    def collective(
        self,
        name: str,
        op: str,
        algorithm: str,
        nbytes: float,
        world: int,
        link: str = "auto",
        overlappable_with: float = 0.0,
    ) -> float:
        """Account one collective; returns its full simulated duration."""
        dur = self.cost.collective_time(op, algorithm, nbytes, world, link)
        self.record_collective(name, dur, overlappable_with, nbytes, op=op, algorithm=algorithm)
        return dur

    def record_collective(
        self, name: str, duration: float, overlappable_with: float = 0.0, nbytes: float = 0, **args
    ) -> float:
        """Place a collective of known ``duration`` on the comm stream; returns exposed time."""
        if duration < 0 or overlappable_with < 0:
            raise ValueError("duration and overlappable_with must be >= 0")
        start = max(self.now - overlappable_with, self._comm_free, self._step_start)
        end = start + duration
        exposed = max(0.0, end - self.now)
        self._comm_free = end
        self._event(name, "comm", "comm", start, duration, nbytes=nbytes, exposed=exposed, **args)
        if exposed > 0:
            self._event(f"wait {name}", "exposed_comm", "compute", self.now, exposed)
        self.now += exposed
        self._exposed += exposed
        self._overlapped += duration - exposed
        self._comm_bytes += nbytes
        self._by_name[name] = self._by_name.get(name, 0.0) + duration
        return exposed

    def measured(
        self, name: str, start: float, end: float, cat: str = "measured", **args: Any
    ) -> None:
        """Record a host wall-clock interval (``time.perf_counter()`` stamps) for the timeline."""
        self._event(name, cat, "measured", start - self.wall_origin, end - start, **args)

    def end_step(self) -> StepSummary:
        """Close the step: all communication is complete before the next step starts."""
        if self._comm_free > self.now:  # cannot happen via record_collective; kept for safety
            self._exposed += self._comm_free - self.now
            self.now = self._comm_free
        summary = StepSummary(
            step=len(self.steps),
            total_s=self.now - self._step_start,
            compute_s=self._compute,
            exposed_comm_s=self._exposed,
            overlapped_comm_s=self._overlapped,
            other_s=self._other,
            flops=self._flops,
            bytes_moved=self._bytes,
            comm_bytes=self._comm_bytes,
            by_name=dict(self._by_name),
        )
        self.steps.append(summary)
        self._step_start = self.now
        self._reset_step()
        return summary

    def totals(self) -> dict[str, float]:
        """Sums over finished steps and the mean step time (for performance.json)."""
        keys = ("total_s", "compute_s", "exposed_comm_s", "overlapped_comm_s", "other_s", "flops")
        out = {k: sum(getattr(s, k) for s in self.steps) for k in keys}
        out["steps"] = len(self.steps)
        out["mean_step_s"] = out["total_s"] / len(self.steps) if self.steps else 0.0
        return out


__all__ = [
    "ALGORITHMS",
    "CostModel",
    "LINK_CLASSES",
    "ProfileError",
    "StepSummary",
    "VirtualClock",
    "canonical_op",
    "collective_time",
    "efficiency",
    "elementwise_cost",
    "gemm_cost",
]
