"""Point-to-point building blocks shared by simdist's collective algorithms.

Every algorithm step is one of two exchanges between a pair of ranks:

- ``copy``: send a slice, receive straight into another slice (all-gather, broadcast);
- ``reduce``: send a slice, receive into scratch and add it into a slice (reduce-scatter).

Both move float32 data as buffers (never pickled objects). In a half-precision wire
(``half``, set by ``Collectives.half_wire`` for mixed-precision gradients) every message is
packed into 16-bit words (bfloat16 or float16) before it leaves and unpacked where it lands,
and every sum a ``reduce`` forms is rounded to that format, as a device reducing half buffers
does: half the bytes, the half format's arithmetic.
A message the receiver adds is cut into segments of ``segment`` elements and pipelined:
up to ``depth`` segments are in flight while the receiver adds the one that has arrived, so
the peer's copy overlaps this rank's addition, and the scratch a segment lands in is still
in cache when it is added. Sender and receiver cut a message of length L the same way
(``ceil(L / segment)`` pieces), so they agree without telling each other. Scratch is
allocated once, grown on demand and reused: no allocation per call in steady state.

A copy between ranks on different nodes (``place``) is cut and pipelined the same way. One
large message each way over TCP is not reliably full duplex: measured across two network
namespaces on a 1 Gbit/s tbf link (MPICH 5.0.2, UCX_TLS=tcp,self), an 8 MiB Sendrecv each way
took 70 ms in some calls and 137-141 ms (the two directions one after the other) in others,
and always ~140 ms right after a reduce exchange, so a 16 MiB ring all-reduce took 210 ms
instead of its halves' 70 + 70; in 1 MiB pieces, 2 in flight, it took 70 ms every time, and
the all-reduce 140 ms (4 MiB pieces: 178 ms). Inside a node a copy stays one Sendrecv:
MPICH's shared-memory path moves one large message about twice as fast as 1 MiB pieces
(16 MiB exchange at np 2 on the development machine, load average 5: 4.0 ms against 8.3 ms).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from simdist.kernels.half import add_half, pack_half, unpack_half

# Tag of every simdist message; the communicator is simdist's private duplicate, so it
# cannot collide with the application's own point-to-point traffic.
TAG = 0x51D
# 256 Ki float32 = 1 MiB per segment, 2 in flight. Measured on the development machine kind
# (2 cores, MPICH shared memory), 64 MiB ring all-reduce at np 2: 8.2-9.4 ms against
# 10.9-11.7 ms unsegmented; 256 KiB segments pay more per-message rendezvous (9-10 ms), and
# 4 MiB ones lose the overlap and leave the scratch out of cache.
SEGMENT = 1 << 18
DEPTH = 2

_EMPTY = np.empty(0, dtype=np.float32)
_EMPTY16 = np.empty(0, dtype=np.uint16)


class Exchanger:
    """Pairwise exchanges on one communicator, with reused scratch and a sent-bytes count."""

    def __init__(self, comm: MPI.Comm, segment: int = SEGMENT, depth: int = DEPTH):
        if segment < 1 or depth < 1:
            raise ValueError(f"segment and depth must be >= 1, got {segment}, {depth}")
        self.comm = comm
        self.segment = segment
        self.depth = depth
        self.bytes_sent = 0  # payload bytes this rank has sent
        self._scratch = _EMPTY
        self._words = [_EMPTY16, _EMPTY16]  # half-wire scratch: outgoing, incoming
        self.half = 0  # 0: float32 messages; kernels.half.BF16 / F16: 16-bit words
        self._node_of: tuple[int, ...] | None = None  # None: every rank on one node

    def place(self, node_of: Sequence[int] | None) -> None:
        """Tell which node each rank of the communicator runs on (``Placement.node_of``):
        copies between ranks on different nodes are then pipelined in segments. Every rank
        must be given the same table (both ends of a message decide how to cut it)."""
        if node_of is not None and len(node_of) != self.comm.Get_size():
            raise ValueError(
                f"node table has {len(node_of)} entries for {self.comm.Get_size()} ranks"
            )
        single = node_of is None or len(set(node_of)) <= 1
        self._node_of = None if single else tuple(node_of)

    def _piece(self, peer: int, n: int) -> int:
        """Elements per piece of a copy of ``n`` elements to or from ``peer``."""
        nodes = self._node_of
        if nodes is None or nodes[peer] == nodes[self.comm.Get_rank()]:
            return max(n, 1)  # one message
        return self.segment

    def scratch(self, n: int) -> np.ndarray:
        """A reusable float32 work array of at least ``n`` elements (grown, never shrunk)."""
        if self._scratch.size < n:
            self._scratch = np.empty(max(n, 2 * self._scratch.size), dtype=np.float32)
        return self._scratch

    def words(self, which: int, n: int) -> np.ndarray:
        """Reusable uint16 scratch ``which`` (0 outgoing, 1 incoming) of ``n`` words."""
        if self._words[which].size < n:
            self._words[which] = np.empty(max(n, 2 * self._words[which].size), np.uint16)
        return self._words[which][:n]

    def _pack(self, send: np.ndarray | None) -> np.ndarray | None:
        if send is None or not send.size:
            return send
        out = self.words(0, send.size)
        pack_half(out, send, self.half)
        return out

    def copy(self, send: np.ndarray | None, dst: int, recv: np.ndarray | None, src: int) -> None:
        """Send ``send`` to ``dst`` while receiving ``len(recv)`` elements from ``src`` into it.

        Either side may be None or empty; both ranks of a pair know a block's length, so an
        empty message is skipped on both sides rather than sent.
        """
        if self.half and (send is not None or recv is not None):
            words = None if recv is None or not recv.size else self.words(1, recv.size)
            self._copy(self._pack(send), dst, words, src)
            if words is not None:
                unpack_half(recv, words, self.half)
            return
        self._copy(send, dst, recv, src)

    def _copy(self, send: np.ndarray | None, dst: int, recv: np.ndarray | None, src: int) -> None:
        ns = 0 if send is None else send.size
        nr = 0 if recv is None else recv.size
        if (ns and ns > self._piece(dst, ns)) or (nr and nr > self._piece(src, nr)):
            self._pipelined_copy(send, dst, recv, src)
            return
        comm = self.comm
        # buffers typed by their dtype: float32 (MPI.FLOAT) or 16-bit words (UNSIGNED_SHORT)
        if ns and nr:
            comm.Sendrecv(send, dst, TAG, recv, src, TAG)
        elif ns:
            comm.Send(send, dst, TAG)
        elif nr:
            comm.Recv(recv, src, TAG)
        self.bytes_sent += send.nbytes if ns else 0

    def reduce(self, send: np.ndarray | None, dst: int, acc: np.ndarray | None, src: int) -> None:
        """Send ``send`` to ``dst``; receive ``len(acc)`` elements from ``src`` and add into acc.

        ``acc += received`` (IEEE addition is commutative, so which operand is local does
        not change the bits). The peer must send this message with ``reduce`` as well.
        """
        send = _EMPTY if send is None else send
        acc = _EMPTY if acc is None else acc
        ns, nr = send.size, acc.size
        seg = self.segment
        if self.half:
            send = self._pack(send)
        if ns <= seg and nr <= seg:  # one message each way: no pipelining needed
            tmp = self.words(1, nr) if self.half else self.scratch(nr)[:nr]
            self._copy(send, dst, tmp, src)
            if nr:
                self._add(acc, tmp)
            return
        self._pipelined_reduce(send, dst, acc, src)

    def _add(self, acc: np.ndarray, received: np.ndarray) -> None:
        if self.half:
            add_half(acc, received, self.half)
        else:
            np.add(acc, received, out=acc)

    def _pipelined_reduce(self, send: np.ndarray, dst: int, acc: np.ndarray, src: int) -> None:
        comm, seg, depth = self.comm, self.segment, self.depth
        ns, nr = send.size, acc.size
        nseg = max(-(-ns // seg), -(-nr // seg))
        slots = self.words(1, depth * seg) if self.half else self.scratch(depth * seg)
        recvs: list[MPI.Request | None] = [None] * depth
        sends: list[MPI.Request] = []

        def post(k: int) -> None:
            lo = k * seg
            if lo < nr:
                hi = min(lo + seg, nr)
                s = (k % depth) * seg
                recvs[k % depth] = comm.Irecv(slots[s : s + hi - lo], src, TAG)
            if lo < ns:
                sends.append(comm.Isend(send[lo : min(lo + seg, ns)], dst, TAG))

        for k in range(min(depth, nseg)):
            post(k)
        for k in range(nseg):
            lo = k * seg
            if lo < nr:
                hi = min(lo + seg, nr)
                s = (k % depth) * seg
                req = recvs[k % depth]
                assert req is not None
                req.Wait()
                self._add(acc[lo:hi], slots[s : s + hi - lo])
            # The slot of segment k is free again: reuse it for segment k + depth.
            if k + depth < nseg:
                post(k + depth)
        MPI.Request.Waitall(sends)
        self.bytes_sent += send.nbytes

    def _pipelined_copy(
        self, send: np.ndarray | None, dst: int, recv: np.ndarray | None, src: int
    ) -> None:
        """``copy`` with each direction cut into its pieces (``_piece``), ``depth`` of each
        in flight: piece k + depth is posted once piece k has arrived and left."""
        comm, depth = self.comm, self.depth
        send = _EMPTY if send is None else send
        recv = _EMPTY if recv is None else recv
        ns, nr = send.size, recv.size
        ps, pr = self._piece(dst, ns), self._piece(src, nr)
        ks, kr = -(-ns // ps), -(-nr // pr)
        pending: list[list[MPI.Request]] = [[] for _ in range(depth)]

        def post(k: int) -> None:
            slot = pending[k % depth]
            if k < kr:
                lo = k * pr
                slot.append(comm.Irecv(recv[lo : min(lo + pr, nr)], src, TAG))
            if k < ks:
                lo = k * ps
                slot.append(comm.Isend(send[lo : min(lo + ps, ns)], dst, TAG))

        steps = max(ks, kr)
        for k in range(min(depth, steps)):
            post(k)
        for k in range(steps):
            slot = pending[k % depth]
            MPI.Request.Waitall(slot)
            slot.clear()
            if k + depth < steps:
                post(k + depth)
        self.bytes_sent += send.nbytes

    def signal(self, dst: int, src: int) -> None:
        """Zero-byte send to ``dst`` and receive from ``src`` (a synchronisation edge)."""
        self.comm.Sendrecv([_EMPTY, MPI.FLOAT], dst, TAG, [_EMPTY, MPI.FLOAT], src, TAG)
