"""Saved activations as 16-bit words between forward and backward (mixed precision).

A device training in bf16 / fp16 holds the activations its backward reads at two bytes
each. On the host the kernels compute in float32 words holding half values (exact), so a
model keeps a few layers' float32 *working copies* of each saved per-layer tensor and, once
layer i's tensor is final, packs it into a uint16 store; backward unpacks it into the
working copy again before it reads it. Packing is exact (the kernels stored half values),
so the results are bit for bit those of float32 words (GPT-2, BERT, T5, the Transformer).
The device's accounting (``activation_bytes``) stays the float32 layout;
``host_activation_bytes`` is what the host holds.
"""

from __future__ import annotations

import math
import os

import numpy as np

from simdist.config import ConfigError
from simdist.kernels.half import pack_half, unpack_half
from simdist.precision import precision_store


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


PACK_MODES = ("auto", "1", "0")


class PacksSavedActivations:
    """Mixin of a model whose arena has a packed variant (GPT-2 and its tensor-parallel
    shards, BERT, T5, the Transformer): in mixed precision, where it takes less host
    memory, the arena holds working copies and a uint16 store beside it holds every
    layer's saved tensors. The model provides
    ``_arena_layout(batch_size, packed)`` and ``_store_layout(batch_size)``, each
    (offsets, total elements), and ``activation_bytes`` (the device's layout)."""

    # mixed precision: hold the layers' saved activations as 16-bit words
    packs_saved_activations = True
    _half_fmt = 0  # the half format of the 16-bit store (0: none)
    _words: np.ndarray | None = None
    _words_offsets: dict[str, int] = {}
    _arena: np.ndarray | None = None
    _batch = 0

    def set_precision(self, precision) -> None:
        """Train in ``precision`` (``simdist.precision.Precision``): every activation and
        activation gradient the kernels write is stored in its half format, and the saved
        ones are held as 16-bit words (``packs_saved_activations``) where that takes less
        host memory (with few layers the working copies cost more than the store saves).
        ``SIMDIST_PACK_ACTIVATIONS``: auto (that rule, the default), 1 (16-bit words
        wherever the model can hold them) or 0 (float32 words); the bits are the same."""
        self._store = precision_store(precision)
        mode = os.environ.get("SIMDIST_PACK_ACTIVATIONS", "auto")
        if mode not in PACK_MODES:
            raise ConfigError(f"SIMDIST_PACK_ACTIVATIONS={mode!r}: use auto, 1 or 0")
        fmt = precision.fmt if precision.half and self.packs_saved_activations else 0
        if mode == "0" or (
            fmt and mode == "auto" and self._packed_bytes(1) >= 4 * self._arena_layout(1, False)[1]
        ):
            fmt = 0
        if fmt != self._half_fmt:
            self._half_fmt = fmt
            if self._arena is not None:  # the layout changes: allocate again
                self.allocate(self._batch)

    def host_activation_bytes(self, batch_size: int) -> int:
        """What ``allocate(batch_size)`` takes on the host: the arena, and in mixed
        precision with packing its working copies and the 16-bit store instead."""
        if not self._half_fmt:
            return self.activation_bytes(batch_size)
        return self._packed_bytes(batch_size)

    def _packed_bytes(self, batch_size: int) -> int:
        return 4 * self._arena_layout(batch_size, True)[1] + 2 * self._store_layout(batch_size)[1]

    def _allocate_arena(self, batch_size: int) -> None:
        """The arena (and in mixed precision with packing the 16-bit store) for
        micro-batches of up to ``batch_size``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        packed = bool(self._half_fmt)
        self._offsets, total = self._arena_layout(batch_size, packed)
        self._arena = np.zeros(total, dtype=np.float32)
        self._words, self._words_offsets = None, {}
        if packed:
            self._words_offsets, n = self._store_layout(batch_size)
            self._words = np.zeros(n, dtype=np.uint16)
        self._batch = batch_size

    def _store_of(self) -> tuple[np.ndarray, dict[str, int], int] | None:
        """What a views object packs into: (store, its offsets, half format), or None."""
        if self._words is None:
            return None
        return self._words, self._words_offsets, self._half_fmt


class SavedWordsViews:
    """Mixin of a model's arena views: ``pack`` / ``unpack`` through their ``SavedWords``
    (``_words``; None: float32 words, and both are no-ops)."""

    _words: SavedWords | None = None

    def pack(self, i: int, names: tuple[str, ...]) -> None:
        """Layer i's tensors ``names`` into the 16-bit store (no-op unless packed)."""
        if self._words is not None:
            self._words.pack(i, names)

    def unpack(self, i: int, names: tuple[str, ...]) -> None:
        """Layer i's tensors ``names`` back into their working copies (exact)."""
        if self._words is not None:
            self._words.unpack(i, names)
