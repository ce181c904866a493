"""BERT's input embedding: word + position + token-type (segment), and its backward.

GPT-2's two-table embedding is ``embedding.py``. Here a third table adds the segment
(sentence A / B) and the word table's padding row gets no gradient, as PyTorch's
``nn.Embedding(padding_idx=...)`` does (the row stays as initialised, zero).
"""

import numpy as np

from ._jit import kernel


@kernel
def segment_embedding_forward(out, tokens, types, wte, wpe, wtt):
    """out[b,t] = wte[tokens[b,t]] + wpe[t] + wtt[types[b,t]]."""
    # out: (B, T, C); tokens, types: (B, T) int32; wte: (V, C); wpe: (P, C); wtt: (S, C)
    B, T, C = out.shape
    for b in range(B):
        for t in range(T):
            ix = tokens[b, t]
            s = types[b, t]
            o = out[b, t]
            for c in range(C):
                o[c] = wte[ix, c] + wpe[t, c] + wtt[s, c]


@kernel
def segment_embedding_backward_accumulate(dwte, dwpe, dwtt, dout, tokens, types, pad):
    """ADDS dout into the rows of all three tables; tokens == pad add nothing to dwte."""
    B, T, C = dout.shape
    for b in range(B):
        for t in range(T):
            ix = tokens[b, t]
            s = types[b, t]
            g = dout[b, t]
            if ix != pad:
                for c in range(C):
                    dwte[ix, c] += g[c]
            for c in range(C):
                dwpe[t, c] += g[c]
                dwtt[s, c] += g[c]


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the models use."""
    tokens = np.zeros((1, 2), dtype=np.int32)
    wte = np.zeros((3, 4), dtype=np.float32)
    wpe = np.zeros((2, 4), dtype=np.float32)
    wtt = np.zeros((2, 4), dtype=np.float32)
    out = np.zeros((1, 2, 4), dtype=np.float32)
    segment_embedding_forward(out, tokens, tokens, wte, wpe, wtt)
    segment_embedding_backward_accumulate(wte, wpe, wtt, out, tokens, tokens, 0)
