"""Device profiles: what one simulated accelerator can do, read from a cited YAML file.

A profile holds peak rates, memory capacity and bandwidth, size-keyed efficiency tables and
the three link classes a rank can talk over (``intra``-node fabric, ``inter``-node network,
``host`` link for host-staged traffic). It holds numbers, not behaviour: ``simdist.device.cost``
turns them into times. Every number in a shipped profile carries its source in a comment;
a figure nobody published is ``null`` and is listed in ``DeviceProfile.unknown`` so that
reports can say which terms were left out instead of silently inventing them.

YAML units are the ones datasheets use (TFLOP/s, GB/s = 1e9 B/s, GiB or GB, µs); the
dataclass stores SI units (FLOP/s, B/s, bytes, seconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
DTYPES = ("fp32", "tf32", "bf16", "fp16")
# Scalar rates (``compute.scalar_tflops``, optional): fp32 for the kernels' reductions,
# fp64 for the float64 gradient-norm reduction.
SCALAR_DTYPES = ("fp32", "fp64")


class ProfileError(ValueError):
    """A profile name that does not exist or a profile file that is malformed."""


@dataclass(frozen=True)
class Link:
    """One link class in the α–β (Hockney) model.

    ``bandwidth`` is the line rate per direction in B/s and ``efficiency`` the fraction of it
    that large transfers achieve (protocol overhead); ``beta`` is the resulting s/B.
    ``gamma`` is the reduction cost in s/B where the reduction is not free (CPU reductions).
    A ``None`` bandwidth means the profile has no published figure for this link.
    """

    name: str
    bandwidth: float | None  # B/s per direction, line rate
    latency: float = 0.0  # s per message / algorithm step (α)
    efficiency: float = 1.0  # achieved / line rate for large messages
    gamma: float = 0.0  # s per byte reduced
    # Optional size-keyed refinements ((min bytes, fraction), descending), measured where a
    # single rate does not hold across sizes (CPU caches): of the bandwidth per message, of
    # the reduction rate per block reduced. Empty: the plain α-β-γ model.
    size_efficiency: tuple[tuple[float, float], ...] = ()
    reduce_efficiency: tuple[tuple[float, float], ...] = ()
    # Direct peer load/store (the "shm" collectives: shared memory, GPU peer-to-peer): its
    # own rate, fence latency and size table where measured; None: the link's own figures.
    direct: Link | None = None
    # On a direct link: stores into a peer's memory by size, where they run at another
    # rate than loads from it (``size_efficiency``); empty: the same.
    store_efficiency: tuple[tuple[float, float], ...] = ()
    # A step that adds what it receives (p2p's pipelined reduce exchange; shm's load and
    # add), where measured as a whole, by size: it then costs α plus the bytes at this rate
    # instead of the copy's plus γ (on a CPU the addition partly overlaps the transfer,
    # and the pipelined exchange can even beat one plain Sendrecv of the same size).
    reducing_efficiency: tuple[tuple[float, float], ...] = ()
    # An all-reduce's all-gather steps, where measured apart (a Sendrecv right after a
    # reduce exchange on the same buffer, as the all-reduce runs its second half: on a CPU
    # the cache state its first half leaves sets the rate), by size; empty: the
    # ``size_efficiency`` of an all-gather called alone.
    gather_efficiency: tuple[tuple[float, float], ...] = ()
    # Seconds of the caller's own work per collective call (simdist's Python on a CPU host:
    # argument checks, the algorithm's dispatch), on top of its steps' α.
    call_overhead: float = 0.0

    @property
    def peer_access(self) -> Link:
        """The link as direct loads and stores see it (``direct``, else this link)."""
        return self.direct if self.direct is not None else self

    @property
    def for_stores(self) -> Link:
        """This link with its store rates as its rates (itself where it has none)."""
        if not self.store_efficiency:
            return self
        return dataclasses.replace(self, size_efficiency=self.store_efficiency)

    @property
    def after_reduce(self) -> Link:
        """This link as an all-reduce's second half sees it (``gather_efficiency`` as its
        message rates; itself where it has none)."""
        if not self.gather_efficiency:
            return self
        return dataclasses.replace(self, size_efficiency=self.gather_efficiency)

    @property
    def known(self) -> bool:
        return self.bandwidth is not None and self.bandwidth > 0

    def beta_at(self, nbytes: float) -> float:
        """Seconds per byte of a message of ``nbytes`` (``beta`` unless size-keyed)."""
        if not self.size_efficiency:
            return self.beta
        return self.beta / _row(self.size_efficiency, nbytes)

    def reducing_beta_at(self, nbytes: float) -> float:
        """Seconds per byte of a reducing step of ``nbytes`` (``reducing_efficiency``)."""
        return self.beta / _row(self.reducing_efficiency, nbytes)

    def gamma_at(self, nbytes: float) -> float:
        """Seconds per byte reducing a block of ``nbytes`` (``gamma`` unless size-keyed)."""
        if not self.reduce_efficiency:
            return self.gamma
        return self.gamma / _row(self.reduce_efficiency, nbytes)

    @property
    def effective_bandwidth(self) -> float:
        if not self.known:
            raise ProfileError(f"link '{self.name}' has no published bandwidth in this profile")
        return float(self.bandwidth) * self.efficiency

    @property
    def beta(self) -> float:
        """Seconds per byte on the wire."""
        return 1.0 / self.effective_bandwidth


@dataclass(frozen=True)
class Streaming:
    """Weight-streaming execution (Cerebras MemoryX/SwarmX): weights live off-device."""

    bandwidth: float  # B/s each way between the device and the weight store
    capacity_bytes: int  # capacity of the external weight store


@dataclass(frozen=True)
class DeviceProfile:
    """A simulated accelerator. Efficiency tables are ``((min_size, fraction), ...)``,
    sorted by descending ``min_size`` (FLOPs for compute tables, bytes for memory)."""

    name: str
    description: str
    confidence: str
    matrix_flops: Mapping[str, float]  # dtype -> dense peak FLOP/s of the matrix engine
    vector_flops: Mapping[str, float]  # dtype -> peak FLOP/s of the vector engine
    # dtype -> FLOP/s of code that does not vectorise (loop-carried reductions, scalar libm
    # calls); optional: where absent (GPUs reduce in parallel) such FLOPs are vector FLOPs
    scalar_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth: float | None  # B/s
    kernel_launch: float  # s
    launch_mode: str  # "hidden": async launch, bounds tiny kernels; "serial": adds per call
    # "roofline" (max of compute and memory time) or "sum", or one per kernel kind:
    # {"matmul": rule, "vector": rule}
    combine: str | Mapping[str, str]
    matrix_efficiency: tuple[tuple[float, float], ...]
    vector_efficiency: tuple[tuple[float, float], ...]
    memory_efficiency: tuple[tuple[float, float], ...]
    devices_per_node: int
    nics_per_node: int
    intra: Link
    inter: Link
    host: Link
    streaming: Streaming | None = None
    execution: str = "resident"  # "resident" (weights in device memory) | "weight_streaming"
    sources: Mapping[str, str] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()  # fields the profile leaves null (not published)
    path: str = ""
    sha256: str = ""
    # which size keys the memory efficiency: "kernel" (its own bytes: GPUs, where small
    # transfers are inefficient) or "working_set" (the bytes the step keeps resident: a CPU,
    # whose caches hold a kernel's operands only when the whole step fits in them)
    memory_efficiency_key: str = "kernel"
    # Optional (calibrated host profiles): AdamW's own update pass, [min bytes moved,
    # fraction of bandwidth], read like ``memory_efficiency``; it is the one streaming kernel
    # of a step that reads four arrays and writes three, and a core keeps more of such a
    # pass in flight than the copy / add sweep shows (AdamW ran 1.4-1.5x the copy rate at
    # the same sizes on the Xeon). Empty (and for SGD): the memory table prices it.
    optimizer_efficiency: tuple[tuple[float, float], ...] = ()
    # Optional: GEMM efficiency by shape, used instead of the FLOP-keyed table for GEMMs
    # whose shape is known: {layout: {axis: ((dim, fraction), ...)}}, layout "nn" | "nt" |
    # "tn" (which operand BLAS reads transposed), axis "m" | "k" | "n", each table the
    # GEMMs with that one dimension small and the other two large (descending dims).
    matrix_shape_efficiency: Mapping[str, Mapping[str, tuple[tuple[float, float], ...]]] = field(
        default_factory=dict
    )

    def peak(self, kind: str, dtype: str) -> float:
        """Peak FLOP/s for ``kind`` ("matmul" or "vector") and ``dtype``; error if unpublished."""
        table = self.matrix_flops if kind == "matmul" else self.vector_flops
        value = table.get(dtype)
        if value is None:
            have = ", ".join(sorted(table)) or "none"
            raise ProfileError(
                f"device profile '{self.name}' has no published {kind} peak for {dtype} "
                f"(published: {have})"
            )
        return value

    def combine_for(self, kind: str) -> str:
        """The kernel-time rule ("roofline" | "sum") for ``kind`` ("matmul" | "vector")."""
        return self.combine if isinstance(self.combine, str) else self.combine[kind]

    def has_peak(self, kind: str, dtype: str) -> bool:
        table = self.matrix_flops if kind == "matmul" else self.vector_flops
        return table.get(dtype) is not None

    def link(self, name: str) -> Link:
        if name not in ("intra", "inter", "host"):
            raise ProfileError(f"unknown link class '{name}'; use intra, inter or host")
        return getattr(self, name)


def list_profiles() -> list[str]:
    """Names of the profiles shipped in ``simdist/device/profiles``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_path(name_or_path: str | Path) -> Path:
    """The YAML file of a shipped profile's name or of a path; a clear error if neither."""
    text = str(name_or_path)
    candidate = Path(text)
    if candidate.suffix in (".yaml", ".yml") or "/" in text or "\\" in text:
        if candidate.is_file():
            return candidate
        raise ProfileError(
            f"device profile file '{text}' does not exist; available profiles: "
            + ", ".join(list_profiles())
        )
    shipped = PROFILE_DIR / f"{text}.yaml"
    if shipped.is_file():
        return shipped
    raise ProfileError(
        f"device profile '{text}' does not exist; available: " + ", ".join(list_profiles())
    )


