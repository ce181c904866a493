"""Benchmark simdist's collectives against MPI's own (nccl-tests style bus bandwidth).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        mpiexec -n 2 python scripts/bench_collectives.py [--json FILE] \\
        [--ops allreduce,reduce_scatter,allgather] [--min 4K --max 64M] [--iters N]

For each op and size (x4 steps) every algorithm runs on the same float32 buffer of ``bytes``
bytes. Algorithms are interleaved in ``--rounds`` rounds (large sizes alternate call by call),
cycling through every order of the algorithms, so a burst of load from other processes on
this shared machine, and the cache state one algorithm leaves to the next, hit them alike.
Each timed call starts after a barrier; its time is the maximum over ranks; the table shows
the median over calls, with nccl-tests' definitions:
algbw = bytes / time; busbw = algbw * 2(n-1)/n for all-reduce and * (n-1)/n for
reduce-scatter and all-gather. Then, per op and size, the ratio of the best simdist algorithm's
busbw to native's, and their geometric mean over sizes >= 1 MiB. Timings are for reading,
never asserted anywhere.

One process runs all ops in turn, and state carries over: on MPICH 5.0.2 native all-gather
was seen several-fold slower after the 64 MiB calls of an earlier op than in a fresh process.
For the cleanest native figures run one op per process (``--ops allreduce``, and so on).

Algorithms the ranks' placement cannot run (``Algorithm.placement_error``: shm across
hosts, hierarchical with uneven nodes) are left out with a one-line note, in the JSON under
``skipped``. The CPU's model and ISA extensions are printed and recorded (``machine.cpu``).
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per rank before numpy loads)

# isort: split
import argparse
import itertools
import json
import math
import os
import platform
import sys
import time
from importlib import metadata

import numpy as np
from bench_link import cpu_line  # this directory (no MPI at import)

from simdist.comm import ALGORITHMS, Collectives
from simdist.comm.world import world
from simdist.hostcpu import cpu_info

OPS = ("allreduce", "reduce_scatter", "allgather")
MiB = 1 << 20


def parse_size(text: str) -> int:
    """'4K', '64M', '1G' or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def bus_factor(op: str, p: int) -> float:
    return 2 * (p - 1) / p if op == "allreduce" else (p - 1) / p


