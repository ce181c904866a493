"""Multi-host probe: hostnames, /dev/shm isolation and a checked float32 Allreduce.

Run under MPI (``python -m mpi4py tests/mpi/multihost_probe.py --mib 4``). Every rank
prints its hostname; rank 0 prints one ``PROBE {json}`` line for the test to read. Exits
non-zero (through an exception, which ``-m mpi4py`` turns into MPI_Abort) when the sum is
wrong, when the ranks see a different number of hosts than ``--expect-hosts``, or when a
rank can see another host's /dev/shm (then "hosts" share memory and traffic would bypass
the link).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, default=4.0, help="Allreduce size in MiB")
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--expect-hosts", type=int, default=0, help="0: do not check")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    host = socket.gethostname()
    print(f"rank {rank}/{size} on {host}", flush=True)

    # Each rank drops a marker in /dev/shm; it must see exactly the markers of its own host.
    tag = comm.bcast(f"sdprobe-{os.getpid()}-{time.time_ns()}" if rank == 0 else None)
    marker = f"/dev/shm/{tag}-{host}-{rank}"
    with open(marker, "w"):
        pass
    hosts = comm.allgather(host)
    comm.Barrier()
    seen = sorted(f for f in os.listdir("/dev/shm") if f.startswith(tag + "-"))
    mine = sorted(f"{tag}-{h}-{r}" for r, h in enumerate(hosts) if h == host)
    comm.Barrier()
    os.unlink(marker)
    if seen != mine:
        raise RuntimeError(f"rank {rank}: /dev/shm shows {seen}, expected only {mine}")
    if args.expect_hosts and len(set(hosts)) != args.expect_hosts:
        raise RuntimeError(f"{len(set(hosts))} distinct hosts, expected {args.expect_hosts}")

    n = int(args.mib * 2**20) // 4
    # Small integers keep every partial sum exact in float32, so the check is bitwise.
    base = (np.arange(n) % 251).astype(np.float32)
    send = base * np.float32(rank + 1)
    recv = np.empty_like(send)
    expected = base * np.float32(size * (size + 1) // 2)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        comm.Allreduce(send, recv, op=MPI.SUM)
    dt = (time.perf_counter() - t0) / args.iters
    if not np.array_equal(recv, expected):
        bad = int(np.count_nonzero(recv != expected))
        raise RuntimeError(f"rank {rank}: Allreduce wrong in {bad} of {n} elements")

    ok = comm.allreduce(1, op=MPI.SUM) == size
    if rank == 0:
        placement: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            placement.setdefault(h, []).append(r)
        summary = {
            "size": size,
            "hosts": placement,
            "bytes": send.nbytes,
            "iters": args.iters,
            "seconds_per_op": dt,
            # nccl-tests bus bandwidth for allreduce: 2(p-1)/p * bytes / time
            "busbw_gbs": 2 * (size - 1) / size * send.nbytes / dt / 1e9,
            "ok": ok,
            "library": MPI.Get_library_version().split("\n")[0].strip("\0 "),
        }
        print("PROBE " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
