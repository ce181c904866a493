"""What a collective algorithm provides, the registry of algorithms, and averaging.

An algorithm is one small class per backend (Horovod's shape). It receives already validated
arguments from ``Collectives``: a 1-D contiguous float32 buffer of length >= 1, the block
offsets as a list of ``world + 1`` ints, ``world >= 2``. It works in place.

To add an algorithm (as ``hierarchical.py`` does), subclass ``Algorithm`` in its own
module, decorate it with ``@register_algorithm``, import that module in ``collectives.py``,
and teach ``cost.choose_algorithm`` when to pick it. Its ``__init__`` may build
sub-communicators from the ``placement`` it is given (release them in ``free``);
nothing else in the package needs to change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
from mpi4py import MPI

from simdist.kernels.half import round_half

from .p2p import Exchanger
from .topology import Placement


def average_block(block: np.ndarray, world: int, half: int = 0) -> None:
    """THE definition of averaging: the finished sum divided by ``np.float32(world)``.

    True division (not multiplication by 1/world, which rounds differently unless world is a
    power of two), applied once to a finished sum by the rank that owns it, before the result
    is distributed: every rank then holds the same bits. ``half``: a half-precision wire
    (``p2p``): the average is stored in that format too.
    """
    if world != 1:
        np.divide(block, np.float32(world), out=block)
        if half and block.size:
            round_half(block, half)


class Algorithm(ABC):
    """One way of running the collectives over a communicator's point-to-point messages."""

    name: ClassVar[str]

    def __init__(self, comm: MPI.Comm, p2p: Exchanger, placement: Placement | None = None):
        self.comm = comm
        self.placement = placement  # which node each rank is on (None: not known/needed)
        self.p2p = p2p
        if placement is not None:  # copies across nodes are pipelined (see p2p)
            p2p.place(placement.node_of)
        self.rank = comm.Get_rank()
        self.world = comm.Get_size()

    @abstractmethod
    def reduce_scatter(self, buf: np.ndarray, bounds: list[int]) -> None:
        """Leave the sum over ranks of ``buf[bounds[r]:bounds[r+1]]`` there on rank r."""

    @abstractmethod
    def allgather(self, buf: np.ndarray, bounds: list[int]) -> None:
        """Copy every rank's block ``buf[bounds[r]:bounds[r+1]]`` to all ranks."""

    @abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy ``buf`` of rank ``root`` to all ranks."""

    def allreduce(self, buf: np.ndarray, bounds: list[int], average: bool) -> None:
        """Reduce-scatter, average the owned block, all-gather: by construction the same bits
        as a caller doing those three steps itself over the same bounds."""
        self.reduce_scatter(buf, bounds)
        if average:
            average_block(buf[bounds[self.rank] : bounds[self.rank + 1]], self.world, self.p2p.half)
        self.allgather(buf, bounds)

    @classmethod
    def placement_error(cls, placement: Placement) -> str | None:
        """Why this algorithm cannot run on ``placement`` (None: it can). Benchmarks ask it
        to leave out what a run's placement rules out, as ``__init__`` would refuse it."""
        return None

    def free(self) -> None:  # noqa: B027  (optional hook: most algorithms create nothing)
        """Release what ``__init__`` created (sub-communicators); called by Collectives.free."""

    def barrier(self) -> None:
        """Dissemination barrier: ceil(log2 p) rounds of zero-byte messages at distance 2^k."""
        r, p = self.rank, self.world
        dist = 1
        while dist < p:
            self.p2p.signal((r + dist) % p, (r - dist) % p)
            dist <<= 1


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` selectable as ``algorithm=cls.name``."""
    if cls.name in ALGORITHMS or cls.name == "auto":
        raise ValueError(f"collective algorithm name {cls.name!r} is already taken")
    ALGORITHMS[cls.name] = cls
    return cls