def _number(value: Any, name: str, positive: bool = False, nullable: bool = True) -> float:
    """``value`` as a finite float, >= 0 (> 0 with ``positive``: a rate or size the cost
    model divides by or allocates against, where 0 would fail mid-run); a ProfileError
    naming ``name`` otherwise. ``nullable``: the key may be null (not published)."""
    null = " (null if not published)" if nullable else ""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProfileError(
            f"{name} must be a number{' or null' if nullable else ''}, got {value!r}"
        )
    if positive and value <= 0:
        raise ProfileError(f"{name} must be > 0{null}, got {value}")
    if value < 0:
        raise ProfileError(f"{name} must be >= 0, got {value}")
    return float(value)


def _num(
    section: Mapping[str, Any], key: str, where: str, unknown: list[str], positive: bool = False
) -> float | None:
    if key not in section:
        raise ProfileError(f"{where}: missing key '{key}' (write null if it is not published)")
    value = section[key]
    if value is None:
        unknown.append(f"{where}.{key}")
        return None
    return _number(value, f"{where}.{key}", positive)


def _table(raw: Any, where: str, scale: float) -> tuple[tuple[float, float], ...]:
    if raw is None:
        return ((0.0, 1.0),)
    if not isinstance(raw, list | tuple) or not raw:
        raise ProfileError(f"{where}: a list of [min_size, efficiency] rows, got {raw!r}")
    rows = []
    for row in raw:
        if not (isinstance(row, list | tuple) and len(row) == 2):
            raise ProfileError(f"{where}: rows must be [min_size, efficiency], got {row!r}")
        size = _number(row[0], f"{where}: min_size", nullable=False)
        eff = _number(row[1], f"{where}: efficiency", nullable=False)
        if not 0.0 < eff <= 1.0:
            raise ProfileError(f"{where}: efficiency must be in (0, 1], got {eff}")
        rows.append((size * scale, eff))
    rows.sort(key=lambda r: -r[0])
    if rows[-1][0] != 0.0:
        raise ProfileError(f"{where}: the table needs a row for size 0 (smallest ops)")
    return tuple(rows)


