"""Sinusoidal positions and the scaled token embedding of the AIAYN Transformer.

Vaswani et al. 2017, section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i + 1) =
cos(pos / 10000^(2i/d)), added to the token embedding, which section 3.4 multiplies by
sqrt(d_model) (the same table, unscaled, is the output projection). The table has no
parameters: ``sinusoid_table`` builds it once (float64 arithmetic, rounded to float32), and
the kernels read it as an explicit buffer.
"""

import numpy as np

from ._jit import kernel

F32 = np.float32


def sinusoid_table(out: np.ndarray) -> None:
    """Fill out (T, D) float32 with the paper's positional encodings (D even or odd)."""
    T, D = out.shape
    pos = np.arange(T, dtype=np.float64)[:, None]
    freq = 10000.0 ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    out[:, 0::2] = np.sin(pos * freq)
    out[:, 1::2] = np.cos(pos * freq[: D // 2])


@kernel
def scaled_embedding_forward(out, ids, table, scale, pe):
    """out[b, t] = table[ids[b, t]] * scale + pe[t]."""
    # out: (B, T, C); ids: (B, T) int32; table: (V, C); scale: float32; pe: (>= T, C)
    B, T, C = out.shape
    for b in range(B):
        for t in range(T):
            row = table[ids[b, t]]
            o = out[b, t]
            p = pe[t]
            for c in range(C):
                o[c] = row[c] * scale + p[c]


@kernel
def scaled_embedding_backward_accumulate(dtable, dout, ids, scale):
    """dtable[ids[b, t]] += dout[b, t] * scale (ADDS: a tied head or the other stack's
    embedding wrote its share first)."""
    # dtable: (V, C); dout: (B, T, C); ids: (B, T) int32; scale: float32
    B, T, C = dout.shape
    for b in range(B):
        for t in range(T):
            row = dtable[ids[b, t]]
            d = dout[b, t]
            for c in range(C):
                row[c] += d[c] * scale


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the models use."""
    table = np.ones((4, 3), F32)
    pe = np.zeros((2, 3), F32)
    sinusoid_table(pe)
    ids = np.array([[1, 3]], np.int32)
    out = np.zeros((1, 2, 3), F32)
    scaled_embedding_forward(out, ids, table, F32(2.0), pe)
    scaled_embedding_backward_accumulate(table, out, ids, F32(2.0))
