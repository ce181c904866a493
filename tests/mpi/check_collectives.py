"""MPI check of simdist's collectives. Run under mpiexec (any number of ranks):

    mpiexec -n 4 python -m mpi4py tests/mpi/check_collectives.py

Covers every algorithm x op, each algorithm twice in a row (catches state left behind), over
lengths 0, 1, world-1, world+1, 1000 and 2**20+3. Inputs are small integers stored as float32,
so every sum is exact and results are compared bit for bit with NumPy. Random inputs then pin
down the documented summation orders of "ring" and "rhd" and check that all-reduce equals
reduce-scatter + all-gather bitwise. Check mode, and the default cheap check, must turn
mismatched calls into an error on every rank (``--uncaught-mismatch``: one mismatched call,
not caught, which must end the job instead of hanging). Each rank prints its failures; the
program exits 1 if any rank saw one (and ``python -m mpi4py`` turns an unexpected exception
into an abort of the whole job).
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per rank before numpy loads)

# isort: split
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from checks import Tally, rhd_order, ring_order  # tests/mpi/checks.py, beside this script
from simdist.kernels.optim import sum_of_squares

from simdist.comm import ALGORITHMS, CollectiveMismatchError, Collectives, partition
from simdist.comm.topology import Placement
from simdist.comm.world import world

COMM = world()
RANK, P = COMM.Get_rank(), COMM.Get_size()
ALGS = [*ALGORITHMS, "auto"]
LENGTHS = sorted({0, 1, P - 1, P + 1, 1000, 2**20 + 3})
TALLY = Tally(RANK, P)
expect, same = TALLY.expect, TALLY.same


def contribution(r: int, n: int) -> np.ndarray:
    """Rank r's integer-valued input; sums over ranks stay exact in float32."""
    i = np.arange(n, dtype=np.int64)
    return ((i * 5 + r * 3) % 11 - 5 + r).astype(np.float32)


_sums: dict[int, np.ndarray] = {}


def exact_sum(n: int) -> np.ndarray:
    if n not in _sums:
        total = np.zeros(n, dtype=np.float64)
        for r in range(P):
            total += contribution(r, n)
        _sums[n] = total.astype(np.float32)
    return _sums[n]


def exact_average(n: int) -> np.ndarray:
    return exact_sum(n) / np.float32(P)  # the definition: float32 sum, then true division


def pattern(n: int) -> np.ndarray:
    """Distinct, exactly representable values for copy-only collectives."""
    return (np.arange(n, dtype=np.int64) % 251).astype(np.float32) + np.float32(0.25)


