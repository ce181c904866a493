"""Saved activations as 16-bit words between forward and backward (mixed precision).

A device training in bf16 / fp16 holds the activations its backward reads at two bytes
each. On the host the kernels compute in float32 words holding half values (exact), so a
model keeps a few layers' float32 *working copies* of each saved per-layer tensor and, once
layer i's tensor is final, packs it into a uint16 store; backward unpacks it into the
working copy again before it reads it. Packing is exact (the kernels stored half values),
so the results are bit for bit those of float32 words (GPT-2, BERT).
"""

from __future__ import annotations

import math

import numpy as np

from simdist.kernels.half import pack_half, unpack_half


class SavedWords:
    """The uint16 store of a model's per-layer saved tensors and, per layer, the float32
    working copy each is packed from and unpacked into."""

    def __init__(
        self,
        words: np.ndarray,
        offsets: dict[str, int],
        shapes: dict[str, tuple[int, ...]],
        fmt: int,
    ):
        """``shapes``: every packed tensor's (layers, ...) shape; ``offsets``: where it
        starts in ``words``; ``fmt``: the half format (``simdist.precision``)."""
        self.fmt = fmt
        self._saved = {
            name: list(words[offsets[name] : offsets[name] + math.prod(s)].reshape(s[0], -1))
            for name, s in shapes.items()
        }
        self._work: dict[str, list[np.ndarray]] = {}

    def working(self, name: str, copies: np.ndarray) -> list[np.ndarray]:
        """Layer i's view of tensor ``name``: working copy i % w of ``copies`` (w copies on
        its first axis). Layers i and i + w share one, so layer i must be packed first."""
        w = copies.shape[0]
        views = [copies[i % w] for i in range(len(self._saved[name]))]
        self._work[name] = [a.reshape(-1) for a in views]
        return views

    def pack(self, i: int, names: tuple[str, ...]) -> None:
        """Layer i's tensors ``names``, now final, into the store."""
        for name in names:
            pack_half(self._saved[name][i], self._work[name][i], self.fmt)

    def unpack(self, i: int, names: tuple[str, ...]) -> None:
        """Layer i's tensors ``names`` back into their working copies (exact)."""
        for name in names:
            unpack_half(self._work[name][i], self._saved[name][i], self.fmt)


def aligned_layout(sizes: dict[str, int], align: int) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total elements), each tensor starting at a multiple of
    ``align`` elements (its own cache line)."""
    offsets, total = {}, 0
    for name, n in sizes.items():
        offsets[name] = total
        total += -(-n // align) * align
    return offsets, total
