"""MPI check: copies between ranks on different nodes go in pipelined pieces, same bits.

    mpiexec -n 4 python -m mpi4py tests/mpi/check_segments.py

``p2p.Exchanger.place`` tells an exchanger which node each rank runs on; a copy between
two nodes is then cut into pieces of ``segment`` elements, ``depth`` in flight (one large
message each way over TCP is not reliably full duplex; see p2p's docstring), a copy inside a
node stays one Sendrecv. Checked here, on virtual node tables (``Placement``) over this
machine's ranks:

- pieces: what arrives is what was sent, for every mix of lengths (empty, shorter and
  longer than a piece, unequal each way), segment and depth, with one end of a ring step on
  another node and the other on this one; how many messages were posted (one Sendrecv
  inside a node, ceil(L / segment) pieces each way across);
- algorithms: ring, rhd and hierarchical give the same bits whatever the node table and
  the pieces: the documented summation order, all-reduce == reduce-scatter + all-gather
  over the same bounds (default and uneven), average included, at the real 1 MiB segment
  too (buffers of 8 MiB).

Each rank prints its failures; exit 1 if any rank saw one.
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per rank before numpy loads)

# isort: split
import sys
import time
from typing import Any

import numpy as np
from checks import Tally, rhd_order, ring_order  # tests/mpi/checks.py, beside this script
from mpi4py import MPI

from simdist.comm import Collectives, partition
from simdist.comm.algorithm import Algorithm
from simdist.comm.hierarchical import Hierarchical
from simdist.comm.p2p import Exchanger
from simdist.comm.rhd import RecursiveHalvingDoubling
from simdist.comm.ring import Ring
from simdist.comm.topology import Placement
from simdist.comm.world import world

COMM = world()
RANK, P = COMM.Get_rank(), COMM.Get_size()
TALLY = Tally(RANK, P)
expect, same = TALLY.expect, TALLY.same


class Counting:
    """A communicator stand-in that counts the point-to-point calls an exchanger makes."""

    def __init__(self, comm: MPI.Comm):
        self._comm = comm
        self.counts = {"Sendrecv": 0, "Send": 0, "Recv": 0, "Isend": 0, "Irecv": 0}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if name in self.counts:

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.counts[name] += 1
                return attr(*args, **kwargs)

            return counted
        return attr


def tables() -> list[tuple[str, Placement]]:
    """Node tables: one node; every rank its own node; two nodes, first half and rest."""
    out = [
        ("1 node", Placement(RANK, (0,) * P)),
        (f"{P} nodes", Placement(RANK, tuple(range(P)))),
    ]
    if P >= 3:
        k = (P + 1) // 2
        halves = Placement(RANK, tuple(r // k for r in range(P)))
        out.append((f"2 nodes of {k} and {P - k}", halves))
    return out


def values(r: int, n: int, salt: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7 + 1000 * r + salt).astype(np.float32)


# ---------------------------------------------------------------- pieces


def check_pieces() -> None:
    right, left = (RANK + 1) % P, (RANK - 1) % P
    lengths = [(0, 10), (10, 0), (1, 1), (10, 10), (9, 20), (20, 9), (12, 12), (13, 0)]
    for label, place in tables():
        node = place.node_of
        for segment, depth in ((1, 1), (3, 2), (4, 3), (64, 2)):
            for base, step in lengths:
                # rank r sends base + step * r elements to its right neighbour
                n_of = [base + step * r for r in range(P)]
                dup = COMM.Dup()
                counting = Counting(dup)
                x = Exchanger(counting, segment=segment, depth=depth)  # type: ignore[arg-type]
                x.place(place.node_of)
                send = values(RANK, n_of[RANK], segment)
                recv = np.full(n_of[left], -1.0, dtype=np.float32)
                x.copy(send, right, recv, left)
                tag = f"{label}, segment {segment}, depth {depth}, lengths {n_of}"
                same(recv, values(left, n_of[left], segment), f"copy arrives whole: {tag}")
                expect(x.bytes_sent == 4 * n_of[RANK], f"bytes_sent {x.bytes_sent}: {tag}")
                ns, nr = n_of[RANK], n_of[left]
                cut_s = node[right] != node[RANK] and ns > segment
                cut_r = node[left] != node[RANK] and nr > segment
                c = counting.counts
                if cut_s or cut_r:
                    pieces_s = -(-ns // (segment if node[right] != node[RANK] else max(ns, 1)))
                    pieces_r = -(-nr // (segment if node[left] != node[RANK] else max(nr, 1)))
                    ok = c["Isend"] == pieces_s and c["Irecv"] == pieces_r and not c["Sendrecv"]
                    expect(ok, f"pipelined pieces {c} != {pieces_s} out, {pieces_r} in: {tag}")
                else:
                    msgs = c["Sendrecv"] + c["Send"] + c["Recv"]
                    ok = msgs == int(ns > 0 or nr > 0) and not (c["Isend"] or c["Irecv"])
                    expect(ok, f"one message when nothing is cut, got {c}: {tag}")
                dup.Free()
    err = None
    try:
        Exchanger(COMM).place((0,) * (P + 1))
    except ValueError as e:
        err = e
    expect(err is not None and "entries" in str(err), f"wrong table length: {err}")


# ---------------------------------------------------------------- algorithms


def uneven(n: int) -> np.ndarray:
    w = np.array([(r % 3) + (r == 1) for r in range(P)], dtype=np.int64)
    b = np.concatenate([[0], n * np.cumsum(w) // w.sum()]).astype(np.int64)
    b[-1] = n
    return b


def run_algorithm(impl: Algorithm, xs: list[np.ndarray], b: np.ndarray, tag: str) -> None:
    bounds = b.tolist()
    for average in (False, True):
        want = ring_order(xs, b) if impl.name == "ring" else rhd_order(xs)
        if average:
            want = want / np.float32(P)
        t = f"{tag} average={average}"
        a = xs[RANK].copy()
        impl.allreduce(a, bounds, average)
        same(a, want, f"allreduce, documented order: {t}")
        c = xs[RANK].copy()
        impl.reduce_scatter(c, bounds)
        if average:
            mine = c[bounds[RANK] : bounds[RANK + 1]]
            np.divide(mine, np.float32(P), out=mine)
        impl.allgather(c, bounds)
        same(c, a, f"allreduce == reduce_scatter + allgather: {t}")


def check_algorithms() -> None:
    # (length, segment, depth): many pieces on short buffers (each piece is a message)
    cases = [(P + 1, 1, 1), (P + 1, 2, 2), (1000, 7, 2), (1000, 33, 3), (4099, 128, 2)]
    for n, segment, depth in cases:
        xs = [np.random.default_rng(50 + r).standard_normal(n).astype(np.float32) for r in range(P)]
        for bname, b in (("default", partition(n, P)), ("uneven", uneven(n))):
            for cls in (Ring, RecursiveHalvingDoubling):
                for label, place in tables():
                    dup = COMM.Dup()
                    impl = cls(dup, Exchanger(dup, segment, depth), place)
                    tag = f"{cls.name} n={n} {bname} bounds, {label}, segment {segment}x{depth}"
                    run_algorithm(impl, xs, b, tag)
                    impl.free()
                    dup.Free()


def check_real_segments() -> None:
    """Blocks larger than the real 1 MiB segment: Collectives with a node table vs none."""
    n = 2**21 + 3
    xs = [np.random.default_rng(90 + r).standard_normal(n).astype(np.float32) for r in range(P)]
    b = partition(n, P)
    one = Collectives(COMM)
    many = Collectives(COMM, placement=Placement(RANK, tuple(range(P))))
    for alg in ("ring", "rhd"):
        a = xs[RANK].copy()
        one.allreduce(a, algorithm=alg)
        c = xs[RANK].copy()
        many.allreduce(c, algorithm=alg)
        same(c, a, f"{alg}, 8 MiB: nodes apart == one node, bit for bit")
        same(c, ring_order(xs, b) if alg == "ring" else rhd_order(xs), f"{alg}, 8 MiB: order")
        d = xs[RANK].copy()
        many.reduce_scatter(d, algorithm=alg)
        many.allgather(d, algorithm=alg)
        same(d, c, f"{alg}, 8 MiB, nodes apart: allreduce == reduce_scatter + allgather")
    if P % 2 == 0 and P >= 2:  # hierarchical: cross-node blocks above one segment
        grid = Placement.blocks(RANK, P, P // 2)
        h = Collectives(COMM, algorithm="hierarchical", placement=grid)
        a = xs[RANK].copy()
        h.allreduce(a)
        c = xs[RANK].copy()
        h.reduce_scatter(c)
        h.allgather(c)
        same(c, a, "hierarchical, 8 MiB, 2 nodes: allreduce == reduce_scatter + allgather")
        impl = h._impl("hierarchical")
        assert isinstance(impl, Hierarchical)
        expect(impl.inter.p2p._node_of is not None, "hierarchical: cross exchanger is placed")
        h.free()
    one.free()
    many.free()


def main() -> int:
    t0 = time.perf_counter()
    if P >= 2:
        check_pieces()
        check_algorithms()
        check_real_segments()
    total = COMM.allreduce(TALLY.failures)
    if RANK == 0:
        print(
            f"check_segments np={P}: {TALLY.checks} checks per rank, {total} failures in all, "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
