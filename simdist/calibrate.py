"""Measure this machine and write the ``host`` device profile.

    python -m simdist.calibrate [--out simdist/device/profiles/host.yaml]
    mpiexec -n 2 python -m simdist.calibrate        # also measures the MPI link (α, β)

What is measured (one thread, as each simdist rank runs):

* GEMM: float32 ``kernels.blas.gemm`` (the kernels' call, on their library) for n = 64 … 1024,
  best of N; the best rate is the matrix peak and each size's fraction of it forms the size-keyed
  efficiency table (so the host profile's table, unlike the GPU ones, is fitted to
  whole-kernel times and is used with the roofline max). A second sweep times GEMMs with one
  small dimension s = 4 … 512 (a pipeline's micro-batch of a few rows included; the other
  two 512) for each axis (m, k, n) and each layout the kernels use (a @ b, a @ b.T,
  a.T @ b): ``matrix_shape_efficiency``, used for the models' GEMMs, whose shapes are known
  (32 rows run at about half the rate of 32 inner dimensions).
* Elementwise: a numba degree-8 polynomial per element on a cache-resident array (the SIMD
  peak, ``vector_tflops``) and the Python-to-kernel call overhead (``kernel_launch_us``,
  added per call: ``launch_mode: serial``); reductions, a chain of dependent adds per lane
  (``scalar_tflops``): ``rowops.row_sum`` for fp32, the gradient norm's float64
  ``sum_of_squares`` for fp64.
* Memory: ``np.copyto`` and ``np.add`` from cache-sized to 64 MiB arrays, bytes read plus
  written per second; the best rate is the bandwidth, each size's fraction its efficiency.
  AdamW's update (``kernels.optim.adamw_update``) over four arrays of each size is its own
  table, ``optimizer_efficiency``: reading four streams and writing three, it ran 1.4-1.5x
  the copy rate on a Xeon, and it is most of a small model's step outside the GEMMs.
* MPI (only under ``mpiexec -n 2``): ping-pong (one-way = half the round trip, in a loop)
  and bidirectional ``Sendrecv`` sweeps from 8 B to 16 MiB, best of N per size, then α and β
  by least squares on t = α + n·β weighted by 1/t (relative error, so the small messages pin
  α and the large ones β). Each Sendrecv is timed as a collective's step runs: its send
  buffer just written, both ranks starting together, the slower rank's time, the messages
  slices of one large buffer (as blocks are of the gradient buffer). The Sendrecv fit is the
  ``intra`` link, because simdist's ring and halving-doubling steps are Sendrecv exchanges.
  Run serially, the previous profile's link figures are kept (or left null if there is
  none) and the file says so. The sweep's rates after the latency become the link's
  ``size_efficiency`` table. p2p's pipelined reduce exchange (``Exchanger.reduce``, a ring
  reduce-scatter's step) is timed at the same sizes as a whole: ``reducing_efficiency``
  (its addition partly overlaps the transfer, and its 1 MiB segments can beat one plain
  Sendrecv; the schedule model reads both tables at each message's size). The Sendrecv
  right after an untimed reduce exchange on the same blocks, as an all-reduce runs its
  second half: ``gather_efficiency`` (the cache state the first half leaves sets its rate:
  5-17 % slower than the plain Sendrecv at 32 KiB-16 MiB on an AMD EPYC, Zen 3; the raw
  times of both are kept under ``calibration``).
* Shared memory (only under ``mpiexec -n 2``): in a buffer of simdist's shm algorithm,
  copying the peer's freshly written block into this rank's, adding it into this rank's
  block, and storing this rank's block into the peer's, 128 KiB to 8 MiB, and the latency
  per fence of simdist's own shm reduce-scatter of 16 floats (fence plus the call's
  Python, less its addition): the ``intra`` link's ``direct`` figures, which cost the "shm"
  collectives.
* The probes (``LinkProbe``) run in rounds over all sizes, best per size. On a virtual
  machine the link's rates change with the pages under a buffer (transparent huge pages or
  4 KiB ones) and with the neighbours' load; ``scripts/validate_sim.py --calibrate`` runs
  the same probes on each collective's own buffer, between its calls.

This module is the command (and keeps the names above importable); the measuring code is in
``simdist.calibration``: ``compute`` (GEMM, vector, scalar, memory sweeps), ``link`` (the
probes and their fits) and ``render`` (the YAML).

Shared machines are noisy (research/simulators.md saw 10x swings in BLAS throughput): the
1-minute load average is recorded and a warning printed when it exceeds the core count.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
from pathlib import Path
from typing import Any

import yaml

from simdist.calibration.compute import (
    SHAPE_BIG,
    best_time,
    measure_gemm,
    measure_gemm_shapes,
    measure_memory,
    measure_scalar,
    measure_vector,
)
from simdist.calibration.link import (
    DIRECT_MODES,
    DIRECT_SIZES,
    MESSAGE_SIZES,
    REDUCE_SIZES,
    LinkProbe,
    direct_link,
    fit_alpha_beta,
    intra_link,
    measure_link,
    message_rates,
    mpi_link,
    mpi_results,
)
from simdist.calibration.render import _mem_total, render
from simdist.device.profile import PROFILE_DIR
from simdist.hostcpu import cpu_identity

DEFAULT_OUT = PROFILE_DIR / "host.yaml"


def _blas_library() -> str:
    """The kernels' BLAS (``kernels.blas.library``), imported late: ``--help`` loads no numba."""
    from simdist.kernels.blas import library

    return library()