def default_iters(nbytes: int) -> int:
    """Enough calls for a stable median at ~0.1-0.3 s per algorithm and size."""
    return int(min(200, max(10, 32 * MiB // max(nbytes, 1))))


def machine_info() -> dict:
    info = {
        "loadavg": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": "unknown (threadpoolctl not installed)",
        "cpu": cpu_info(),
    }
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = "; ".join(
            f"{p.get('internal_api')} {p.get('version')} {p.get('architecture')} "
            f"threads={p.get('num_threads')}"
            for p in threadpool_info()
        )
    except ImportError:
        pass
    versions = []
    for dist in ("mpi4py", "mpich", "openmpi"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    info["mpi"] = ", ".join(versions) or "unknown"
    return info


def run_op(coll: Collectives, op: str, buf: np.ndarray, algorithm: str) -> None:
    if op == "allreduce":
        coll.allreduce(buf, algorithm=algorithm)
    elif op == "reduce_scatter":
        coll.reduce_scatter(buf, algorithm=algorithm)
    else:
        coll.allgather(buf, algorithm=algorithm)


def time_calls(coll: Collectives, op: str, buf: np.ndarray, algorithm: str, calls: int) -> list:
    """Per-call seconds on this rank, each call started right after a barrier."""
    out = []
    for _ in range(calls):
        coll.barrier(algorithm="native")
        t0 = time.perf_counter()
        run_op(coll, op, buf, algorithm)
        out.append(time.perf_counter() - t0)
    return out


def slowest_rank(coll: Collectives, local: list[float]) -> np.ndarray:
    """Per call, the maximum over ranks of that call's time.

    Each rank fills its own row of a zero table; the deterministic scalar sum then acts as a
    gather (x + 0 == x exactly), without importing MPI here.
    """
    table = np.zeros((coll.world, len(local)), dtype=np.float64)
    table[coll.rank] = local
    return coll.allreduce_scalars(table.ravel()).reshape(table.shape).max(axis=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write rows and summary to this file (rank 0)")
    ap.add_argument("--plots", help="write bench_collectives.png (+ .json) here (rank 0)")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + str(OPS))
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS), help="default: all")
    ap.add_argument("--min", default="4K", help="smallest buffer (bytes, K/M/G suffixes)")
    ap.add_argument("--max", default="64M", help="largest buffer")
    ap.add_argument("--iters", type=int, default=0, help="timed calls per point (0: by size)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per point")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds per point")
    args = ap.parse_args()

    comm = world()
    rank, p = comm.Get_rank(), comm.Get_size()
    ops = [o for o in args.ops.split(",") if o]
    algorithms = [a for a in args.algorithms.split(",") if a]
    for o in ops:
        if o not in OPS:
            ap.error(f"unknown op {o!r}; choose from {OPS}")
    for a in algorithms:
        if a not in ALGORITHMS:
            ap.error(f"unknown algorithm {a!r}; choose from {list(ALGORITHMS)}")
    sizes = []
    size = parse_size(args.min)
    while size <= parse_size(args.max):
        sizes.append(size)
        size *= 4
    coll = Collectives(comm)
    # Leave out, with a note, what this placement rules out (shm across hosts, hierarchical
    # on uneven nodes) instead of stopping at its first call.
    skipped = {}
    for a in algorithms:
        why = ALGORITHMS[a].placement_error(coll.placement)
        if why:
            skipped[a] = why
    algorithms = [a for a in algorithms if a not in skipped]
    orders = list(itertools.permutations(algorithms))

    info = machine_info()
    if rank == 0:
        print(f"# simdist collective benchmark, np={p}, load average {info['loadavg']}")
        print(f"# {cpu_line(info['cpu'])}")
        print(f"# BLAS: {info['blas']}")
        for a, why in skipped.items():
            print(f"# skipped {a}: {why.split('; ')[0]}")
        print(f"# MPI: {info['mpi']}; numpy {info['numpy']}; python {info['python']}")
        print(f"# rounds={args.rounds} warmup={args.warmup} iters={args.iters or 'by size'}")
        print(f"{'op':<15}{'algorithm':<10}{'np':>3}{'bytes':>11}{'time_us':>12}{'busbw_gbps':>12}")
        sys.stdout.flush()

    rows, ratios = [], []
    for op in ops:
        for nbytes in sizes:
            buf = np.empty(nbytes // 4, dtype=np.float32)
            buf.fill(0.0)  # zeros stay zeros under repeated sums; touching maps every page
            iters = args.iters or default_iters(nbytes)
            per_round = max(1, math.ceil(iters / args.rounds))
            times: dict[str, list[float]] = {a: [] for a in algorithms}
            for a in algorithms:
                for _ in range(args.warmup):
                    run_op(coll, op, buf, a)
            for i in range(args.rounds):
                # Cycle through every order: an algorithm inherits the cache state of the one
                # before it, so each should follow each other one equally often.
                for a in orders[i % len(orders)]:
                    times[a] += time_calls(coll, op, buf, a, per_round)
            best: dict[str, float] = {}
            for a in algorithms:
                t = float(np.median(slowest_rank(coll, times[a])))
                busbw = nbytes / t / 1e9 * bus_factor(op, p)
                best[a] = busbw
                row = {
                    "op": op,
                    "algorithm": a,
                    "np": p,
                    "bytes": nbytes,
                    "time_us": round(t * 1e6, 2),
                    "busbw_gbps": round(busbw, 3),
                }
                rows.append(row)
                if rank == 0:
                    print(
                        f"{op:<15}{a:<10}{p:>3}{nbytes:>11}{row['time_us']:>12.1f}"
                        f"{row['busbw_gbps']:>12.2f}",
                        flush=True,
                    )
            ours = {a: bw for a, bw in best.items() if a != "native"}
            if "native" in best and ours:
                top = max(ours, key=ours.get)
                ratios.append(
                    {
                        "op": op,
                        "np": p,
                        "bytes": nbytes,
                        "best_algorithm": top,
                        "ratio_vs_native": round(ours[top] / best["native"], 3),
                    }
                )

    summary = []
    for op in ops:
        big = [r["ratio_vs_native"] for r in ratios if r["op"] == op and r["bytes"] >= MiB]
        if big:
            summary.append(
                {
                    "op": op,
                    "np": p,
                    "geomean_ratio_ge_1MiB": round(math.exp(np.mean(np.log(big))), 3),
                    "min_ratio_ge_1MiB": min(big),
                }
            )
    if rank == 0:
        if ratios:
            print("\n# best simdist busbw / native busbw")
            print(f"{'op':<15}{'bytes':>11}  {'size':<8}{'best':<7}{'ratio':>7}")
            for r in ratios:
                print(
                    f"{r['op']:<15}{r['bytes']:>11}  {human(r['bytes']):<8}"
                    f"{r['best_algorithm']:<7}{r['ratio_vs_native']:>7.2f}"
                )
            for s in summary:
                print(
                    f"# {s['op']}: geometric mean over sizes >= 1 MiB "
                    f"{s['geomean_ratio_ge_1MiB']:.2f}x, minimum {s['min_ratio_ge_1MiB']:.2f}x"
                )
        print(f"# load average at end {list(os.getloadavg())}")
        info["loadavg_end"] = list(os.getloadavg())
        result = {
            "machine": info,
            "skipped": skipped,
            "rows": rows,
            "ratios": ratios,
            "summary": summary,
        }
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.plots:
            from bench_plots import write_plots  # scripts/bench_plots.py, beside this script

            write_plots(result, args.plots)
    coll.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