def custom_bounds(n: int) -> np.ndarray:
    """Uneven blocks with weights r % 3: rank 0 (and 3) get empty blocks."""
    w = np.array([r % 3 for r in range(P)], dtype=np.int64)
    if w.sum() == 0:
        return np.array([0, n], dtype=np.int64)
    b = np.concatenate([[0], n * np.cumsum(w) // w.sum()]).astype(np.int64)
    b[-1] = n
    return b


def block(b: np.ndarray, r: int = RANK) -> slice:
    return slice(int(b[r]), int(b[r + 1]))


def is_block_view(view: np.ndarray, buf: np.ndarray, b: np.ndarray) -> bool:
    """``view`` is buf[b[RANK]:b[RANK+1]] itself, not a copy."""
    lo, hi = int(b[RANK]), int(b[RANK + 1])
    if view.size != hi - lo:
        return False
    return view.size == 0 or (
        view.ctypes.data - buf.ctypes.data == 4 * lo and view.base is not None
    )


# ---------------------------------------------------------------- exact results per op


def check_ops(coll: Collectives, alg: str, rep: int, n: int) -> None:
    tag = f"{alg} #{rep} n={n}"
    x = contribution(RANK, n)
    coll.allreduce(x, algorithm=alg)
    same(x, exact_sum(n), f"allreduce sum {tag}")

    x = contribution(RANK, n)
    partial = coll.allreduce(x, average=True, algorithm=alg, sumsq=True)
    same(x, exact_average(n), f"allreduce average {tag}")
    own = block(partition(n, P))
    expect(
        partial == (sum_of_squares(x[own]) if n else 0.0),
        f"allreduce sumsq is sum_of_squares of the own block {tag}: {partial}",
    )

    for name, b, avg in (
        ("default", partition(n, P), False),
        ("default", partition(n, P), True),
        ("custom", custom_bounds(n), False),
    ):
        x = contribution(RANK, n)
        given = None if name == "default" else b
        view = coll.reduce_scatter(x, bounds=given, average=avg, algorithm=alg)
        want = (exact_average(n) if avg else exact_sum(n))[block(b)]
        expect(is_block_view(view, x, b), f"reduce_scatter {name} returns its block view {tag}")
        same(np.array(view), want, f"reduce_scatter {name} bounds average={avg} {tag}")

    for name, b in (("default", partition(n, P)), ("custom", custom_bounds(n))):
        x = np.full(n, np.nan, dtype=np.float32)
        x[block(b)] = pattern(n)[block(b)]
        coll.allgather(x, bounds=None if name == "default" else b, algorithm=alg)
        same(x, pattern(n), f"allgather {name} bounds {tag}")

    for root in sorted({0, P - 1}):
        x = pattern(n) if RANK == root else np.full(n, np.nan, dtype=np.float32)
        coll.broadcast(x, root=root, algorithm=alg)
        same(x, pattern(n), f"broadcast root={root} {tag}")


def check_barrier(coll: Collectives, alg: str, rep: int, folder: str) -> None:
    """After the barrier every rank's marker file must exist, though the last rank is late."""
    if RANK == P - 1:
        time.sleep(0.05)
    open(os.path.join(folder, f"{alg}-{rep}-{RANK}"), "w").close()
    coll.barrier(algorithm=alg)
    missing = [r for r in range(P) if not os.path.exists(os.path.join(folder, f"{alg}-{rep}-{r}"))]
    expect(not missing, f"barrier {alg} #{rep}: returned before ranks {missing} arrived")


def check_scalars(coll: Collectives) -> None:
    """Rank-order summation: 1e16 + 1 - 1e16 style values make any other order visible."""
    mine = np.array([1e16 if RANK % 2 == 0 else 1.0, RANK + 0.1, -(RANK**3) * 1e-3], np.float64)
    want = None
    for r in range(P):
        v = np.array([1e16 if r % 2 == 0 else 1.0, r + 0.1, -(r**3) * 1e-3], np.float64)
        want = v.copy() if want is None else want + v
    got = coll.allreduce_scalars(mine)
    expect(got.dtype == np.float64 and np.array_equal(got, want), f"allreduce_scalars {got}")
    expect(mine[1] == RANK + 0.1, "allreduce_scalars must not modify its input")


# ---------------------------------------------------------------- bitwise determinism


def check_bitwise(coll: Collectives, alg: str, n: int) -> None:
    xs = [np.random.default_rng(1000 + r).standard_normal(n).astype(np.float32) for r in range(P)]
    b = partition(n, P)
    want = ring_order(xs, b) if alg == "ring" else rhd_order(xs)
    for average in (False, True):
        tag = f"{alg} n={n} average={average}"
        ref = want / np.float32(P) if average and P > 1 else want
        a = xs[RANK].copy()
        coll.allreduce(a, average=average, algorithm=alg)
        same(a, ref, f"allreduce follows the documented summation order, {tag}")
        c = xs[RANK].copy()
        coll.reduce_scatter(c, average=average, algorithm=alg)
        coll.allgather(c, algorithm=alg)
        same(c, a, f"allreduce == reduce_scatter + allgather bitwise, {tag}")
        a2 = xs[RANK].copy()
        coll.allreduce(a2, average=average, algorithm=alg)
        same(a2, a, f"allreduce repeats bit for bit, {tag}")


# ---------------------------------------------------------------- shared memory, registered


def shm_order(xs: list[np.ndarray], b: np.ndarray) -> np.ndarray:
    """Documented shm order: block q = (((x[q] + x[q+1]) + x[q+2]) + ...) + x[q-1]."""
    out = np.empty_like(xs[0])
    for q in range(P):
        s = block(b, q)
        acc = xs[q][s].copy()
        for k in range(1, P):
            acc += xs[(q + k) % P][s]
        out[s] = acc
    return out


def check_shm(coll: Collectives) -> None:
    """ "shm" and "auto" on buffers from Collectives.buffer (no staging), whole and as views
    at an offset (ZeRO-2's buckets); the summation order; sub-range reduce-scatter bits."""
    n_max = 2**20 + 3
    reg = coll.buffer(n_max + 40)
    expect(
        reg.dtype == np.float32 and reg.size == n_max + 40 and not reg.any(),
        "Collectives.buffer: zeroed float32 of the asked length",
    )
    expect(coll.registered(reg[7:100]) == coll.shared, "views of a buffer are registered")
    expect(not coll.registered(np.zeros(8, np.float32)), "a plain array is not registered")
    for alg in ("shm", "auto"):
        for off in (0, 37):
            for n in LENGTHS:
                x = reg[off : off + n]
                tag = f"registered {alg} off={off} n={n}"
                x[:] = contribution(RANK, n)
                partial = coll.allreduce(x, average=True, algorithm=alg, sumsq=True)
                same(x, exact_average(n), f"allreduce average {tag}")
                own = x[block(partition(n, P))]
                expect(partial == (sum_of_squares(own) if n else 0.0), f"sumsq {tag}")
                for name, b in (("default", partition(n, P)), ("custom", custom_bounds(n))):
                    x[:] = contribution(RANK, n)
                    given = None if name == "default" else b
                    view = coll.reduce_scatter(x, bounds=given, algorithm=alg)
                    same(np.array(view), exact_sum(n)[block(b)], f"reduce_scatter {name} {tag}")
                    x[:] = np.nan
                    x[block(b)] = pattern(n)[block(b)]
                    coll.allgather(x, bounds=given, algorithm=alg)
                    same(x, pattern(n), f"allgather {name} {tag}")
                x[:] = pattern(n) if RANK == P - 1 else np.nan
                coll.broadcast(x, root=P - 1, algorithm=alg)
                same(x, pattern(n), f"broadcast {tag}")
    if P > 1:
        big = 4 * (2**20 + 3)
        expect(
            coll.choose("allreduce", big, registered=True) == "shm",
            "auto picks shm for a large registered buffer on one node",
        )
    for n in (1, P + 1, 1000, 2**20 + 3):
        xs = [
            np.random.default_rng(1000 + r).standard_normal(n).astype(np.float32) for r in range(P)
        ]
        b = partition(n, P)
        want = shm_order(xs, b) / np.float32(P) if P > 1 else xs[0]
        x = reg[:n]
        for staged in (False, True):
            tag = f"shm n={n} {'staged' if staged else 'registered'}"
            a = xs[RANK].copy() if staged else x
            a[:] = xs[RANK]
            coll.allreduce(a, average=True, algorithm="shm")
            same(a, want, f"allreduce follows the documented summation order, {tag}")
        # a reduce-scatter of a sub-range over the cut bounds (ZeRO-2's groups): same bits
        a0, a1 = n // 3, n - n // 5
        x[:] = xs[RANK]
        sub = x[a0:a1]
        cut = np.clip(b - a0, 0, a1 - a0)
        mine = coll.reduce_scatter(sub, bounds=cut, average=True, algorithm="shm")
        lo = int(cut[RANK]) + a0
        same(np.array(mine), want[lo : lo + mine.size], f"sub-range reduce_scatter shm n={n}")
        if P > 1:  # at p = 2 the shm order is the ring's
            if P == 2:
                same(want, ring_order(xs, b) / np.float32(P), f"shm == ring bits at p=2, n={n}")
    if P > 1:  # shared memory needs one node
        grid = Placement.blocks(RANK, P, 1)
        err = raised(lambda: Collectives(COMM, algorithm="shm", placement=grid), ValueError)
        expect(err is not None and "one node" in str(err), f"shm across nodes: {err}")
        cg = Collectives(COMM, placement=grid)
        expect(
            not cg.shared and not coll.registered(cg.buffer(8)),
            "across nodes, Collectives.buffer is a plain array",
        )
        err = raised(lambda: cg.allreduce(np.ones(8, np.float32), algorithm="shm"), ValueError)
        expect(err is not None and "one node" in str(err), f"shm call across nodes: {err}")
        cg.free()


# ---------------------------------------------------------------- hierarchical, virtual nodes


def virtual_placements() -> list[tuple[str, Placement]]:
    """Every N x L grid of this world (ranks node by node), and ranks dealt round-robin."""
    out = [
        (f"{P // k} nodes x {k}", Placement.blocks(RANK, P, k))
        for k in range(1, P + 1)
        if P % k == 0
    ]
    if P >= 4 and P % 2 == 0:
        out.append(("2 nodes, round-robin", Placement(RANK, tuple(r % 2 for r in range(P)))))
    return out


def hierarchical_order(xs: list[np.ndarray], b: np.ndarray, place: Placement) -> np.ndarray:
    """Documented order: block (m, j) = ring order of owner j inside each node, then ring
    order of owner m over the node sums."""
    nodes = [place.members(m) for m in range(place.num_nodes)]
    big_n, big_l = len(nodes), len(nodes[0])
    out = np.empty_like(xs[0])
    for m in range(big_n):
        for j in range(big_l):
            s = block(b, nodes[m][j])
            sums = []
            for mm in range(big_n):
                acc = xs[nodes[mm][(j + 1) % big_l]][s].copy()
                for k in range(2, big_l + 1):
                    acc += xs[nodes[mm][(j + k) % big_l]][s]
                sums.append(acc)
            acc = sums[(m + 1) % big_n].copy()
            for k in range(2, big_n + 1):
                acc += sums[(m + k) % big_n]
            out[s] = acc
    return out


def check_hierarchical() -> None:
    """Exact results, the documented order and DP == ZeRO bits on every virtual grid."""
    for label, place in virtual_placements():
        cv = Collectives(COMM, algorithm="hierarchical", placement=place)
        for n in (0, 1, P + 1, 1000):
            check_ops(cv, "hierarchical", 1, n)
        for n in (P + 1, 1000, 2**18 + 3):
            xs = [
                np.random.default_rng(7 + r).standard_normal(n).astype(np.float32) for r in range(P)
            ]
            for name, b in (("default", partition(n, P)), ("custom", custom_bounds(n))):
                tag = f"hierarchical {label} n={n} {name} bounds"
                want = hierarchical_order(xs, b, place)
                if place.num_nodes == 1 or place.max_ranks_per_node == 1:
                    same(want, ring_order(xs, b), f"{tag}: degenerate grid is the flat ring")
                a = xs[RANK].copy()
                cv.reduce_scatter(a, bounds=b)
                same(a[block(b)], want[block(b)], f"{tag}: reduce_scatter order")
                cv.allgather(a, bounds=b)
                same(a, want, f"{tag}: reduce_scatter + allgather")
                if name == "default":
                    c = xs[RANK].copy()
                    cv.allreduce(c)
                    same(c, want, f"{tag}: allreduce order")
                # ZeRO-2 reduces one gradient group at a time: a sub-range, same owners.
                lo, hi = n // 3, n - n // 5
                sub = np.clip(b, lo, hi) - lo
                g = xs[RANK][lo:hi].copy()
                mine = cv.reduce_scatter(g, bounds=sub)
                s = block(b)
                own = want[max(s.start, lo) : min(s.stop, hi)]
                same(np.array(mine), own, f"{tag}: sub-range reduce_scatter, same bits")
        before = cv.bytes_sent
        x = contribution(RANK, 1000)
        cv.allreduce(x)
        big_n, big_l = place.num_nodes, place.max_ranks_per_node
        # Ring inside (2 (L-1)/L of the buffer), ring across (2 (N-1)/N of a chunk): with
        # blocks of equal size, 2 (L-1) + 2 (N-1) blocks of 1000/P when P divides 1000.
        if 1000 % P == 0:
            want_bytes = 4 * (1000 // P) * (2 * (big_l - 1) * big_n + 2 * (big_n - 1))
            sent = cv.bytes_sent - before
            expect(sent == want_bytes, f"hierarchical {label}: bytes_sent {sent} != {want_bytes}")
        cv.free()
    if P >= 3:  # two nodes of unequal size: a clear error on every rank, before any message
        uneven = Placement(RANK, tuple(0 if r < P - 1 else 1 for r in range(P)))
        err = raised(lambda: Collectives(COMM, algorithm="hierarchical", placement=uneven),
                     ValueError)  # fmt: skip
        expect(err is not None and "same number of ranks" in str(err), f"uneven nodes: {err}")
        cu = Collectives(COMM, placement=uneven)
        err = raised(lambda: cu.allreduce(np.ones(8, np.float32), algorithm="hierarchical"),
                     ValueError)  # fmt: skip
        expect(err is not None and "[" in str(err), f"uneven nodes, per call: {err}")
        x = contribution(RANK, 1000)
        cu.allreduce(x)  # auto never picks it there
        same(x, exact_sum(1000), "uneven nodes: auto still works")
        cu.free()


# ---------------------------------------------------------------- errors


def raised(fn, kind: type[BaseException]) -> BaseException | None:
    try:
        fn()
    except kind as exc:
        return exc
    return None


def check_mismatches(alg: str) -> None:
    cc = Collectives(COMM, algorithm=alg, check=True)
    if P > 1:
        n = 10 + (RANK == P - 1)
        err = raised(lambda: cc.allreduce(np.ones(n, np.float32)), CollectiveMismatchError)
        expect(err is not None, f"check mode: length mismatch must raise ({alg})")
        if err is not None:
            text = str(err)
            lens = all(f"rank {r}: {10 + (r == P - 1)}" in text for r in range(P))
            expect("allreduce" in text and lens, f"mismatch message names op and lengths: {text}")

        def op_mismatch() -> None:
            buf = np.ones(8, np.float32)
            cc.allgather(buf) if RANK == 0 else cc.allreduce(buf)

        err = raised(op_mismatch, CollectiveMismatchError)
        expect(err is not None and "ops:" in str(err), f"check mode: op mismatch ({alg}): {err}")

        def dtype_mismatch() -> None:
            cc.allreduce(np.ones(8, np.float64 if RANK == 0 else np.float32))

        err = raised(dtype_mismatch, CollectiveMismatchError if RANK else TypeError)
        expect(err is not None, f"check mode: dtype mismatch raises on every rank ({alg})")

        def bounds_mismatch() -> None:
            b = partition(12, P) if RANK else custom_bounds(12)
            cc.reduce_scatter(np.ones(12, np.float32), bounds=b)

        differ = not np.array_equal(partition(12, P), custom_bounds(12))
        err = raised(bounds_mismatch, CollectiveMismatchError)
        expect((err is not None) == differ, f"check mode: bounds mismatch ({alg}): {err}")
    # Still in step after the errors: a matching call works.
    x = contribution(RANK, 1000)
    cc.allreduce(x)
    same(x, exact_sum(1000), f"check mode: allreduce after mismatches ({alg})")
    cc.free()


def check_default_mismatches(alg: str) -> None:
    """The default (cheap) check: a different length, op or dtype raises on every rank."""
    cc = Collectives(COMM, algorithm=alg)
    if P > 1:
        for n in (10, 2**20):  # small (latency) and large (chunked) calls alike
            m = n + (RANK == P - 1) * 3
            err = raised(lambda m=m: cc.allreduce(np.ones(m, np.float32)), CollectiveMismatchError)
            expect(err is not None, f"default check: length mismatch must raise ({alg}, {n})")
            if err is not None:
                text = str(err)
                lens = all(f"rank {r}: {n + (r == P - 1) * 3}" in text for r in range(P))
                expect("allreduce" in text and lens, f"default check names lengths: {text}")

        def op_mismatch() -> None:
            buf = np.ones(8, np.float32)
            cc.reduce_scatter(buf) if RANK == 0 else cc.allreduce(buf)

        err = raised(op_mismatch, CollectiveMismatchError)
        expect(err is not None and "ops:" in str(err), f"default check: op mismatch ({alg})")
        err = raised(
            lambda: cc.allgather(np.ones(8, np.float64 if RANK == 0 else np.float32)),
            CollectiveMismatchError if RANK else TypeError,
        )
        expect(err is not None, f"default check: dtype mismatch raises on every rank ({alg})")
        err = raised(lambda: cc.broadcast(np.ones(8, np.float32), root=RANK % 2), Exception)
        expect(isinstance(err, CollectiveMismatchError), f"default check: root mismatch ({alg})")
    x = contribution(RANK, 1000)
    cc.allreduce(x)
    same(x, exact_sum(1000), f"default check: allreduce after mismatches ({alg})")
    cc.free()
    off = Collectives(COMM, algorithm=alg, check="off")  # the zero-cost path still works
    x = contribution(RANK, 1000)
    off.allreduce(x)
    same(x, exact_sum(1000), f"check='off': allreduce ({alg})")
    off.free()
    expect(raised(lambda: Collectives(COMM, check="some"), ValueError) is not None, "bad check")


def uncaught_length_mismatch() -> None:
    """What a user's script does wrong: the last rank passes one more element. Uncaught, the
    error ends the job (``python -m mpi4py`` aborts it) instead of hanging forever, as
    4 MiB calls did without the check (MPI's truncation error caught only smaller ones)."""
    Collectives(COMM).allreduce(np.ones(2**20 + (RANK == P - 1), np.float32))
    print(f"rank {RANK}: a mismatched allreduce returned", flush=True)


def check_local_errors(coll: Collectives) -> None:
    """Invalid arguments passed by every rank raise before any communication (no hang)."""
    x = np.zeros(16, np.float32)
    for what, fn, kind in (
        ("float64 buffer", lambda: coll.allreduce(np.zeros(4)), TypeError),
        ("strided buffer", lambda: coll.allreduce(x[::2]), ValueError),
        ("2-D buffer", lambda: coll.allgather(x.reshape(4, 4)), ValueError),
        ("bounds too short", lambda: coll.reduce_scatter(x, bounds=[0]), ValueError),
        ("bounds not ending at len", lambda: coll.allgather(x, bounds=[0] * (P + 1)), ValueError),
        ("unknown algorithm", lambda: coll.allreduce(x, algorithm="bogus"), ValueError),
        ("broadcast root out of range", lambda: coll.broadcast(x, root=P), ValueError),
    ):
        expect(raised(fn, kind) is not None, f"{what} must raise {kind.__name__}")
    try:
        Collectives(COMM, algorithm="bogus")
        expect(False, "Collectives(algorithm='bogus') must raise ValueError")
    except ValueError:
        pass


def check_accounting(coll: Collectives) -> None:
    """bytes_sent of a ring all-reduce: every block but the own one, then all but the next."""
    n = 1000
    b = partition(n, P)
    q = (RANK + 1) % P
    own, nxt = b[RANK + 1] - b[RANK], b[q + 1] - b[q]
    before, calls = coll.bytes_sent, coll.calls
    coll.allreduce(contribution(RANK, n), algorithm="ring")
    sent = coll.bytes_sent - before
    want = 0 if P == 1 else 4 * (2 * n - own - nxt)
    expect(sent == want, f"ring allreduce bytes_sent {sent} != {want}")
    expect(coll.calls == calls + 1, f"calls must count each collective once: {coll.calls}")
    # shm: what the peers read from this rank (their parts of its input, its reduced block)
    for registered in (False, True):
        x = coll.buffer(n) if registered else np.empty(n, np.float32)
        x[:] = contribution(RANK, n)
        before = coll.bytes_sent
        coll.allreduce(x, algorithm="shm")
        sent = coll.bytes_sent - before
        want = 0 if P == 1 else 4 * (n - own + (P - 1) * own)
        expect(sent == want, f"shm allreduce bytes_sent {sent} != {want} ({registered=})")


# ---------------------------------------------------------------- main


def main() -> int:
    t0 = time.perf_counter()
    coll = Collectives(COMM)
    token = coll.allreduce_scalars(np.array([float(os.getpid()) if RANK == 0 else 0.0]))[0]
    folder = os.path.join(tempfile.gettempdir(), f"simdist-barrier-{int(token)}")
    os.makedirs(folder, exist_ok=True)
    try:
        for alg in ALGS:
            for rep in (1, 2):
                for n in LENGTHS:
                    check_ops(coll, alg, rep, n)
                check_barrier(coll, alg, rep, folder)
                check_scalars(coll)
            if RANK == 0:
                print(f"check_collectives np={P}: {alg} done", flush=True)
        for alg in ("ring", "rhd"):
            for n in (1, P + 1, 1000, 2**20 + 3):
                check_bitwise(coll, alg, n)
        check_shm(coll)
        if RANK == 0:
            print(f"check_collectives np={P}: shm on registered buffers done", flush=True)
        check_hierarchical()
        if RANK == 0:
            print(f"check_collectives np={P}: hierarchical on virtual nodes done", flush=True)
        for alg in ALGORITHMS:
            check_mismatches(alg)
        for alg in ALGS:
            check_default_mismatches(alg)
        check_local_errors(coll)
        check_accounting(coll)
        coll.barrier()
    finally:
        if RANK == 0:
            shutil.rmtree(folder, ignore_errors=True)
    total = int(coll.allreduce_scalars(np.array([float(TALLY.failures)]))[0])
    if RANK == 0:
        print(
            f"check_collectives np={P}: {TALLY.checks} checks per rank, {total} failures in all, "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    return 1 if total or TALLY.failures else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--uncaught-mismatch"]:
        uncaught_length_mismatch()
        sys.exit(0)
    sys.exit(main())
