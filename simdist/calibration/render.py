"""The host profile's YAML text from the measurements, one comment per number saying how
it was obtained."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .compute import SHAPE_BIG
from .link import intra_link


def _min_size(size: int) -> str:
    return "the smallest size and below" if size == 0 else f"{size} B"


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def render(m: dict[str, Any], previous: dict[str, Any] | None) -> str:
    """The host profile YAML, one comment per number saying how it was obtained."""
    cores = m["cores"]
    now = m["date"]
    gemm, mem = m["gemm"], m["memory"]
    peak_gemm = max(gemm.values())
    best_n = max(gemm, key=gemm.get)
    copy_peak = max(mem["copy"].values())
    add_peak = max(mem["add"].values())
    opt = mem.get("adamw") or {}
    mem_peak = max(copy_peak, add_peak, *opt.values())
    mem_pts = {s: max(mem["copy"][s], mem["add"][s]) for s in mem["copy"]}
    big = max(mem["copy"])
    cpu = m["cpu"]  # quoted below: a model name may hold YAML's special characters
    lines = [
        "# This machine as a simdist device: one rank = one core, one BLAS/numba thread.",
        f"# Written by `{m['command']}` on {now} (simdist.calibrate).",
        f"# Host: {m['host']}, {cores} cores (ranks beyond {cores} oversubscribe the cores),",
        f"# load average {m['loadavg']} at the start; OPENBLAS_CORETYPE="
        f"{m['openblas_coretype']}, OPENBLAS_L2_SIZE={m['openblas_l2']}.",
        "# All numbers are measured here (best of N); re-run calibrate on another machine.",
        "name: host",
        f"description: {json.dumps(f'this host ({cpu}), one core per simulated device')}",
        "confidence: measured",
        "sources:",
        f'  calibrate: "simdist.calibrate measurements, {now}"',
        f"  cpu: {json.dumps(cpu)}  # a run on another CPU says these rates are not its",
        "compute:",
        "  matrix_tflops:",
        f"    fp32: {peak_gemm / 1e12:.6f}  # [calibrate] best float32 GEMM, n={best_n}: "
        f"{peak_gemm / 1e9:.1f} GFLOP/s",
        "    tf32: null          # no such unit on this CPU",
        "    bf16: null          # numpy/BLAS has no bf16 GEMM; kernels run float32",
        "    fp16: null          # numpy/BLAS has no fast fp16 GEMM",
        "  vector_tflops:",
        f"    fp32: {m['vector_flops'] / 1e12:.6f}  # [calibrate] numba degree-8 polynomial "
        f"per element, 16 KiB arrays: {m['vector_flops'] / 1e9:.1f} GFLOP/s",
        "    tf32: null          # not applicable",
        "    bf16: null          # not applicable",
        "    fp16: null          # not applicable",
        "  scalar_tflops:        # reductions: a chain of dependent adds per lane",
        f"    fp32: {m['scalar_flops']['fp32'] / 1e12:.6f}  # [calibrate] rowops.row_sum on "
        f"rows of 256: {m['scalar_flops']['fp32'] / 1e9:.2f} GFLOP/s",
        f"    fp64: {m['scalar_flops']['fp64'] / 1e12:.6f}  # [calibrate] float64 sum of "
        f"squares (the gradient-norm kernel), 256 KiB: {m['scalar_flops']['fp64'] / 1e9:.2f} "
        "GFLOP/s",
        f"  kernel_launch_us: {m['overhead'] * 1e6:.3f}  # [calibrate] Python -> numba call "
        "of an empty kernel",
        "  launch_mode: serial   # the host runs Python and kernel back to back",
        "  combine:              # per kind, as the ECM model has it for a CPU core",
        "    matmul: sum         # BLAS packs its operands first: their traffic adds",
        "    vector: roofline    # streaming loops: the prefetcher hides the traffic",
        "  matrix_efficiency:    # [min op GFLOP, fraction of peak] from the GEMM sweep",
    ]
    for n in sorted(gemm, reverse=True):  # the smallest size stands for everything below
        gflop = 2 * n**3 / 1e9 if n != min(gemm) else 0.0
        eff = gemm[n] / peak_gemm
        lines.append(
            f"    - [{gflop:.6g}, {eff:.4f}]  # [calibrate] n={n}: {gemm[n] / 1e9:.1f} GFLOP/s"
        )
    shapes = m.get("gemm_shapes") or {}
    if shapes:
        lines.append(
            "  matrix_shape_efficiency:  # [dim, fraction of peak] per layout (nn a @ b, nt a @ "
            f"b.T, tn a.T @ b) and small axis, the other two dims {SHAPE_BIG}"
        )
        for layout, axes in shapes.items():
            lines.append(f"    {layout}:")
            for axis, points in axes.items():
                dims = sorted(points, reverse=True)
                rows = ", ".join(
                    f"[{0 if s == dims[-1] else s}, {min(1.0, points[s] / peak_gemm):.4f}]"
                    for s in dims
                )
                rates = ", ".join(f"{s}: {points[s] / 1e9:.0f}" for s in dims)
                lines.append(f"      {axis}: [{rows}]  # [calibrate] GFLOP/s {rates}")
    lines += [
        "  vector_efficiency: null  # elementwise kernels are memory-bound here",
        "memory:",
        f"  capacity_gib: {m['mem_total'] / cores / 2**30:.3f}  # [calibrate] MemTotal "
        f"{m['mem_total'] / 2**30:.2f} GiB / {cores} cores (one rank per core)",
        f"  bandwidth_gbs: {mem_peak / 1e9:.3f}  # [calibrate] best of copy/add"
        + ("/AdamW" if opt else "")
        + " over sizes (read + write bytes)",
        "  efficiency_key: working_set  # a kernel's operands are as far away as the step's "
        "resident bytes reach (read between the sweep's points, linear in log size)",
        "  efficiency:           # [min MB moved, fraction of bandwidth] copy/add sweep",
    ]
    for size in sorted(mem_pts, reverse=True):
        eff = mem_pts[size] / mem_peak
        moved_mb = 2 * size / 1e6 if size != min(mem_pts) else 0.0
        lines.append(
            f"    - [{moved_mb:.6g}, {eff:.4f}]  # [calibrate] {size / 2**20:g} MiB arrays: "
            f"copy {mem['copy'][size] / 1e9:.1f}, add {mem['add'][size] / 1e9:.1f} GB/s"
        )
    if opt:
        lines.append(
            "  optimizer_efficiency: # [min MB moved, fraction of bandwidth] AdamW's update "
            "over four arrays of each size (28 bytes per element)"
        )
        for size in sorted(opt, reverse=True):
            moved_mb = 7 * size / 1e6 if size != min(opt) else 0.0
            lines.append(
                f"    - [{moved_mb:.6g}, {opt[size] / mem_peak:.4f}]  # [calibrate] "
                f"{size / 2**20:g} MiB arrays: {opt[size] / 1e9:.1f} GB/s"
            )
    lines += ["links:", f"  devices_per_node: {cores}  # [calibrate] os.cpu_count()"]
    mpi = m.get("mpi")
    prev_intra = ((previous or {}).get("links") or {}).get("intra")
    reduce_gbs = add_peak / 3 / 1e9  # an in-place add moves 3 bytes per byte reduced
    if mpi:
        a_pp, b_pp = mpi["pingpong_fit"]
        b_sr = mpi["sendrecv_fit"][1]
        direct = m.get("direct")
        link = intra_link(mpi, direct, reduce_gbs * 1e9)

        def rows(key: str, where: dict, indent: int, note: Callable[[int, float], str]) -> list:
            peak = where["bandwidth_gbs"] * 1e9
            return [
                f"{' ' * indent}- [{size}, {frac:.4f}]  # [calibrate] {note(size, frac * peak)}"
                for size, frac in where[key]
            ]

        def sized(prefix: str) -> Callable[[int, float], str]:
            return lambda s, r: f"{prefix} at {_min_size(s)}: {r / 1e9:.2f} GB/s"

        lines += [
            "  intra:                # MPI between two ranks on this host (shared memory)",
            f"    bandwidth_gbs: {link['bandwidth_gbs']:.4f}  # [calibrate] best rate of the "
            "Sendrecv and reduce exchanges over the sweep, per direction (Sendrecv fit: "
            f"{1 / b_sr / 1e9:.2f}; ping-pong fit {1 / b_pp / 1e9:.2f} GB/s)",
            f"    latency_us: {link['latency_us']:.3f}  # [calibrate] Sendrecv fit; ping-pong "
            f"fit {a_pp * 1e6:.2f} us",
            "    efficiency: 1.0     # the rates are achieved rates",
            f"    reduce_gbs: {reduce_gbs:.3f}  # [calibrate] np.add in place: add rate / 3",
            f"    call_overhead_us: {link['call_overhead_us']:.3f}  # [calibrate] simdist's "
            "ring all-gather of 16 floats minus its bare Sendrecv steps",
            "    size_efficiency:     # [min message bytes, fraction of bandwidth] Sendrecv "
            "sweep, after the latency",
            *rows("size_efficiency", link, 6, sized("Sendrecv")),
        ]
        if "reducing_efficiency" in link:
            lines += [
                "    reducing_efficiency: # [min message bytes, fraction of bandwidth] p2p's "
                "reduce exchange (send, receive and add), after the latency",
                *rows("reducing_efficiency", link, 6, sized("reduce exchange")),
            ]
        if "gather_efficiency" in link:
            lines += [
                "    gather_efficiency:   # [min message bytes, fraction of bandwidth] the "
                "Sendrecv right after a reduce exchange (an all-reduce's second half), after "
                "the latency",
                *rows("gather_efficiency", link, 6, sized("Sendrecv after reduce")),
            ]
        if "direct" in link:
            d = link["direct"]
            lines += [
                "    direct:              # peer load/store in a shared-memory window (shm)",
                f"      bandwidth_gbs: {d['bandwidth_gbs']:.4f}  # [calibrate] best rate of the "
                "copies below",
                f"      latency_us: {d['latency_us']:.3f}  # [calibrate] per fence of simdist's "
                "shm reduce-scatter of 16 floats, less its addition (the fence alone: "
                f"{direct['fence'] * 1e6:.2f} us)",
                "      efficiency: 1.0",
                f"      reduce_gbs: {reduce_gbs:.3f}  # [calibrate] as the link's",
                "      size_efficiency:   # [min bytes, fraction of bandwidth] loads: the peer's "
                "freshly written block copied into this rank's segment",
                *rows("size_efficiency", d, 8, sized("load")),
                "      store_efficiency:  # [min bytes, fraction of bandwidth] stores: this "
                "rank's block copied into the peer's segment (the all-reduce's second half)",
                *rows("store_efficiency", d, 8, sized("store")),
                "      reducing_efficiency: # [min bytes, fraction of bandwidth] loads that add: "
                "the peer's block added into this rank's",
                *rows("reducing_efficiency", d, 8, sized("load and add")),
            ]
    elif prev_intra and prev_intra.get("bandwidth_gbs"):
        lines += [
            "  intra:                # kept from the previous calibration (this run was serial)",
            f"    bandwidth_gbs: {prev_intra['bandwidth_gbs']}  # [previous] Sendrecv fit",
            f"    latency_us: {prev_intra.get('latency_us')}  # [previous] Sendrecv fit",
            f"    efficiency: {prev_intra.get('efficiency', 1.0)}  # [previous]",
            f"    reduce_gbs: {reduce_gbs:.3f}  # [calibrate] np.add in place: add rate / 3",
        ]
    else:
        lines += [
            "  intra:                # not measured: run under `mpiexec -n 2` to fit α and β",
            "    bandwidth_gbs: null  # unknown",
            "    latency_us: null    # unknown",
            "    efficiency: null    # unknown",
        ]
    lines += [
        "  inter: null           # no inter-node network measured from one host",
        "  host:                 # the device is the host: staging is a memory copy",
        f"    bandwidth_gbs: {copy_peak / 2 / 1e9:.3f}  # [calibrate] copy rate / 2 (bytes "
        "copied per second)",
        f"    latency_us: {m['overhead'] * 1e6:.3f}  # [calibrate] call overhead",
        "    efficiency: 1.0     # measured rate",
        "streaming: null",
        "calibration:           # raw measurements (ignored by the profile loader)",
        f"  date: {now!r}",
        f"  command: {m['command']!r}",
        f"  loadavg: {m['loadavg']!r}",
        "  gemm_gflops: {" + ", ".join(f"{n}: {r / 1e9:.2f}" for n, r in gemm.items()) + "}",
        "  copy_gbs: {" + ", ".join(f"{s}: {r / 1e9:.2f}" for s, r in mem["copy"].items()) + "}",
        "  add_gbs: {" + ", ".join(f"{s}: {r / 1e9:.2f}" for s, r in mem["add"].items()) + "}",
        f"  large_array_bytes: {big}",
    ]
    if mpi:
        lines += [
            "  mpi_sizes: " + str(mpi["sizes"]),
            "  pingpong_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in mpi["pingpong"]) + "]",
            "  sendrecv_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in mpi["sendrecv"]) + "]",
            "  reduce_sizes: " + str(mpi["reduce_sizes"]),
            "  reduce_exchange_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in mpi["reduce"]) + "]",
        ]
        if mpi.get("gather"):
            lines.append(
                "  gather_after_reduce_us: ["
                + ", ".join(f"{t * 1e6:.2f}" for t in mpi["gather"])
                + "]"
            )
        direct = m.get("direct")
        if direct and direct["copy"]:
            lines += [
                "  direct_sizes: " + str(direct["sizes"]),
                "  direct_copy_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in direct["copy"]) + "]",
                "  direct_add_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in direct["add"]) + "]",
                "  direct_store_us: [" + ", ".join(f"{t * 1e6:.2f}" for t in direct["store"]) + "]",
                f"  direct_fence_us: {direct['fence'] * 1e6:.2f}",
            ]
    elif prev_intra and prev_intra.get("bandwidth_gbs"):
        prev_date = ((previous or {}).get("calibration") or {}).get("date", "unknown date")
        lines.append(f"  link_source: 'kept from the calibration of {prev_date}'")
    else:
        lines.append("  link_source: 'not measured (serial run, no previous profile)'")
    return "\n".join(lines) + "\n"


__all__ = ["render"]
