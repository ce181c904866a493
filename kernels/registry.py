"""The list of kernel modules, and ``warm_all()`` which compiles or cache-loads all of them.

Every module named in ``MODULES`` defines ``_warm() -> None``, which calls each of its
kernels once on tiny arrays of the production dtypes and layouts. numba specialises on
(dtype, ndim, layout), never on shapes, so this one warm-up covers any batch size or world
size: a training run calls ``warm_all()`` on rank 0, barriers, then on the other ranks
(which then only load from the on-disk cache). Tests use ``dispatchers()`` to run their
contract checks over every kernel, including modules added later.
"""

import importlib
import time
from types import ModuleType

from numba.core.dispatcher import Dispatcher

# Append a module here when it is written (each needs a _warm()). A name whose module does
# not exist is skipped, so the list may run ahead of the code.
MODULES: list[str] = [
    "linear",
    "activation",
    "loss",
    "optim",
    "rowops",
    "embedding",
    "layernorm",
    "gelu",
    "attention",
    "matmul",
    "residual",
    "reduce",
    "dropout",
    "transformer_act",
    "linear_hf",
    "embedding_seg",
    "rmsnorm",
    "relpos",
    "linear_nobias",
    "positions",
    "label_smoothing",
    "half",
]


def modules() -> list[ModuleType]:
    """The kernel modules of MODULES that exist, imported, in list order."""
    found = []
    for name in MODULES:
        full = f"{__package__}.{name}"
        try:
            found.append(importlib.import_module(full))
        except ModuleNotFoundError as e:
            # Only "this module does not exist (yet)" is skipped; a kernel module that
            # exists but fails to import (missing dependency, syntax error) must fail loudly.
            if e.name != full:
                raise
    return found


def dispatchers() -> dict[str, Dispatcher]:
    """Every numba-compiled function defined in the kernel modules, as 'module.name'."""
    found = {}
    for mod in modules():
        for attr, obj in vars(mod).items():
            if isinstance(obj, Dispatcher) and obj.py_func.__module__ == mod.__name__:
                found[f"{mod.__name__.rsplit('.', 1)[-1]}.{attr}"] = obj
    return found


def warm_all() -> float:
    """Call every kernel once so numba compiles (cold) or loads it (cached); seconds taken."""
    t0 = time.perf_counter()
    for mod in modules():
        mod._warm()
    return time.perf_counter() - t0
