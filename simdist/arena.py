"""One flat float32 buffer per kind of state, carved into named views.

Parameters, gradients and optimizer state each live in ONE contiguous buffer with the same
``Layout``: collectives and the optimizer treat the model as a single vector, and ZeRO is
just "which slice". The buffer is padded to a multiple of ``world * align`` elements so that
every rank owns an equal, aligned slice; those slice boundaries are the chunk boundaries of
the all-reduce too, which makes data parallelism and ZeRO bit-identical by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .models.base import ParamSpec

ALIGN = 16  # elements (64 bytes): slice starts stay cache-line and SIMD aligned


@dataclass(frozen=True)
class Segment:
    """A piece of one parameter tensor inside a flat range: buffer[lo:hi] is name[start:...]."""

    name: str
    lo: int
    hi: int
    weight_decay: bool


class Layout:
    def __init__(self, specs: list[ParamSpec], world: int, align: int = ALIGN):
        self.specs = list(specs)
        self.world = world
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate parameter names in the model's parameter_specs")
        self.offsets: dict[str, int] = {}
        offset = 0
        for s in self.specs:
            self.offsets[s.name] = offset
            offset += s.numel
        self.numel = offset  # real parameters (unpadded)
        quantum = world * align
        self.padded = -(-max(offset, 1) // quantum) * quantum
        self.shard_size = self.padded // world
        # Partition bounds shared by ZeRO slices and the all-reduce's reduce-scatter.
        self.bounds = np.arange(world + 1, dtype=np.int64) * self.shard_size
        self.bounds.flags.writeable = False  # fixed for the run (collectives cache by it)

    def shard(self, rank: int) -> tuple[int, int]:
        return int(self.bounds[rank]), int(self.bounds[rank + 1])

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        if flat.shape != (self.padded,):
            raise ValueError(f"flat buffer has shape {flat.shape}, layout needs ({self.padded},)")
        return {
            s.name: flat[self.offsets[s.name] : self.offsets[s.name] + s.numel].reshape(s.shape)
            for s in self.specs
        }

    def segments(self, lo: int, hi: int) -> list[Segment]:
        """Parameter pieces inside [lo, hi), in order; padding is left out."""
        out = []
        for s in self.specs:
            a, b = self.offsets[s.name], self.offsets[s.name] + s.numel
            a, b = max(a, lo), min(b, hi)
            if a < b:
                out.append(Segment(s.name, a, b, s.weight_decay))
        return out

    def describe(self) -> dict:
        """Metadata stored with checkpoints so shards can be rebuilt at any world size."""
        return {
            "numel": self.numel,
            "padded": self.padded,
            "world": self.world,
            "names": [s.name for s in self.specs],
            "shapes": [list(s.shape) for s in self.specs],
            "offsets": [self.offsets[s.name] for s in self.specs],
        }
