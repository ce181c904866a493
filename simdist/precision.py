"""Training precision: fp32, or mixed bf16 / fp16 as accelerators train.

Mixed precision, as simdist emulates it on the CPU (the same contract as the PyTorch
reference in tests/test_precision.py):

- the optimizer keeps an fp32 **master** copy of the parameters it updates (its own
  optimizer-state buffer, so ZeRO-1/2 partition it with the moments);
- the **weights** the model computes with are the master rounded to the half format
  (round to nearest even), refreshed after every update;
- every **activation** a layer stores, and every activation gradient, is rounded to the half
  format where it is written, while each kernel computes in float32 internally;
- every **matrix product** takes half operands and accumulates in float32 (the product of
  two halves is exact in float32), as tensor cores do: what enters a GEMM is a stored half
  (attention rounds its float32 probabilities and score gradients there, as FlashAttention
  does), so the float32 BLAS multiplies it as it is; ``kernels.blas.half_operands`` selects
  a native bf16 kernel (oneMKL on Intel, oneDNN elsewhere: AMX / AVX512_BF16) where one is
  installed, and ``SIMDIST_HALF_GEMM_CHECK=1`` verifies every operand is a half value;
- the **parameter gradients** are rounded to the half format (after accumulation over
  micro-batches in float32) and reduced in it: every message carries 16-bit words and
  every partial sum is rounded, unless ``runconfig.fp32_allreduce`` (then float32 on the
  wire and no rounding of the sums);
- fp16 multiplies the loss by a **loss scale** (``simdist.loss_scale``) before backward; the
  gradients are divided by it before clipping and the update, and a step whose gradients
  overflow on any rank is skipped on every rank.

On the host, data parallelism's weights at ZeRO 0-2 are 16-bit words where the model has
stages and that takes less memory (``simdist.packed_params``: each stage reads a float32
window unpacked from them), and ZeRO-3's slices are 16-bit words (``simdist.parallel``);
GPT-2 holds its blocks' saved activations as 16-bit words between forward and backward
(``simdist.models.gpt2``); messages hold 16-bit words. Other weights and activations keep
their half values in float32 words (the kernels read float32; a native bf16 GEMM packs its
operands into 16-bit words as it goes). The simulated device
accounts all of them at two bytes (``simdist.memplan``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simdist.kernels.half import BF16, F16, pack_half, round_half, round_half_into, unpack_half

# accepted spellings: simdist's, and Lightning's precision flags
ALIASES = {
    "fp32": "fp32",
    "32": "fp32",
    "32-true": "fp32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "fp16": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
}


def canonical(name: object) -> str | None:
    """fp32 | bf16 | fp16 for an accepted spelling, else None."""
    return ALIASES.get(str(name).lower()) if isinstance(name, (str, int)) else None


@dataclass(frozen=True)
class Precision:
    """One run's precision. ``half``: the 16-bit format (None in fp32)."""

    name: str = "fp32"

    @property
    def half(self) -> str | None:
        return None if self.name == "fp32" else self.name

    @property
    def fmt(self) -> int:
        """The half format's number for the kernels (``kernels.half``)."""
        return BF16 if self.name == "bf16" else F16

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of the weights, activations and gradients on the device."""
        return 2 if self.half else 4

    def store(self, x: np.ndarray) -> None:
        """Round ``x`` in place to what the device stores (no-op in fp32)."""
        if self.half is None:
            return
        if not x.flags.c_contiguous:
            raise ValueError("precision.store needs a contiguous buffer (it rounds in place)")
        round_half(x.reshape(-1), self.fmt)

    def store_into(self, out: np.ndarray, x: np.ndarray) -> None:
        """out = x as the device stores it (out and x: flat float32 of one size)."""
        if self.half is None:
            np.copyto(out, x)
        else:
            round_half_into(out, x, self.fmt)


FP32 = Precision("fp32")


def no_store(*bufs: np.ndarray) -> None:
    """``precision_store`` in fp32: nothing to round."""


def precision_store(precision: Precision):
    """A function rounding each buffer it is given in place to ``precision``'s half format;
    in fp32 the no-op ``no_store`` (the fp32 path pays one call per tensor, nothing else)."""
    if precision.half is None:
        return no_store

    def store(*bufs: np.ndarray) -> None:
        for b in bufs:
            precision.store(b)

    return store


def write_words(
    words: np.ndarray,
    words_lo: int,
    a: int,
    values: np.ndarray,
    fmt: int,
    master: np.ndarray | None = None,
    master_lo: int = 0,
) -> None:
    """Flat elements [a, a + values.size) are ``values`` (float32): where they fall in the
    16-bit ``words`` (flat range from ``words_lo``), their half rounding; where they fall in
    the fp32 ``master`` (from ``master_lo``), the values themselves."""
    b = a + values.size
    for buf, lo, pack in ((words, words_lo, True), (master, master_lo, False)):
        if buf is None:
            continue
        s, e = max(a, lo), min(b, lo + buf.size)
        if e > s:
            if pack:
                pack_half(buf[s - lo : e - lo], values[s - a : e - a], fmt)
            else:
                buf[s - lo : e - lo] = values[s - a : e - a]


def read_words(words: np.ndarray, fmt: int) -> np.ndarray:
    """The float32 values of 16-bit ``words`` (a new array)."""
    out = np.empty(words.size, np.float32)
    unpack_half(out, words, fmt)
    return out
