"""Rank roles and the communicators between them (weight streaming, input workers).

A job's ranks are laid out as (Cerebras' weight-streaming appliance, in MPI ranks)::

    [0, W)                 weight servers (MemoryX): parameters and optimizer state, sharded
    [W, W + R)             devices (the replicas; CS systems): compute forward and backward
    [W + R, W + R + K*R)   input workers (CPU): worker i feeds replica i mod R

W = 0 in pipelined mode (weights resident on the devices). Servers come first so that rank
0, which prints and writes every artifact, holds parameter shard 0 and can write the
checkpoint's main file. ``Roles`` is plain arithmetic (no MPI); ``Groups`` splits the world
communicator accordingly. Everything else here is the thin non-blocking layer the streaming
executor needs (``ibcast``, ``isend``, ``irecv``, ``wait_all``), kept in ``simdist.comm``
because it is the only package that imports ``mpi4py.MPI``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from simdist.config import ConfigError

SERVER, DEVICE, WORKER = "weight_server", "device", "input_worker"


@dataclass(frozen=True)
class Roles:
    """Who is who in a job of ``world`` ranks (see the module docstring)."""

    world: int
    servers: int  # W (0: pipelined)
    replicas: int  # R
    workers_per_replica: int  # K

    @classmethod
    def plan(cls, world: int, servers: int, workers_per_replica: int) -> Roles:
        """Split ``world`` ranks; a split that does not come out even is a ConfigError that
        every rank raises (it depends only on the world size and the params)."""
        W, K = servers, workers_per_replica
        if W < 0 or K < 0:
            raise ConfigError("runconfig.weight_servers and input_workers_per_replica are >= 0")
        rest = world - W
        where = f"{world} rank(s)" + (f" minus {W} weight server(s)" if W else "")
        if rest < 1 + K:
            raise ConfigError(
                f"{where} leave {max(rest, 0)} rank(s): not enough for one replica"
                + (f" plus its {K} input worker(s)" if K else "")
                + f"; launch with mpirun -np {W + 1 + K} or more"
            )
        if rest % (1 + K):
            R = rest // (1 + K) + 1  # the replicas these ranks would run, if workers sufficed
            have = rest - R
            raise ConfigError(
                f"{where} leave {rest} rank(s), which do not split into replicas with "
                f"{K} input worker(s) each: {R} replicas would get only {have} worker(s) "
                f"(fewer input workers than the {R * K} that input_workers_per_replica={K} "
                f"needs). Launch with mpirun -np {W + (1 + K) * (rest // (1 + K))} or "
                f"-np {W + (1 + K) * R}"
            )
        return cls(world, W, rest // (1 + K), K)

    def role(self, rank: int) -> str:
        if rank < self.servers:
            return SERVER
        if rank < self.servers + self.replicas:
            return DEVICE
        return WORKER

    def index(self, rank: int) -> int:
        """Position among the ranks of the same role."""
        if rank < self.servers:
            return rank
        if rank < self.servers + self.replicas:
            return rank - self.servers
        return rank - self.servers - self.replicas

    def device_rank(self, replica: int) -> int:
        return self.servers + replica

    def worker_rank(self, worker: int) -> int:
        return self.servers + self.replicas + worker

    def replica_of_worker(self, worker: int) -> int:
        """Round-robin, as Cerebras assigns input workers to systems."""
        return worker % self.replicas

    def workers_of(self, replica: int) -> list[int]:
        """Worker indices feeding ``replica``, in the order they take turns."""
        return [
            w
            for w in range(self.replicas * self.workers_per_replica)
            if w % self.replicas == replica
        ]


class Groups:
    """The communicators of one rank's role (collective over ``comm``: every rank calls it).

    ``active``: servers and devices (every rank but the input workers); ``devices``: the
    replicas (data parallelism among them); ``servers``: the weight
    servers; ``stream[s]``: server s (rank 0 there) plus every device, over which s
    broadcasts the weights it owns; ``grads[s]``: the same members, a separate context for
    the gradient pieces devices send to s; ``feed``: a private duplicate of ``comm`` for
    input batches. Communicators a rank is not in are None.
    """

    def __init__(self, comm: MPI.Comm, roles: Roles):
        self.comm, self.roles = comm, roles
        rank = comm.Get_rank()
        self.role, self.index = roles.role(rank), roles.index(rank)
        # servers and devices (no workers), in world rank order: rank 0 stays rank 0
        self.active = _split(comm, self.role != WORKER, rank)
        self.devices = _split(comm, self.role == DEVICE, self.index)
        self.servers = _split(comm, self.role == SERVER, self.index)
        self.stream: list[MPI.Comm | None] = []
        self.grads: list[MPI.Comm | None] = []
        for s in range(roles.servers):
            member = self.role == DEVICE or (self.role == SERVER and self.index == s)
            key = 0 if self.role == SERVER else 1 + self.index
            c = _split(comm, member, key)
            self.stream.append(c)
            self.grads.append(c.Dup() if c is not None else None)
        self.feed = comm.Dup() if roles.workers_per_replica else None

    def free(self) -> None:
        for c in [self.active, self.devices, self.servers, *self.stream, *self.grads, self.feed]:
            if c is not None:
                c.Free()


def _split(comm: MPI.Comm, member: bool, key: int) -> MPI.Comm | None:
    new = comm.Split(0 if member else MPI.UNDEFINED, key)
    return None if new == MPI.COMM_NULL else new


# ---------------------------------------------------------------- non-blocking transfers
# Buffers travel as raw bytes (any numpy dtype, C-contiguous); both sides know the shapes.
Request = MPI.Request
ANY_TAG = MPI.ANY_TAG


def ibcast(comm: MPI.Comm, buf: np.ndarray, root: int = 0) -> Request:
    """Non-blocking broadcast (MPI_Ibcast) of a contiguous buffer."""
    return comm.Ibcast(_bytes(buf), root=root)


def isend(comm: MPI.Comm, buf: np.ndarray, dest: int, tag: int) -> Request:
    return comm.Isend(_bytes(buf), dest=dest, tag=tag)


def irecv(comm: MPI.Comm, buf: np.ndarray, source: int, tag: int) -> Request:
    return comm.Irecv(_bytes(buf), source=source, tag=tag)


def send(comm: MPI.Comm, buf: np.ndarray, dest: int, tag: int) -> None:
    comm.Send(_bytes(buf), dest=dest, tag=tag)


def recv(comm: MPI.Comm, buf: np.ndarray, source: int, tag: int = ANY_TAG) -> int:
    """Blocking receive; returns the message's tag (useful with ``ANY_TAG``)."""
    status = MPI.Status()
    comm.Recv(_bytes(buf), source=source, tag=tag, status=status)
    return status.Get_tag()


def probe(comm: MPI.Comm, source: int, tag: int) -> bool:
    """Is a message from ``source`` with ``tag`` waiting (MPI_Iprobe)?"""
    return bool(comm.Iprobe(source=source, tag=tag))


def cancel(request: Request) -> None:
    """Cancel a pending receive and complete it (it may have matched already: then it
    simply completes)."""
    request.Cancel()
    request.Wait()


def wait(request: Request) -> None:
    wait_all([request])


def wait_all(requests: list[Request], spin_s: float = 2e-4) -> None:
    """Complete ``requests``, polling politely: spin ``spin_s`` (a quick answer stays
    quick), then sleep 50 us between polls. A blocking MPI wait busy-polls a core, and the
    ranks of a simulated job share a few cores: a waiting weight server or input worker
    must leave them to the devices that compute."""
    if not requests:
        return
    test = MPI.Request.Testall
    if test(requests):
        return
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < spin_s:
        if test(requests):
            return
    while not test(requests):
        time.sleep(5e-5)


def _bytes(buf: np.ndarray):
    if not buf.flags.c_contiguous:
        raise ValueError("transfers need C-contiguous buffers")
    return [buf, buf.nbytes, MPI.BYTE]