def _compute_section(text: str) -> str:
    """The ``compute:`` block of a profile's text (up to the ``memory:`` line)."""
    start = text.index("\ncompute:\n") + 1
    return text[start : text.index("\nmemory:\n", start) + 1]


def _mpi_comm() -> Any | None:
    """The world communicator when launched by mpiexec with >= 2 ranks, else None."""
    launched = any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
    if not launched:
        return None
    from simdist.comm.world import world  # simdist.comm owns the mpi4py import

    comm = world()
    return comm if comm.Get_size() >= 2 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        # how README runs it: under mpiexec it also measures the MPI link
        prog="python -m simdist.calibrate",
        usage="%(prog)s [options]\n       mpiexec -n 2 %(prog)s [options]  (also the MPI link)",
        description="Measure this machine and write the host device profile. Under "
        "`mpiexec -n 2` it also measures the MPI link and shared memory; run serially, the "
        "previous profile's link figures are kept.",
    )
    ap.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        metavar="YAML",
        help="profile YAML to write (default: the packaged host profile, "
        f"{DEFAULT_OUT.relative_to(DEFAULT_OUT.parents[3])}, which it OVERWRITES: "
        "every run with --profile host then uses this machine's figures)",
    )
    ap.add_argument("--repeats", type=int, default=5, help="best-of-N samples per point")
    ap.add_argument("--rounds", type=int, default=3, help="sweeps over all sizes (best kept)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds (for tests)")
    ap.add_argument(
        "--link-only",
        metavar="BASE",
        help="re-measure only the links and memory (seconds, under mpiexec -n 2) and keep the "
        "compute section of the profile BASE (a name or YAML)",
    )
    args = ap.parse_args(argv)

    comm = _mpi_comm()
    base_compute = None
    if args.link_only:
        if comm is None:
            raise SystemExit("--link-only measures the MPI link: run under `mpiexec -n 2`")
        from simdist.device.profile import ProfileError, load_profile, profile_path

        try:  # a clear error before any measuring
            base = profile_path(args.link_only)
            load_profile(base)
        except ProfileError as err:
            raise SystemExit(f"--link-only: {err}") from None
        base_compute = _compute_section(base.read_text())
    rank = comm.Get_rank() if comm is not None else 0
    mpi, direct = measure_link(comm, args.repeats) if comm is not None else (None, None)
    if rank != 0:
        comm.Barrier()
        return 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cores = os.cpu_count() or 1
    if load > cores:
        print(f"warning: load average {load:.1f} exceeds {cores} cores; figures will be low")
    if args.quick:
        args.rounds = 1
    gemm_sizes = [64, 256] if args.quick else [64, 128, 256, 512, 1024]
    mem_sizes = [2**18, 2**24] if args.quick else [2**k for k in (18, 20, 21, 22, 23, 24, 25, 26)]
    # several rounds over all sizes, best per size: a burst of load from other processes
    # then spoils one round of one size instead of the whole point
    shape_sizes = [32, 128] if args.quick else [4, 8, 16, 32, 64, 128, 256, 512]
    gemm: dict[int, float] = {}
    shapes: dict[str, dict[str, dict[int, float]]] = {}
    memory: dict[str, dict[int, float]] = {"copy": {}, "add": {}, "adamw": {}}
    if base_compute is not None:  # compute comes from the base profile: skip its sweeps
        gemm_sizes, shape_sizes = [64], []
    for _ in range(args.rounds):
        for n, rate in measure_gemm(gemm_sizes, args.repeats).items():
            gemm[n] = max(gemm.get(n, 0.0), rate)
        for layout, axes in measure_gemm_shapes(shape_sizes, args.repeats).items():
            for axis, points in axes.items():
                best = shapes.setdefault(layout, {}).setdefault(axis, {})
                for n, rate in points.items():
                    best[n] = max(best.get(n, 0.0), rate)
        for kind, points in measure_memory(mem_sizes, args.repeats).items():
            for size, rate in points.items():
                memory[kind][size] = max(memory[kind].get(size, 0.0), rate)
    vector, overhead = measure_vector(args.repeats)
    scalar = measure_scalar(args.repeats)
    out = Path(args.out)
    previous = None
    if out.is_file():
        try:
            previous = yaml.safe_load(out.read_text())
        except yaml.YAMLError:
            previous = None
    cmd = "python -m simdist.calibrate " + " ".join(argv if argv is not None else sys.argv[1:])
    if comm is not None:
        cmd = f"mpiexec -n {comm.Get_size()} {cmd}"
    measured = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": cmd.strip(),
        "host": platform.node() or "unknown",
        "cpu": cpu_identity(),  # a run on another CPU says so (simdist.run)
        "cores": cores,
        "loadavg": f"{load:.2f}",
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", "(unset)"),
        "openblas_l2": os.environ.get("OPENBLAS_L2_SIZE", "(unset)"),
        "blas": _blas_library(),  # the GEMM rates are this library's
        "gemm": gemm,
        "gemm_shapes": shapes,
        "memory": memory,
        "vector_flops": vector,
        "scalar_flops": scalar,
        "overhead": overhead,
        "mem_total": _mem_total(),
        "mpi": mpi,
        "direct": direct,
    }
    text = render(measured, previous)
    if base_compute is not None:
        ours = _compute_section(text)
        text = text.replace(ours, base_compute)
        text = text.replace(
            "\nname: host\n",
            f"\n# --link-only: the compute section is {args.link_only}'s\nname: host\n",
            1,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(f"wrote {out}")
    if base_compute is not None:
        print(f"  compute kept from {args.link_only}")
    print(
        f"  GEMM {max(gemm.values()) / 1e9:.1f} GFLOP/s, memory "
        f"{max(max(v.values()) for v in memory.values()) / 1e9:.1f} GB/s, vector "
        f"{vector / 1e9:.1f} GFLOP/s, call overhead {overhead * 1e6:.2f} us"
    )
    if mpi:
        a, b = mpi["sendrecv_fit"]
        print(f"  MPI Sendrecv: alpha {a * 1e6:.2f} us, beta^-1 {1 / b / 1e9:.2f} GB/s")
    else:
        print("  MPI link not measured (serial run): kept previous figures or left null")
    if comm is not None:
        comm.Barrier()
    return 0


__all__ = [  # the measuring code lives in simdist.calibration; names kept importable here
    "DEFAULT_OUT",
    "DIRECT_MODES",
    "DIRECT_SIZES",
    "MESSAGE_SIZES",
    "REDUCE_SIZES",
    "SHAPE_BIG",
    "LinkProbe",
    "best_time",
    "direct_link",
    "fit_alpha_beta",
    "intra_link",
    "main",
    "measure_gemm",
    "measure_gemm_shapes",
    "measure_link",
    "measure_memory",
    "measure_scalar",
    "measure_vector",
    "message_rates",
    "mpi_link",
    "mpi_results",
    "render",
]


if __name__ == "__main__":
    sys.exit(main())