def _row(table: tuple[tuple[float, float], ...], size: float) -> float:
    """The fraction of the first row (descending min size) whose min size <= size."""
    for min_size, eff in table:
        if size >= min_size:
            return eff
    return table[-1][1]


def _link(raw: Mapping[str, Any] | None, name: str, unknown: list[str]) -> Link:
    where = f"links.{name}"
    if raw is None:
        unknown.append(where)
        return Link(name, None)
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where} must be a mapping or null, got {raw!r}")
    # bandwidth and efficiency are divisors (beta = 1 / (bandwidth * efficiency))
    bw = _num(raw, "bandwidth_gbs", where, unknown, positive=True)
    lat = _num(raw, "latency_us", where, unknown)
    eff = _num(raw, "efficiency", where, unknown, positive=True)
    if eff is not None and eff > 1:
        raise ProfileError(f"{where}.efficiency must be in (0, 1], got {eff}")
    gamma = raw.get("reduce_gbs")  # optional: reduction throughput for CPU-side reductions
    if gamma is not None:  # a divisor too; absent or null: reductions are free
        gamma = _number(gamma, f"{where}.reduce_gbs", positive=True)
    call = raw.get("call_overhead_us")  # optional: per collective call
    if call is not None:
        call = _number(call, f"{where}.call_overhead_us")
    return Link(
        name=name,
        bandwidth=None if bw is None else bw * 1e9,
        latency=0.0 if lat is None else lat * 1e-6,
        efficiency=1.0 if eff is None else eff,
        gamma=0.0 if gamma is None else 1.0 / (gamma * 1e9),
        size_efficiency=_optional_table(raw, "size_efficiency", where),
        reduce_efficiency=_optional_table(raw, "reduce_efficiency", where),
        reducing_efficiency=_optional_table(raw, "reducing_efficiency", where),
        store_efficiency=_optional_table(raw, "store_efficiency", where),
        gather_efficiency=_optional_table(raw, "gather_efficiency", where),
        direct=None
        if raw.get("direct") is None
        else _link(raw["direct"], f"{name}.direct", unknown),
        call_overhead=0.0 if call is None else float(call) * 1e-6,
    )


