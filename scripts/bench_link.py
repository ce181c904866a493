#!/usr/bin/env python3
"""All-reduce bus bandwidth across rate-limited links, against the link rate.

    python scripts/bench_link.py [--hosts 2] [--ranks-per-host 1] [--rate 1gbit] \\
        [--mpi mpich|openmpi] [--sizes 1,4,16] [--iters 5] [--json F]
    python scripts/bench_link.py --collectives [--hosts 2] [--ranks-per-host 2] \\
        [--rate 1gbit] [--min 1M] [--max 64M] [--algorithms ring,rhd,native] [--json F]

Both run under scripts/multihost.py (root, network namespaces) and check that the bytes
crossed the links.

Default mode: float32 MPI_Allreduce(SUM) on preallocated buffers, one warm-up plus
--iters timed calls per size, time per call = slowest rank, median over calls.

--collectives: scripts/bench_collectives.py (every algorithm in ``simdist.comm.ALGORITHMS``
that the placement can run: ring, rhd, hierarchical and MPI's native one; shm, which needs
one node, is left out with a note) with ``--ops allreduce`` from --min to --max, as that
script measures and reports it.

Both print the CPU's model and ISA extensions and record them (all flags) in --json.

Bus bandwidth follows nccl-tests: bytes * 2(p-1)/p / time. For a flat ring it is what each
rank's link must carry per second, so "of link" = busbw / link rate, with 100% the
physical limit. With several ranks per host an algorithm's placement decides how much
really crosses a host's link, so --collectives also prints each algorithm's ceiling: the
busbw at which its busiest link direction would run exactly at the link rate, from the
messages it sends (ring: 100%; rhd at 2 hosts x 2 ranks: 75%, it sends 2n each way where
the ring sends 1.5n). Node-aware algorithms can exceed 100%: they need only n each way
at 2 hosts (150%); simdist's hierarchical all-reduce is one, and so is MPICH 5.0.2's
native all-reduce (measured with the link counters: n each way per call at 2 hosts x 2
ranks).
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

from simdist.hostcpu import cpu_info

HERE = Path(__file__).resolve().parent


def cpu_line(cpu: dict) -> str:
    """One printable line: model and the ISA extensions of note."""
    return f"CPU: {cpu['model']}; ISA: {' '.join(cpu['isa']) or 'unknown'}"


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


def size_bytes(text: str) -> int:
    """'64M' -> 64 MiB, as bench_collectives.py reads --max (not imported: it starts MPI)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text.strip()[-1:].upper(), 1)
    return int(float(text.strip().rstrip("kKmMgG")) * scale)


def host_traffic(algorithm: str, hosts: int, ranks_per_host: int, nbytes: int) -> int | None:
    """Bytes over the busiest host link direction in one all-reduce of ``nbytes``.

    From the messages simdist's ring and rhd send (see their module docstrings), with ranks
    placed host by host as the harness's hostfile does. None where not modelled (native,
    rhd at a world size that is not a power of two).
    """
    p = hosts * ranks_per_host
    msgs: list[tuple[int, int, float]] = []  # (from, to, bytes)
    if algorithm == "hierarchical":  # each host's L cross rings: 2 (N-1)/N of n/L each way
        return int(2 * (hosts - 1) / hosts * nbytes) if hosts > 1 else 0
    if algorithm == "ring":
        # 2(p-1) steps, each rank sends one block of n/p to its right neighbour.
        msgs = [(r, (r + 1) % p, 2 * (p - 1) * nbytes / p) for r in range(p)]
    elif algorithm == "rhd" and p & (p - 1) == 0:
        mask = p // 2
        while mask:  # halving and its mirror, doubling: n * mask / p each way, twice
            msgs += [(r, r ^ mask, 2 * nbytes * mask / p) for r in range(p)]
            mask //= 2
    else:
        return None
    tx, rx = [0.0] * hosts, [0.0] * hosts
    for src, dst, size in msgs:
        a, b = src // ranks_per_host, dst // ranks_per_host
        if a != b:
            tx[a] += size
            rx[b] += size
    return int(max(*tx, *rx))


