"""Mixed precision's weights as an accelerator holds them: 16-bit words, two bytes each.

In bf16 / fp16 the weights are the optimizer's fp32 master rounded to the half format
(``simdist.precision``). At ZeRO levels 0-2 every rank holds every weight; for a model with
stages (``simdist.models.stages``: every model simdist ships) the run keeps them here as
16-bit words, 2Ψ bytes on the host as on the device, and each stage computes from a float32
window its groups are unpacked into just before it runs: ZeRO-3's windows (``simdist.parallel``),
loaded by unpacking instead of by an all-gather, so one window and no prefetch. Unpacking
is exact, so a stage reads the float32 values the float32 words held before and the run's
bits do not change. The host holds 2Ψ + 4W bytes (W: the largest stage's parameters)
instead of 4Ψ, less wherever W < Ψ / 2 (``chosen``: GPT-2, BERT, T5 and the Transformer,
whose blocks are small next to the model; not fc_mnist, whose first layer is 60 % of it).

Who writes the words: initialisation (one tensor at a time, ``fill_tensors``), the
optimizer (its range of the master, rounded, ``store``), ZeRO-1/2's all-gather (the words
as they are, two per float32 element of the collective) and the checkpoint reader
(``write``).
"""

from __future__ import annotations

import os

import numpy as np

from simdist.kernels.half import pack_half, unpack_half

from .arena import Layout
from .config import ConfigError
from .parallel import StageWindows, fill_tensors
from .param_gather import GatherPlan
from .precision import read_words, write_words

MODES = ("auto", "1", "0")


def packing_mode() -> str:
    """``SIMDIST_PACK_WEIGHTS``: auto (the default), 1 or 0 (a bad value: ConfigError)."""
    mode = os.environ.get("SIMDIST_PACK_WEIGHTS", "auto")
    if mode not in MODES:
        raise ConfigError(f"SIMDIST_PACK_WEIGHTS={mode!r}: use auto, 1 or 0")
    return mode


def pays(numel: int, window: int) -> bool:
    """16-bit words of ``numel`` weights and one float32 window of ``window`` elements take
    fewer host bytes than float32 words (2Ψ + 4W < 4Ψ)."""
    return 2 * numel + 4 * window < 4 * numel


def chosen(layout: Layout, model) -> bool:
    """Whether a mixed-precision run at ZeRO 0-2 keeps its weights as 16-bit words.
    ``SIMDIST_PACK_WEIGHTS``: auto (the default) where 16-bit words and one float32 window
    of the largest stage take fewer host bytes than float32 words (2Ψ + 4W < 4Ψ); 1
    wherever the model has stages; 0 never (the bits are the same either way)."""
    mode = packing_mode()
    if mode == "0" or not hasattr(model, "stages"):
        return False
    plan = GatherPlan(layout, model.stages(), model.gradient_groups())
    return mode == "1" or pays(layout.padded, plan.window)


class PackedParameters(StageWindows):
    """The weights of every rank as 16-bit words of format ``fmt`` (``words``: uint16, one
    per flat element of ``layout``), read by the model's stages through float32 windows
    (host working copies, like GPT-2's activation working copies: the device reads the
    words themselves, so its memory accounts only ``words``)."""

    def __init__(self, layout: Layout, model, words: np.ndarray, fmt: int):
        if words.dtype != np.uint16 or words.shape != (layout.padded,):
            raise ValueError(f"words must be uint16 of shape ({layout.padded},)")
        super().__init__(layout, model, lambda n: np.zeros(n, np.float32), count=1)
        self.words, self.fmt = words, fmt
        self.loads = 0  # groups unpacked so far (tests)

    def _load(self, g, region: np.ndarray) -> None:
        unpack_half(region, self.words[g.a : g.b], self.fmt)
        self.loads += 1

    @property
    def host_bytes(self) -> int:
        """Bytes on this host: the words and the float32 window."""
        return self.words.nbytes + sum(w.nbytes for w in self.windows)

    def initialize(self, init, rng, master: np.ndarray, lo: int) -> None:
        """Run ``init(params, rng)`` (the model's ``init_parameters``) one tensor at a time:
        the words get each tensor's half rounding, ``master`` (the fp32 master of flat
        range [lo, lo + master.size)) its float32 values."""
        hi = lo + master.size

        def write(name: str, value: np.ndarray) -> None:
            self.write(self.layout.offsets[name], value.reshape(-1), master, lo)

        fill_tensors(init, rng, self._numel, write)
        self.cache.invalidate()
        if hi > self.layout.numel:  # the padding: zero in the master as in the words
            master[max(self.layout.numel - lo, 0) :] = 0.0

    def write(self, a: int, values: np.ndarray, master: np.ndarray | None, lo: int) -> None:
        """Flat elements [a, a + values.size) are ``values`` (float32): their half rounding
        into the words and, where they fall in the master's range [lo, lo + master.size),
        the values themselves into the master (a checkpoint whose master is saved
        overwrites it afterwards)."""
        write_words(self.words, 0, a, values, self.fmt, master, lo)
        self.cache.invalidate()

    def store(self, lo: int, master: np.ndarray) -> None:
        """The optimizer updated ``master`` (flat range [lo, lo + master.size)): the words
        become its half rounding (round to nearest even), and every window is stale."""
        pack_half(self.words[lo : lo + master.size], master, self.fmt)
        self.cache.invalidate()

    def unpack(self, lo: int, hi: int) -> np.ndarray:
        """Flat range [lo, hi) as float32 values (a new array)."""
        return read_words(self.words[lo:hi], self.fmt)

    def tensors(self) -> UnpackedTensors:
        """Every parameter by name as float32, one at a time (the checkpoint writer)."""
        return UnpackedTensors(self)


class UnpackedTensors:
    """``items()``: each parameter (name, ``UnpackedTensor``), unpacked as it is written."""

    def __init__(self, packed: PackedParameters):
        self.packed = packed

    def items(self):
        p = self.packed
        for spec in p.layout.specs:
            yield spec.name, UnpackedTensor(p, p.layout.offsets[spec.name], spec.shape)


class UnpackedTensor:
    """One parameter as float32, unpacked block by block into the checkpoint writer's
    dataset (``write_to``), so no float32 copy of a large tensor (GPT-2's or BERT's token
    embedding) adds to the peak; ``np.asarray`` gives the whole tensor."""

    BLOCK = 1 << 20  # elements unpacked per write (4 MiB of float32)

    def __init__(self, packed: PackedParameters, lo: int, shape: tuple[int, ...]):
        self.packed, self.lo, self.shape = packed, lo, tuple(shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))

    def write_to(self, dataset) -> None:
        """Fill ``dataset`` (this shape, float32; an h5py dataset) in blocks of rows."""
        rows = self.shape[0] if self.shape else 1
        row = self.size // rows if rows else 0
        step = max(1, self.BLOCK // max(row, 1))
        for r in range(0, rows, step):
            e = min(rows, r + step)
            block = self.packed.unpack(self.lo + r * row, self.lo + e * row)
            if self.shape:
                dataset[r:e] = block.reshape((e - r, *self.shape[1:]))
            else:
                dataset[()] = block.reshape(())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.packed.unpack(self.lo, self.lo + self.size).reshape(self.shape)
        return out if dtype is None else out.astype(dtype)