def parse_link(raw: Mapping[str, Any], name: str) -> Link:
    """A link from a profile's entry for it (``links.<name>``, as YAML loads it); a
    figure it lacks is an error."""
    unknown: list[str] = []
    link = _link(raw, name, unknown)
    if unknown:
        raise ProfileError(f"{', '.join(unknown)}: needs bandwidth_gbs, latency_us, efficiency")
    return link


def _optional_table(raw: Mapping[str, Any], key: str, where: str) -> tuple:
    """A [min bytes, fraction] table when the profile gives one, else ()."""
    if raw.get(key) is None:
        return ()
    return _table(raw[key], f"{where}.{key}", 1.0)


GEMM_LAYOUTS = ("nn", "nt", "tn")
GEMM_AXES = ("m", "k", "n")


def _shape_tables(compute: Mapping[str, Any]) -> dict:
    """``compute.matrix_shape_efficiency``: {layout: {axis: table}}, or {} if absent."""
    raw = compute.get("matrix_shape_efficiency")
    if raw is None:
        if compute.get("matrix_min_dim_efficiency") is not None:
            raise ProfileError(
                "compute.matrix_min_dim_efficiency is the format of an older simdist: re-run "
                "`mpiexec -n 2 python -m simdist.calibrate` to write matrix_shape_efficiency"
            )
        return {}
    where = "compute.matrix_shape_efficiency"
    if not isinstance(raw, Mapping) or not raw or set(raw) - set(GEMM_LAYOUTS):
        raise ProfileError(f"{where}: a mapping with keys among {GEMM_LAYOUTS}")
    out = {}
    for layout, axes in raw.items():
        if not isinstance(axes, Mapping) or set(axes) != set(GEMM_AXES):
            raise ProfileError(f"{where}.{layout}: give one table for each axis {GEMM_AXES}")
        out[layout] = {a: _table(axes[a], f"{where}.{layout}.{a}", 1.0) for a in GEMM_AXES}
    if "nn" not in out:
        raise ProfileError(f"{where}: the 'nn' layout is required (the others default to it)")
    return out


