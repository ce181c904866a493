"""The list of kernel modules, and ``warm_all()`` which compiles or cache-loads them.

Every module named in ``MODULES`` defines ``_warm() -> None``, which calls each of its
kernels once on tiny arrays of the production dtypes and layouts. numba specialises on
(dtype, ndim, layout), never on shapes, so this one warm-up covers any batch size or world
size: a training run calls ``warm_all(model.kernel_modules)`` on rank 0, barriers, then on
the other ranks (which then only load from the on-disk cache). Loading costs ~25 ms an
overload on every rank of every run, so a run loads only the modules its model declares
(tests/test_imports.py checks each declaration covers what the model imports) and
``jit_seconds()`` tells whether anything compiled or loaded later. Tests use
``dispatchers()`` to run their contract checks over every kernel.
"""

import importlib
import time
from collections.abc import Collection
from types import ModuleType

from numba.core import event
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

# Every run needs these whatever its model: the optimizers' update and gradient norm, the
# half-precision conversions, the shared-memory all-reduce's sum.
COMMON: tuple[str, ...] = ("optim", "half", "reduce")


def modules(names: Collection[str] | None = None) -> list[ModuleType]:
    """The kernel modules of MODULES (or of ``names``, all in MODULES) that exist,
    imported, in list order."""
    if names is not None and set(names) - set(MODULES):
        raise ValueError(f"not kernel modules: {sorted(set(names) - set(MODULES))}")
    found = []
    for name in MODULES:
        if names is not None and name not in names:
            continue
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


def warm_all(names: Collection[str] | None = None) -> float:
    """Call every kernel of the modules ``names`` (with COMMON; all modules if None) once, so
    numba compiles (cold) or loads it (cached); seconds taken."""
    t0 = time.perf_counter()
    for mod in modules(None if names is None else {*names, *COMMON}):
        mod._warm()
    return time.perf_counter() - t0


class _JitClock(event.TimingListener):
    """Seconds numba has held its compiler lock in this process: every compile and every
    load from the on-disk cache takes it."""

    @property
    def seconds(self) -> float:
        return self.duration if self.done else 0.0


_CLOCK = _JitClock()
event.register("numba:compiler_lock", _CLOCK)


def jit_seconds() -> float:
    """Seconds spent compiling or cache-loading kernels in this process so far."""
    return _CLOCK.seconds
