"""Collective time from the message schedule simdist's algorithms actually run.

The closed forms of ``cost.collective_time`` assume equal blocks. The training loop's
collectives are not always like that: ZeRO-2 reduce-scatters each gradient group over the
group's range cut at the ZeRO slice boundaries, so most ranks' blocks are empty and one or
two hold the whole group, and a ring then moves the largest block at every step. This
module replays the schedules of ``simdist.comm.ring``, ``rhd`` and ``shm`` on the real
block sizes (bytes per rank):

    per step and rank:  messages·α + max(bytes sent, bytes received)·β + bytes added·γ
    (β and γ at the step's size where the link has size-keyed tables; a step that adds at
    the link's measured reducing rate instead of β + γ where it has one)
    a step lasts as long as its busiest rank; the collective is the sum of its steps

(links are full duplex, so a Sendrecv costs the larger direction). For equal blocks this
is exactly the ring formula of ``cost.py``, and the Rabenseifner formula when p = 2^k; the
fold of the p − 2^k extra ranks is counted as the code runs it (whole buffer in, owned
block out). ``native`` (MPI's own collectives) has no schedule here: the closed form with
MPICH's algorithm choice is used, on the total size.

Why each term costs what it costs, and which calibration probe prices it
(``simdist.calibrate``; ``scripts/validate_sim.py --calibrate`` runs the same probes on each
collective's own buffer, between its calls):

- ``messages·α`` (``Link.latency``): every step is one pairwise exchange, and each one pays
  MPI's matching and rendezvous handshake plus mpi4py's call before a byte moves. α is the
  intercept of the least-squares fit t = α + n·β (weights 1/t, so the small messages pin it)
  to ``LinkProbe.exchange``, a Sendrecv of 8 B to 16 MiB between paired ranks. A rank whose
  blocks are both empty pays nothing: ``p2p.Exchanger.copy`` skips empty messages on both
  sides. A step's pieces (p2p's 1 MiB segments of a reducing step, or of a copy between
  nodes) are not charged α each: a piece's handshake overlaps the previous piece's
  transfer, and what it does cost is inside the measured rates below.
- ``max(sent, received)·β(size)`` (``Link.beta_at``): the probe moves both directions at
  once and costs the larger one, so a step does too (links are full duplex). β's table
  (``size_efficiency``) is the probe's rate after α, s / (t − α) for s >= 32 KiB, as a
  fraction of the fastest size: on a CPU a message that stays in cache moves faster than
  one that goes through memory, so one rate does not fit all sizes. Across hosts the full
  duplex holds only because copies between nodes go in pieces (p2p): one 8 MiB Sendrecv
  each way over TCP ran the directions one after the other (2x this term) in many calls.
- a step that adds what it receives, ``max(sent, received)`` at the reducing rate
  (``Link.reducing_beta_at``, table ``reducing_efficiency``): ``LinkProbe.reduce`` times
  p2p's pipelined reduce exchange as a whole (send one block, add the peer's copy of the
  other into it), at each calibrate size. Timed as a whole because its addition of
  segment k overlaps the transfer of segment k + 1, and the just-received segment is still
  in cache when it is added: neither "copy + γ" nor "copy" alone describes it.
  ``bytes added·γ`` (``gamma_at``: ``np.add``'s rate from the memory sweep, bytes reduced
  per second) is the fallback where a link has no reducing table.
- the step is its busiest rank: each exchange waits for its partner, so a slow rank holds
  its neighbours back, step after step.
- the collective is the sum of its steps: step s + 1 sends what step s produced (the ring
  forwards the block it has just added into), so steps do not overlap.
- ``call_overhead`` (once per call): ``LinkProbe.latencies`` "call", simdist's ring
  all-gather of 16 floats less its p − 1 bare 32 B Sendrecvs: the argument checks and
  dispatch of ``Collectives`` in Python.
- shm (one node): the "messages" are fences at ``direct.latency`` ("step": half of shm's own
  reduce-scatter of 16 floats less its addition); bytes at the rates of
  ``LinkProbe.direct``: "add" (load the peer's values and add) for the reduce-scatter,
  "copy" (load) for the all-gather, "store" for the all-reduce's second step, which the
  probe times right after an untimed "add", as the all-reduce stores the block its own
  addition has just left in cache.
- an all-reduce's second half (its all-gather steps: the ones that add nothing) at the
  rates of ``Link.after_reduce`` (table ``gather_efficiency``): ``LinkProbe.gather``, the
  Sendrecv of ``exchange`` timed right after an untimed reduce exchange on the same
  blocks, as the all-reduce runs it; an all-gather called alone keeps ``size_efficiency``.
  Each probe writes its whole buffer first, as the loop's gradients are just written
  before a call, and that is the state a half called alone starts from; inside the
  all-reduce the all-gather starts from what the reduce-scatter left instead (the owned
  block just summed, the peer's only read by the sends), and its rate differs with the
  CPU. On an AMD EPYC (Zen 3) the Sendrecv after a reduce ran 5-17 % slower than on
  freshly written blocks (32 KiB-16 MiB, 2 ranks: calibrate's raw times), and the ring and
  rhd all-reduces measured 4-10 % above the sum of their halves' prediction, while the
  halves alone were within 4 %; on a Zen 5 the issue that asked for this saw an all-reduce
  below its halves' sum (1.2 ms against 1.3 + 0.8 ms at 16 MiB). Which way it goes is the
  probe's to say, not this model's. shm's "store" probe follows an untimed "add" for the
  same reason. With p > 2 the later all-gather steps forward blocks just received rather
  than just summed; the table is what the 2-rank probe measures, used for all of them.

Pure Python on lists of ``world`` ints: microseconds per call, no MPI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .cost import canonical_op, collective_time
from .profile import Link

# one entry per rank: (messages, bytes sent, bytes received, bytes added)
Step = list[tuple[int, float, float, float]]


def _pof2(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _ring(op: str, blocks: Sequence[float]) -> list[Step]:
    p = len(blocks)
    steps: list[Step] = []
    if op in ("reduce_scatter", "allreduce"):
        for s in range(p - 1):  # rank r sends block r-s-1 and adds block r-s-2 (ring.py)
            step = []
            for r in range(p):
                out, inc = blocks[(r - s - 1) % p], blocks[(r - s - 2) % p]
                step.append((int(out > 0 or inc > 0), out, inc, inc))
            steps.append(step)
    if op in ("allgather", "allreduce"):
        for s in range(p - 1):  # rank r forwards block r-s, receives block r-s-1
            step = []
            for r in range(p):
                out, inc = blocks[(r - s) % p], blocks[(r - s - 1) % p]
                step.append((int(out > 0 or inc > 0), out, inc, 0.0))
            steps.append(step)
    return steps


def _rhd(op: str, blocks: Sequence[float]) -> list[Step]:
    p = len(blocks)
    q = _pof2(p)
    rem = p - q
    n = float(sum(blocks))
    idle = (0, 0.0, 0.0, 0.0)
    # participant nr's super-block: blocks 2nr, 2nr+1 (nr < rem) or block nr + rem
    sizes = [blocks[2 * i] + blocks[2 * i + 1] if i < rem else blocks[i + rem] for i in range(q)]
    old = [2 * i + 1 if i < rem else i + rem for i in range(q)]

    def span(first: int, count: int) -> float:
        return float(sum(sizes[first : first + count]))

    steps: list[Step] = []
    if op in ("reduce_scatter", "allreduce"):
        if rem:  # even rank 2i hands its whole buffer to 2i+1, which adds it
            step = [idle] * p
            for i in range(rem):
                step[2 * i] = (1, n, 0.0, 0.0)
                step[2 * i + 1] = (1, 0.0, n, n)
            steps.append(step)
        mask = q >> 1
        while mask:
            step = [idle] * p
            for nr in range(q):
                base = nr & ~(2 * mask - 1)
                keep, give = (base + mask, base) if nr & mask else (base, base + mask)
                out, inc = span(give, mask), span(keep, mask)
                step[old[nr]] = (int(out > 0 or inc > 0), out, inc, inc)
            steps.append(step)
            mask >>= 1
        if rem and op == "reduce_scatter":  # 2i+1 returns block 2i
            step = [idle] * p
            for i in range(rem):
                step[2 * i + 1] = (1, blocks[2 * i], 0.0, 0.0)
                step[2 * i] = (1, 0.0, blocks[2 * i], 0.0)
            steps.append(step)
    if op in ("allgather", "allreduce"):
        if rem and op == "allgather":  # 2i hands its own block to 2i+1
            step = [idle] * p
            for i in range(rem):
                step[2 * i] = (1, blocks[2 * i], 0.0, 0.0)
                step[2 * i + 1] = (1, 0.0, blocks[2 * i], 0.0)
            steps.append(step)
        mask = 1
        while mask < q:
            step = [idle] * p
            for nr in range(q):
                mine = nr & ~(mask - 1)
                out, inc = span(mine, mask), span(mine ^ mask, mask)
                step[old[nr]] = (int(out > 0 or inc > 0), out, inc, 0.0)
            steps.append(step)
            mask <<= 1
        if rem:  # 2i+1 sends 2i the rest (allgather: two messages around block 2i)
            step = [idle] * p
            for i in range(rem):
                rest = n if op == "allreduce" else n - blocks[2 * i]
                msgs = 1 if op == "allreduce" else 2
                step[2 * i + 1] = (msgs, rest, 0.0, 0.0)
                step[2 * i] = (msgs, 0.0, rest, 0.0)
            steps.append(step)
    return steps


def _shm(op: str, blocks: Sequence[float]) -> list[Step]:
    """``simdist.comm.shm``: peers read and write each other's memory directly, one step
    per half (a device's link carries its own loads and stores and the others' at once).
    The "messages" are fences: 2 per half alone, 2 for the all-reduce (one before the
    sums, one after the owners have stored their blocks into the others' buffers). The
    reduce-scatter adds the peers' values as it loads them: bytes pulled at the link's
    ``peer_access`` reducing rate (``schedule_time``), or its load rate plus γ; the
    all-reduce's second step is stores, at the store rates where the link has them."""
    p = len(blocks)
    total = float(sum(blocks))
    alone = 1 if op == "allreduce" else 2
    steps: list[Step] = []
    if op in ("reduce_scatter", "allreduce"):  # pull own block from p-1 peers, adding
        steps.append([(alone, total - b, (p - 1) * b, (p - 1) * b) for b in blocks])
    if op in ("allgather", "allreduce"):  # own block to p-1 peers, every other block in
        steps.append([(alone, (p - 1) * b, total - b, 0.0) for b in blocks])
    return steps


SCHEDULES = {"ring": _ring, "rhd": _rhd, "shm": _shm}


def schedule(op: str, algorithm: str, blocks: Sequence[float]) -> list[Step]:
    """The steps of ``op`` with ``algorithm`` ("ring" | "rhd" | "shm") on per-rank block
    bytes."""
    op = canonical_op(op)
    if op not in ("allreduce", "reduce_scatter", "allgather"):
        raise ValueError(f"no schedule for {op!r} (allreduce, reduce_scatter, allgather)")
    if algorithm not in SCHEDULES:
        raise ValueError(f"no schedule for algorithm {algorithm!r}; use {sorted(SCHEDULES)}")
    if any(b < 0 for b in blocks):
        raise ValueError("block sizes must be >= 0")
    return SCHEDULES[algorithm](op, blocks)


def _rank_time(m: int, out: float, inc: float, add: float, link: Link) -> float:
    """One rank's part of a step, each rate at the step's size. A step that adds what it
    receives costs the reducing rate where the link has one measured (calibrate times p2p's
    pipelined reduce exchange, and shm's load-and-add, as a whole), else the copy plus γ."""
    size = max(out, inc)
    if add and link.reducing_efficiency:
        return m * link.latency + size * link.reducing_beta_at(size)
    t = m * link.latency + size * link.beta_at(size)
    return t + add * link.gamma_at(add) if add else t


def step_time(step: Step, link: Link) -> float:
    """Seconds of one step: its busiest rank."""
    return max(_rank_time(m, out, inc, add, link) for m, out, inc, add in step)


def schedule_time(op: str, algorithm: str, blocks: Sequence[float], link: Link) -> float:
    """Seconds of one collective over ``len(blocks)`` ranks on ``link``.

    ``blocks[r]`` is rank r's block in bytes (``bounds`` differences times the item size);
    the buffer is their sum. ``native`` uses the closed form (MPICH's choice) on that sum.
    """
    p = len(blocks)
    total = float(sum(blocks))
    if p <= 1 or total == 0:
        return 0.0
    if algorithm == "native":
        return link.call_overhead + collective_time(op, "native", total, p, link)
    if algorithm == "shm":  # its fence latency was measured through the call itself
        direct = link.peer_access
        steps = schedule(op, algorithm, blocks)
        # the all-reduce's second step stores the owned block into the peers' buffers
        rates = [direct, direct.for_stores] if canonical_op(op) == "allreduce" else [direct]
        return sum(step_time(s, lk) for s, lk in zip(steps, rates, strict=True))
    steps = schedule(op, algorithm, blocks)
    if canonical_op(op) != "allreduce":
        return link.call_overhead + sum(step_time(s, link) for s in steps)
    # the all-reduce's second half (its steps that add nothing) at the rates measured
    # after a first half, where the link has them
    second = link.after_reduce
    return link.call_overhead + sum(
        step_time(s, link if any(r[3] for r in s) else second) for s in steps
    )


def hierarchical_time(
    op: str,
    blocks: Sequence[float],
    nodes: Sequence[Sequence[int]],
    intra: Link,
    inter: Link,
) -> float:
    """Seconds of ``simdist.comm.hierarchical`` on ``nodes`` (the ranks of each node, all of
    one size): ring schedules on the chunk sizes inside the nodes (all nodes at once, same
    chunks), then on each chunk's blocks across the nodes (the L cross rings at once: the
    slowest counts). The staging copies are local memory traffic and not counted."""
    op = canonical_op(op)
    if op not in ("allreduce", "reduce_scatter", "allgather"):
        raise ValueError(f"no schedule for {op!r} (allreduce, reduce_scatter, allgather)")
    per_node = len(nodes[0])
    if any(len(m) != per_node for m in nodes):
        raise ValueError("hierarchical needs the same number of ranks on every node")
    cross = [[float(blocks[m[j]]) for m in nodes] for j in range(per_node)]
    chunks = [sum(c) for c in cross]
    # one call: its overhead once, not per phase
    t, intra = intra.call_overhead, dataclasses.replace(intra, call_overhead=0.0)
    inter = dataclasses.replace(inter, call_overhead=0.0)
    for half in ("reduce_scatter", "allgather"):
        if op in (half, "allreduce"):
            t += schedule_time(half, "ring", chunks, intra)
            t += max(schedule_time(half, "ring", c, inter) for c in cross)
    return t


__all__ = ["SCHEDULES", "Step", "hierarchical_time", "schedule", "schedule_time", "step_time"]