def _scalar_table(compute: Mapping[str, Any]) -> dict:
    """``compute.scalar_tflops`` ({fp32, fp64} -> TFLOP/s, each optional) in FLOP/s."""
    raw = compute.get("scalar_tflops")
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or set(raw) - set(SCALAR_DTYPES):
        raise ProfileError(f"compute.scalar_tflops: a mapping with keys among {SCALAR_DTYPES}")
    out = {}
    for dtype, value in raw.items():
        if value is None:
            continue
        out[dtype] = _number(value, f"compute.scalar_tflops.{dtype}", positive=True) * 1e12
    return out


def _capacity(section: Mapping[str, Any], where: str) -> int:
    """Bytes of ``capacity_gib`` or ``capacity_gb``: > 0 (a device of no memory cannot
    hold a parameter; DeviceMemory would refuse it mid-run)."""
    for key, unit in (("capacity_gib", 2**30), ("capacity_gb", 1e9)):
        if section.get(key) is not None:
            nbytes = int(
                round(_number(section[key], f"{where}.{key}", positive=True, nullable=False) * unit)
            )
            if nbytes <= 0:  # positive but under half a byte
                raise ProfileError(f"{where}.{key} must be at least 1 byte, got {section[key]}")
            return nbytes
    raise ProfileError(f"{where}: give capacity_gib or capacity_gb")


def _count(section: Mapping[str, Any], key: str, where: str) -> int:
    """An optional count (devices or NICs per node): a positive integer, 1 when absent."""
    value = section.get(key)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{where}.{key} must be a positive integer, got {value!r}")
    return value


def _dtype_table(raw: Mapping[str, Any] | None, where: str, unknown: list[str]) -> dict:
    if raw is not None and not isinstance(raw, Mapping):
        raise ProfileError(f"{where} must be a mapping of dtype to TFLOP/s, got {raw!r}")
    out: dict[str, float] = {}
    for dtype in DTYPES:
        value = None if raw is None else raw.get(dtype)
        if value is None:
            unknown.append(f"{where}.{dtype}")
            continue
        # a peak divides the kernel's FLOPs: 0 is no rate at all (null: not published)
        out[dtype] = _number(value, f"{where}.{dtype}", positive=True) * 1e12
    if raw is not None:
        if raw.get("fp64") is not None and where == "compute.vector_tflops":
            raise ProfileError(
                "compute.vector_tflops.fp64 is the format of an older simdist (the gradient "
                "norm's rate is now compute.scalar_tflops.fp64): re-run `mpiexec -n 2 python "
                "-m simdist.calibrate`"
            )
        extra = set(raw) - set(DTYPES)
        if extra:
            raise ProfileError(f"{where}: unknown dtypes {sorted(extra)}; use {DTYPES}")
    return out


