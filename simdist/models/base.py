"""What every simdist model provides to the training loop.

A model owns no parameter memory: the loop hands it named views into ONE flat parameter
buffer and ONE flat gradient buffer (see ``simdist.arena``), so data parallelism and ZeRO can
treat all parameters as a single vector. The model does own its activation workspace,
allocated once for a fixed micro-batch size, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class ParamSpec:
    name: str  # checkpoint name, e.g. "fc1.weight" or "h.0.attn.c_attn.weight"
    shape: tuple[int, ...]
    weight_decay: bool  # False for biases and norm gains/offsets

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


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

    def backward(
        self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], dloss: float
    ) -> None:
        """Overwrite every parameter gradient; ``dloss`` scales per-sample losses (1/B)."""

    def evaluate(
        self, params: dict[str, np.ndarray], inputs: np.ndarray, targets: np.ndarray
    ) -> tuple[float, int]:
        """(summed loss, number of correct predictions) over the batch, no backward state."""

    def activation_bytes(self, batch_size: int) -> int:
        """Bytes of the activation workspace ``allocate(batch_size)`` creates."""

    def flops_per_sample(self) -> int:
        """Forward + backward floating-point operations per sample (2 per multiply-add)."""
