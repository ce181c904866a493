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

Collectives: the closed forms are in ``simdist.device.collective_cost`` (re-exported here),
the schedules simdist's own algorithms run in ``simdist.device.schedule``, and one recorded
collective as the run executes it in ``simdist.device.collective``. The virtual clock that
adds kernels and collectives up into a step is ``simdist.sim.clock``.
"""

from __future__ import annotations

import math

# the clock moved to simdist.sim.clock (a leaf module); kept importable from here
from simdist.sim.clock import StepSummary, VirtualClock

from .collective_cost import (
    ALGORITHMS,
    LINK_CLASSES,
    OP_ALIASES,
    canonical_op,
    collective_time,
)
from .profile import DeviceProfile, Link, ProfileError


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
        optimizer: bool = False,
    ) -> tuple[float, float]:
        """(compute seconds, memory seconds) before combining and launch overhead.

        ``shape``: a GEMM's (m, k, n, layout), where known; profiles with a
        ``matrix_shape_efficiency`` table then take the efficiency from it
        (``gemm_efficiency``: a GEMM of 32 rows runs at half the rate of one of the same
        FLOPs with all dimensions large, one with k = 32 at four fifths).
        ``serial_flops``: the part of a vector kernel's ``flops`` in reductions (a chain of
        dependent adds per lane) or scalar libm calls, at the profile's ``scalar_tflops``
        where it publishes them (CPUs: measured on the kernels' own row reduction), else
        with the rest.
        ``optimizer``: AdamW's update pass, priced by the profile's
        ``optimizer_efficiency`` where it has one (measured on that pass itself)."""
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
            table = prof.memory_efficiency
            if optimizer and prof.optimizer_efficiency:
                table = prof.optimizer_efficiency
            if prof.memory_efficiency_key == "working_set":  # a measured sweep: interpolated
                size = max(bytes_moved, self.working_set)
                eff = interpolated_efficiency(table, size)
            else:
                eff = efficiency(table, bytes_moved)
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
        optimizer: bool = False,
    ) -> float:
        """Simulated seconds of one kernel doing ``flops`` and moving ``bytes_moved``."""
        t_c, t_m = self.kernel_terms(
            flops, bytes_moved, kind, dtype, shape, serial_flops, optimizer
        )
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


__all__ = [
    "ALGORITHMS",
    "CostModel",
    "LINK_CLASSES",
    "OP_ALIASES",
    "ProfileError",
    "StepSummary",
    "VirtualClock",
    "canonical_op",
    "collective_time",
    "efficiency",
    "elementwise_cost",
    "gemm_cost",
    "gemm_efficiency",
    "interpolated_efficiency",
]
