#!/usr/bin/env python3
"""Flat MPI Allreduce bus bandwidth across a rate-limited link, against the link rate.

    python scripts/bench_link.py [--hosts 2] [--ranks-per-host 1] [--rate 1gbit] \\
        [--mpi mpich|openmpi] [--sizes 1,4,16] [--iters 5]

Runs itself as the MPI program under scripts/multihost.py (root, network namespaces):
float32 MPI_Allreduce(SUM) on preallocated buffers, one warm-up plus --iters timed calls
per size, time per call = slowest rank, median over calls. Bus bandwidth follows
nccl-tests: bytes * 2(p-1)/p / time, which for a bandwidth-optimal algorithm is what each
rank's link has to carry per second, so it compares directly with the tbf rate. That
holds for one rank per host; with several, part of the traffic stays inside a host and
"of link" overstates the link's share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(sizes_mib: list[float], iters: int) -> None:
    """The MPI side: one ``BENCH {json}`` line per size from rank 0."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    for mib in sizes_mib:
        n = int(mib * 2**20) // 4
        send = np.ones(n, np.float32)
        recv = np.empty_like(send)
        times = []
        for i in range(iters + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(send, recv, op=MPI.SUM)
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i:  # the first call sets up connections and buffers
                times.append(dt)
        if recv[0] != p or recv[-1] != p:
            raise RuntimeError(f"Allreduce wrong: {recv[0]}, expected {p}")
        if comm.Get_rank() == 0:
            t = statistics.median(times)
            busbw = send.nbytes * 2 * (p - 1) / p / t
            row = {"bytes": send.nbytes, "ranks": p, "seconds": t, "busbw_Bps": busbw}
            print("BENCH " + json.dumps(row), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--mpi", choices=("mpich", "openmpi"), default="mpich")
    ap.add_argument("--python", default=sys.executable, help="python of the ranks")
    ap.add_argument("--sizes", default="1,4,16", help="MiB, comma separated (>= 1 MiB)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.iters)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [
            sys.executable, str(HERE / "multihost.py"), "--hosts", str(args.hosts),
            "--ranks-per-host", str(args.ranks_per_host), "--rate", args.rate, "--mpi", args.mpi,
            "--json", str(report_path), "--",
            args.python, str(HERE / "bench_link.py"), "--worker", "--sizes", args.sizes,
            "--iters", str(args.iters),
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or not report_path.exists():
            sys.stderr.write(run.stdout + run.stderr)
            return run.returncode or 1
        report = json.loads(report_path.read_text())
    rows = [json.loads(ln[6:]) for ln in run.stdout.splitlines() if ln.startswith("BENCH ")]
    link_Bps = report["rate_bits"] / 8
    print(f"{args.hosts} hosts x {args.ranks_per_host} ranks, {args.mpi}, link {args.rate} "
          f"({link_Bps / 1e6:.0f} MB/s per direction), median of {args.iters}")  # fmt: skip
    print(f"{'size':>9} {'time/op':>10} {'busbw MB/s':>11} {'of link':>8}")
    for r in rows:
        print(f"{r['bytes'] / 2**20:7.0f} MiB {r['seconds'] * 1e3:8.1f} ms "
              f"{r['busbw_Bps'] / 1e6:11.1f} {r['busbw_Bps'] / link_Bps:8.0%}")  # fmt: skip
    total = report["total_bytes"]
    print(f"{total / 2**20:.1f} MiB crossed the links in {report['program_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
