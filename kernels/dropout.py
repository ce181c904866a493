"""Counter-based dropout: the mask of an element is a hash of where it is, not RNG state.

An element's keep/drop decision is ``hash(key[b], site, index) >= p``, where ``key[b]`` is
a 64-bit key of (seed, global step, sample index) made once per micro-batch by
``sample_keys`` and ``site`` names the dropout layer (layer number and which of its
dropouts). Nothing depends on the rank or the world size, so a sample gets the same mask
whichever replica draws it: data-parallel runs at any ZeRO level and a resumed run see
the same masks as an uninterrupted one. Backward recomputes the mask instead of storing it
(a hash per element, no extra memory).

The hash is SplitMix64's finaliser (Steele et al. 2014), a bijection on 64-bit integers
whose output passes BigCrush; its top 24 bits become a float32 in [0, 1).
"""

import numpy as np

from ._jit import kernel

F32 = np.float32
U64 = np.uint64
_GOLDEN = U64(0x9E3779B97F4A7C15)
_M1 = U64(0xBF58476D1CE4E5B9)
_M2 = U64(0x94D049BB133111EB)


@kernel
def mix64(z):
    """SplitMix64 finaliser of a uint64."""
    z = (z ^ (z >> U64(30))) * _M1
    z = (z ^ (z >> U64(27))) * _M2
    return z ^ (z >> U64(31))


@kernel
def site_key(key, site):
    """The key of one dropout site (layer, which dropout) for one sample."""
    # U64(...) on every input: a Python int arrives as int64, and int64 op uint64 would
    # compute in float64 in numba
    return mix64(U64(key) ^ mix64(U64(site) * _GOLDEN + U64(1)))


@kernel
def uniform_f32(key, index):
    """A float32 in [0, 1) from (site key, element index): 24 hashed bits times 2^-24."""
    bits = mix64(U64(key) + U64(index) * _GOLDEN) >> U64(40)
    return F32(np.int32(bits)) * F32(5.9604644775390625e-08)


def sample_keys(seed: int, step: int, samples: np.ndarray, out: np.ndarray) -> None:
    """out[b] = key of (seed, global step, sample index samples[b]), uint64, in place."""
    with np.errstate(over="ignore"):
        base = _mix_np(_mix_np(np.uint64(seed) + _GOLDEN) ^ np.uint64(step))
        out[:] = _mix_np(base ^ (samples.astype(np.uint64) * _GOLDEN + np.uint64(7)))


def _mix_np(z):
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


@kernel
def dropout_forward(out, inp, keys, site, p):
    """out[b] = inp[b] * mask / (1 - p) (out may be inp); rows are samples, flattened."""
    # out, inp: (B, n); keys: (B,) uint64; site: int; p: float32 in [0, 1)
    B, n = inp.shape
    scale = F32(1.0) / (F32(1.0) - p)
    zero = F32(0.0)
    for b in range(B):
        k = site_key(keys[b], site)
        o = out[b]
        x = inp[b]
        for i in range(n):
            o[i] = x[i] * scale if uniform_f32(k, i) >= p else zero


@kernel
def dropout_backward(dinp, dout, keys, site, p):
    """dinp = dout * mask / (1 - p) with the forward's mask (dinp may be dout)."""
    dropout_forward(dinp, dout, keys, site, p)


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the models use."""
    x = np.ones((2, 3), dtype=np.float32)
    keys = np.arange(2, dtype=np.uint64)
    dropout_forward(x, x, keys, 1, F32(0.1))
    dropout_backward(x, x, keys, 1, F32(0.1))
    # the helpers too, so their Python-visible dispatchers carry a signature (a caller
    # loaded from the cache never compiles them)
    uniform_f32(U64(1), 2)
    site_key(U64(1), 2)
    mix64(U64(3))