def run_harness(args: argparse.Namespace, program: list[str], extra: list[str]) -> tuple:
    """Run ``program`` under multihost.py; (CompletedProcess, report dict or None)."""
    with tempfile.TemporaryDirectory(prefix="bench_link-") as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [
            sys.executable, str(HERE / "multihost.py"), "--hosts", str(args.hosts),
            "--ranks-per-host", str(args.ranks_per_host), "--rate", args.rate, "--mpi", args.mpi,
            "--json", str(report_path), "--timeout", str(args.timeout), *extra, "--", *program,
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
        report = json.loads(report_path.read_text()) if report_path.exists() else None
    return run, report


def collectives(args: argparse.Namespace) -> int:
    """--collectives: bench_collectives.py's all-reduce across the hosts, against the link."""
    with tempfile.TemporaryDirectory(prefix="bench_link-") as tmp:
        # Under /tmp, which rank 0's mount namespace shares with this process (the harness
        # only gives each host its own /dev/shm).
        out = Path(tmp) / "collectives.json"
        program = [
            args.python, str(HERE / "bench_collectives.py"), "--json", str(out),
            "--ops", "allreduce", "--min", args.min, "--max", args.max,
        ]  # fmt: skip
        if args.algorithms:
            program += ["--algorithms", args.algorithms]
        # Every host must at least receive the other hosts' share of the largest buffer
        # once; far less means the traffic went around the link.
        need = 2 * size_bytes(args.max)
        run, report = run_harness(args, program, ["--require-bytes", str(need)])
        if run.returncode != 0 or report is None or not out.exists():
            sys.stderr.write(run.stdout + run.stderr)
            return run.returncode or 1
        result = json.loads(out.read_text())

    link_Bps = report["rate_bits"] / 8
    p = args.hosts * args.ranks_per_host
    factor = 2 * (p - 1) / p
    rows = []
    for r in result["rows"]:
        if r["op"] != "allreduce":
            continue
        # From the time: busbw_gbps is rounded to 1 MB/s, 1% of this link.
        busbw = factor * r["bytes"] / (r["time_us"] * 1e-6)
        cross = host_traffic(r["algorithm"], args.hosts, args.ranks_per_host, r["bytes"])
        rows.append(
            {
                **r,
                "busbw_Bps": busbw,
                "of_link": busbw / link_Bps,
                "ceiling": None if cross is None else factor * r["bytes"] / cross,
            }
        )
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    cpu = result["machine"].get("cpu") or cpu_info()
    print(
        f"{args.hosts} hosts x {args.ranks_per_host} ranks, {args.mpi}, link {args.rate} "
        f"({link_Bps / 1e6:.0f} MB/s per direction); simdist all-reduce "
        f"({', '.join(algorithms)}), bench_collectives medians"
    )
    print(cpu_line(cpu))
    for name, why in result.get("skipped", {}).items():
        print(f"skipped {name}: {why}")
    print("of link = busbw / link rate; ceiling = the same ratio with the busiest link")
    print("direction saturated, from the algorithm's messages (- = not modelled);")
    print("link use = of link / ceiling: how busy the algorithm keeps its busiest link")
    print(
        f"{'size':>9}  {'algorithm':<13}{'time/op':>10} {'busbw MB/s':>11} {'of link':>8} "
        f"{'ceiling':>8} {'link use':>9}"
    )
    best: dict[int, dict] = {}
    for r in rows:
        ceiling = "-" if r["ceiling"] is None else f"{r['ceiling']:.0%}"
        use = "-" if r["ceiling"] is None else f"{r['of_link'] / r['ceiling']:.0%}"
        print(
            f"{r['bytes'] / 2**20:5.0f} MiB  {r['algorithm']:<13}{r['time_us'] / 1e3:7.1f} ms "
            f"{r['busbw_Bps'] / 1e6:11.1f} {r['of_link']:8.0%} {ceiling:>8} {use:>9}"
        )
        if r["bytes"] not in best or r["busbw_Bps"] > best[r["bytes"]]["busbw_Bps"]:
            best[r["bytes"]] = r
    print(
        "best per size: "
        + ", ".join(
            f"{n / 2**20:.0f} MiB {r['algorithm']} {r['of_link']:.0%}" for n, r in best.items()
        )
    )
    worst = min((r["of_link"] for n, r in best.items() if n >= 2**20), default=0.0)
    verdict = "meets" if worst >= args.target else "misses"
    print(
        f"best algorithm >= {args.target:.0%} of the link at every size >= 1 MiB: "
        f"{verdict} (lowest {worst:.0%})"
    )
    total = report["total_bytes"]
    load = [round(result["machine"][k][0], 1) for k in ("loadavg", "loadavg_end")]
    print(
        f"{total / 2**20:.1f} MiB crossed the links in {report['program_seconds']:.1f} s; "
        f"1-min load average {load[0]} at start, {load[1]} at end"
    )
    if args.json:
        summary = {
            "link": report,
            "rows": rows,
            "machine": result["machine"],
            "cpu": cpu,
            "skipped": result.get("skipped", {}),
        }
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, help="default: 1, with --collectives 2")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--mpi", choices=("mpich", "openmpi"), default="mpich")
    ap.add_argument("--python", default=sys.executable, help="python of the ranks")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the MPI job")
    ap.add_argument("--sizes", default="1,4,16", help="MiB, comma separated (>= 1 MiB)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--collectives", action="store_true", help="simdist's all-reduce (bench_collectives.py)"
    )
    ap.add_argument("--min", default="1M", help="--collectives: smallest buffer")
    ap.add_argument("--max", default="64M", help="--collectives: largest buffer")
    ap.add_argument("--algorithms", help="--collectives: subset (default: all registered)")
    ap.add_argument("--target", type=float, default=0.85, help="--collectives: busbw/link goal")
    ap.add_argument("--json", type=Path, help="write rows, link report and CPU here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ranks_per_host is None:
        args.ranks_per_host = 2 if args.collectives else 1
    if args.collectives:
        return collectives(args)
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.iters)
        return 0

    program = [args.python, str(HERE / "bench_link.py"), "--worker", "--sizes", args.sizes,
               "--iters", str(args.iters)]  # fmt: skip
    run, report = run_harness(args, program, [])
    if run.returncode != 0 or report is None:
        sys.stderr.write(run.stdout + run.stderr)
        return run.returncode or 1
    rows = [json.loads(ln[6:]) for ln in run.stdout.splitlines() if ln.startswith("BENCH ")]
    link_Bps = report["rate_bits"] / 8
    cpu = cpu_info()  # the namespaced hosts share this machine's CPU
    print(f"{args.hosts} hosts x {args.ranks_per_host} ranks, {args.mpi}, link {args.rate} "
          f"({link_Bps / 1e6:.0f} MB/s per direction), median of {args.iters}")  # fmt: skip
    print(cpu_line(cpu))
    print(f"{'size':>9} {'time/op':>10} {'busbw MB/s':>11} {'of link':>8}")
    for r in rows:
        print(f"{r['bytes'] / 2**20:7.0f} MiB {r['seconds'] * 1e3:8.1f} ms "
              f"{r['busbw_Bps'] / 1e6:11.1f} {r['busbw_Bps'] / link_Bps:8.0%}")  # fmt: skip
    total = report["total_bytes"]
    print(f"{total / 2**20:.1f} MiB crossed the links in {report['program_seconds']:.1f} s")
    if args.json:
        args.json.write_text(
            json.dumps({"link": report, "rows": rows, "cpu": cpu}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
