"""simdist's communication layer: the only package that imports ``mpi4py.MPI``.

``from simdist.comm import Collectives, partition``. Names that need MPI are imported lazily
(PEP 562), so serial code and tests can use ``partition`` or the cost model without
initialising MPI.

| module          | holds                                                              |
|-----------------|--------------------------------------------------------------------|
| partition.py    | ``partition(n, world)``: block offsets; bounds validation (no MPI) |
| cost.py         | alpha-beta cost model and the ``algorithm="auto"`` rule (no MPI)   |
| collectives.py  | ``Collectives``: validation, check mode, dispatch                  |
| algorithm.py    | ``Algorithm`` base class, registry, ``average_block``              |
| p2p.py          | pairwise copy / pipelined receive-and-add, reused scratch          |
| ring.py         | ring reduce-scatter / all-gather / broadcast                       |
| rhd.py          | recursive halving / doubling, binomial broadcast                   |
| hierarchical.py | in-node ring, cross-node ring, in-node ring (N x L grids)          |
| shm.py          | shared-memory windows: ranks of one node read each other's buffers |
| topology.py     | ``Placement``: which node each rank is on (MPI shared-memory split)|
| groups.py       | sub-communicators of the execution modes                           |
| native.py       | MPI's own collectives (reference backend)                          |
| world.py        | the world communicator, abort-on-exception, wall clock             |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cost import choose_algorithm
from .partition import partition

if TYPE_CHECKING:
    from .algorithm import ALGORITHMS, Algorithm, average_block, register_algorithm
    from .collectives import CollectiveMismatchError, Collectives

_LAZY = {
    "Collectives": "collectives",
    "CollectiveMismatchError": "collectives",
    "Algorithm": "algorithm",
    "ALGORITHMS": "collectives",  # via collectives, so the built-in algorithms are registered
    "average_block": "algorithm",
    "register_algorithm": "algorithm",
}

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CollectiveMismatchError",
    "Collectives",
    "average_block",
    "choose_algorithm",
    "partition",
    "register_algorithm",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