# libyaml's safe loader where PyYAML has it: every rank of every run loads a profile (the
# host's calibration tables), ~0.1 s in the pure-Python loader
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _safe_load(blob: bytes):
    """yaml.safe_load with _SAFE_LOADER (safe either way: plain YAML types only)."""
    loader = _SAFE_LOADER(blob)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """Load a shipped profile by name (``"a100-80gb"``) or any profile YAML by path."""
    path = profile_path(name_or_path)
    blob = path.read_bytes()
    try:
        doc = _safe_load(blob)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise ProfileError(f"{path}: a profile is a YAML mapping")
    unknown: list[str] = []
    try:
        compute = doc["compute"]
        memory = doc["memory"]
        links = doc["links"]
    except KeyError as exc:
        raise ProfileError(f"{path}: missing section {exc}") from exc

    combine = compute.get("combine", "roofline")
    rules = ("roofline", "sum")
    if isinstance(combine, Mapping):  # per kernel kind: {matmul: sum, vector: roofline}
        if set(combine) != {"matmul", "vector"} or set(combine.values()) - set(rules):
            raise ProfileError(
                f"{path}: compute.combine per kind is {{matmul: RULE, vector: RULE}}, RULE "
                f"roofline or sum; got {dict(combine)!r}"
            )
        combine = dict(combine)
    elif combine not in rules:
        raise ProfileError(f"{path}: compute.combine must be roofline or sum, got {combine!r}")
    keyed = memory.get("efficiency_key", "kernel")
    if keyed not in ("kernel", "working_set"):
        raise ProfileError(
            f"{path}: memory.efficiency_key must be kernel or working_set, got {keyed!r}"
        )
    launch_mode = compute.get("launch_mode", "hidden")
    if launch_mode not in ("hidden", "serial"):
        raise ProfileError(f"{path}: compute.launch_mode must be hidden or serial")
    launch = _num(compute, "kernel_launch_us", "compute", unknown)
    mem_bw = _num(memory, "bandwidth_gbs", "memory", unknown, positive=True)

    streaming = None
    if doc.get("streaming") is not None:
        s = doc["streaming"]
        if not isinstance(s, Mapping):
            raise ProfileError(f"{path}: streaming must be a mapping or null")
        sbw = _num(s, "bandwidth_gbs", "streaming", unknown, positive=True)
        if sbw is None:
            raise ProfileError(f"{path}: streaming.bandwidth_gbs is required for streaming")
        streaming = Streaming(bandwidth=sbw * 1e9, capacity_bytes=_capacity(s, "streaming"))
    execution = doc.get("execution", "resident")
    if execution not in ("resident", "weight_streaming"):
        raise ProfileError(f"{path}: execution must be resident or weight_streaming")
    if execution == "weight_streaming" and streaming is None:
        raise ProfileError(f"{path}: weight_streaming execution needs a streaming section")

    inter_raw = links.get("inter")  # not a mapping: _link says so
    inter_raw = inter_raw if isinstance(inter_raw, Mapping) else {}
    return DeviceProfile(
        name=str(doc.get("name", path.stem)),
        description=str(doc.get("description", "")).strip(),
        confidence=str(doc.get("confidence", "unknown")),
        matrix_flops=_dtype_table(compute.get("matrix_tflops"), "compute.matrix_tflops", unknown),
        vector_flops=_dtype_table(compute.get("vector_tflops"), "compute.vector_tflops", unknown),
        scalar_flops=_scalar_table(compute),
        memory_bytes=_capacity(memory, "memory"),
        memory_bandwidth=None if mem_bw is None else mem_bw * 1e9,
        kernel_launch=0.0 if launch is None else launch * 1e-6,
        launch_mode=launch_mode,
        combine=combine,
        matrix_efficiency=_table(compute.get("matrix_efficiency"), "matrix_efficiency", 1e9),
        matrix_shape_efficiency=_shape_tables(compute),
        vector_efficiency=_table(compute.get("vector_efficiency"), "vector_efficiency", 1e9),
        memory_efficiency=_table(memory.get("efficiency"), "memory.efficiency", 1e6),
        memory_efficiency_key=keyed,
        optimizer_efficiency=(
            ()
            if memory.get("optimizer_efficiency") is None
            else _table(memory["optimizer_efficiency"], "memory.optimizer_efficiency", 1e6)
        ),
        devices_per_node=_count(links, "devices_per_node", "links"),
        nics_per_node=_count(inter_raw, "nics_per_node", "links.inter"),
        intra=_link(links.get("intra"), "intra", unknown),
        inter=_link(links.get("inter"), "inter", unknown),
        host=_link(links.get("host"), "host", unknown),
        streaming=streaming,
        execution=execution,
        sources={str(k): str(v) for k, v in (doc.get("sources") or {}).items()},
        unknown=tuple(unknown),
        path=str(path),
        sha256=hashlib.sha256(blob).hexdigest(),
    )
