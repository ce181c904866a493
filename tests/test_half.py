"""bfloat16 / float16 conversions against NumPy's float16 and PyTorch's bfloat16, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from simdist.kernels.half import from_bf16, from_f16, round_bf16, round_f16, to_bf16, to_f16


def _patterns() -> np.ndarray:
    """Every 2^8-th float32 bit pattern, plus each exponent's edges and the rounding ties."""
    rng = np.random.default_rng(0)
    strided = np.arange(0, 2**32, 2**8 + 1, dtype=np.uint64).astype(np.uint32)
    exps = (np.arange(256, dtype=np.uint32) << 23)[:, None]
    low = np.arange(0, 1 << 14, dtype=np.uint32)[None, :]
    edges = np.concatenate([(exps | low).ravel(), (exps | ((1 << 23) - 1 - low)).ravel()])
    ties = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32) & ~np.uint32(0x1FFF)
    # exact ties: float16 drops 13 bits (tie = 0x1000 below), bfloat16 drops 16 (0x8000)
    ties = np.concatenate([ties | 0x1000, (ties & ~np.uint32(0xFFFF)) | 0x8000])
    u = np.concatenate([strided, edges, ties])
    return np.concatenate([u, u | np.uint32(0x80000000)])


def test_f16_matches_numpy_bit_for_bit():
    x = _patterns().view(np.float32)
    got = np.empty(x.size, np.uint16)
    to_f16(got, x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()
    back = np.empty(x.size, np.float32)
    from_f16(back, got)
    assert np.array_equal(back[~nan], want[~nan].astype(np.float32))


def test_bf16_matches_pytorch_bit_for_bit():
    torch = pytest.importorskip("torch")
    x = _patterns().view(np.float32)
    got = np.empty(x.size, np.uint16)
    to_bf16(got, x)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    back = np.empty(x.size, np.float32)
    from_bf16(back, got)
    assert np.isnan(back[nan]).all()
    assert np.array_equal(back[~nan], (want[~nan].astype(np.uint32) << 16).view(np.float32))


def test_rounding_cases_by_hand():
    # bfloat16 keeps 8 significant bits: 1 + 2^-8 is a tie -> even (1.0); 1 + 3*2^-8 -> up
    assert round_bf16(np.float32(1 + 2**-8)) == 1.0
    assert round_bf16(np.float32(1 + 3 * 2**-8)) == np.float32(1 + 2**-6)
    assert round_f16(np.float32(65519.0)) == 65504.0
    assert np.isinf(round_f16(np.float32(65520.0)))
    assert round_f16(np.float32(2**-25)) == 0.0  # tie between 0 and the smallest subnormal
    assert round_f16(np.float32(1.5 * 2**-25)) == np.float32(2**-24)
    assert round_f16(np.float32(-(2**-24))) == np.float32(-(2**-24))


def test_in_place_rounding_equals_store_and_reload_bit_for_bit():
    """``round_half`` (the branch-free float16 path included), ``round_half_into`` and
    ``add_half``: the bits of converting to the half format and back, NaN payloads too."""
    from simdist.kernels.half import (
        BF16,
        F16,
        add_half,
        pack_half,
        round_half,
        round_half_into,
        unpack_half,
    )

    x = _patterns().view(np.float32)
    for fmt, to, back in ((BF16, to_bf16, from_bf16), (F16, to_f16, from_f16)):
        words = np.empty(x.size, np.uint16)
        to(words, x)
        want = np.empty(x.size, np.float32)
        back(want, words)
        got = x.copy()
        round_half(got, fmt)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), fmt
        into = np.empty_like(x)
        round_half_into(into, x, fmt)
        assert np.array_equal(into.view(np.uint32), want.view(np.uint32)), fmt
        packed = np.empty(x.size, np.uint16)
        pack_half(packed, x, fmt)
        assert np.array_equal(packed, words), fmt
        unpacked = np.empty_like(x)
        unpack_half(unpacked, words, fmt)
        assert np.array_equal(unpacked.view(np.uint32), want.view(np.uint32)), fmt
        # add_half: the sum of a value and a half word, stored half
        acc = want[::-1].copy()
        with np.errstate(over="ignore", invalid="ignore"):
            total = acc + want
        ref_words = np.empty(x.size, np.uint16)
        to(ref_words, total)
        ref = np.empty_like(x)
        back(ref, ref_words)
        add_half(acc, words, fmt)
        assert np.array_equal(acc.view(np.uint32), ref.view(np.uint32)), fmt
