"""What every simdist model provides to the training loop.

A model owns no parameter memory: the loop hands it named views into ONE flat parameter
buffer and ONE flat gradient buffer (see ``simdist.arena``), so data parallelism and ZeRO can
treat all parameters as a single vector. The model does own its activation workspace,
allocated once for a fixed micro-batch size, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np


@dataclass(frozen=True)
class ParamSpec:
    name: str  # checkpoint name, e.g. "fc1.weight" or "h.0.attn.c_attn.weight"
    shape: tuple[int, ...]
    weight_decay: bool  # False for biases and norm gains/offsets

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class GradientGroup:
    """Parameters whose gradients the backward pass finishes together (e.g. one layer).

    Groups let ZeRO-2 reduce-scatter gradients as soon as they are final, so a rank never
    holds the whole gradient: ``held`` marks a group written early and finished late (tied
    embeddings: the LM head writes d(wte) first, the embedding backward adds to it last).
    Names must be contiguous in ``parameter_specs`` order.
    """

    names: tuple[str, ...]
    held: bool = False


class KernelCost(NamedTuple):
    """One kernel call (or ``count`` identical calls) of a training step, for the roofline.

    ``flops``: floating-point operations the kernel's code performs (2 per multiply-add;
    elementwise +, -, *, /, sqrt, min/max count 1 each, exp and tanh as many as their
    implementations in ``kernels/`` evaluate). ``bytes``: compulsory traffic of ONE call,
    every operand element read once and every output element written once (a row that a
    kernel sweeps twice while it sits in cache counts once). ``kind``: "matmul" (BLAS GEMM)
    or "vector". ``done``: the gradient group this call finishes (the model calls
    ``grads.done(done)`` right after it), so ZeRO-2's reduce-scatter of that group can be
    placed at this point of the simulated backward.
    """

    name: str
    flops: float
    bytes: float
    kind: str
    phase: str  # "forward" | "backward"
    count: int = 1
    done: tuple[str, ...] = ()
    shape: tuple = ()  # GEMMs: (m, k, n, layout); BLAS efficiency depends on all four
    serial_flops: float = 0.0  # vector kernels: the part of flops that does not vectorise


def gemm(
    name: str, m: int, k: int, n: int, phase: str, count: int = 1, layout: str = "nn"
) -> KernelCost:
    """C[m, n] = A[m, k] @ B[k, n] in float32: 2mkn FLOPs, each operand moved once.
    ``layout``: "nn", or "nt" / "tn" where the kernel passes B / A as a transposed view
    (``np.dot(a, b.T, c)``: BLAS reads it with a transpose flag)."""
    flops, nbytes = 2.0 * m * k * n, 4.0 * (m * k + k * n + m * n)
    return KernelCost(name, flops, nbytes, "matmul", phase, count, shape=(m, k, n, layout))


def vector(
    name: str,
    flops: float,
    elements_moved: float,
    phase: str,
    count: int = 1,
    serial: float = 0.0,
) -> KernelCost:
    """An elementwise / row-wise float32 kernel moving ``elements_moved`` 4-byte elements.
    ``serial``: how many of its ``flops`` are row reductions (``rowops``' sums, dot
    products and maxima, a loop-carried chain per lane) or scalar libm calls (``np.exp``,
    ``np.log``): priced at the profile's ``scalar_tflops``, which calibrate measures on
    ``rowops.row_sum`` itself."""
    return KernelCost(
        name, float(flops), 4.0 * elements_moved, "vector", phase, count, serial_flops=serial
    )


class GradientViews(dict):
    """Plain gradient views (DP, ZeRO-1): the whole gradient lives in one flat buffer."""

    def done(self, names) -> None:
        """The model calls this when the gradients of ``names`` are final; nothing to do."""


class Model(Protocol):
    name: str

    def parameter_specs(self) -> list[ParamSpec]:
        """Parameters in the order they are laid out in the flat buffer."""

    def init_parameters(self, params: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """Fill the parameter views in place (same rng seed -> same weights on every rank)."""

    def allocate(self, batch_size: int) -> None:
        """Preallocate activations and workspace for micro-batches of ``batch_size``."""

    def forward(
        self, params: dict[str, np.ndarray], inputs: np.ndarray, targets: np.ndarray
    ) -> float:
        """Mean loss over the micro-batch; keeps what backward needs."""

    def backward(self, params: dict[str, np.ndarray], grads: GradientViews, dloss: float) -> None:
        """Overwrite every parameter gradient; ``dloss`` scales per-sample losses (1/B).

        ``grads[name]`` gives the buffer to write; after finishing a group of
        ``gradient_groups()`` the model calls ``grads.done(group.names)``.
        """

    def gradient_groups(self) -> list[GradientGroup]:
        """Gradient groups, in the order the backward pass finishes them."""

    def evaluate(
        self, params: dict[str, np.ndarray], inputs: np.ndarray, targets: np.ndarray
    ) -> tuple[float, int]:
        """(summed loss, number of correct predictions) over the batch, no backward state."""

    def activation_bytes(self, batch_size: int) -> int:
        """Bytes of the activation workspace ``allocate(batch_size)`` creates."""

    def flops_per_sample(self) -> int:
        """Forward + backward floating-point operations per sample (2 per multiply-add)."""

    def kernel_costs(self, batch: int, seq: int | None = None) -> list[KernelCost]:
        """The kernels forward + backward run on a micro-batch of ``batch`` samples (of
        ``seq`` tokens where the model has a sequence axis), in execution order."""
