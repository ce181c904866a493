"""Token + position embedding of GPT-2 (the model's input layer).

Not the LM head: the output projection that reuses ``wte`` lives in ``matmul.py``. Because
the two share ``wte``, the head's backward writes ``dwte`` first and the backward here adds
the embedding's share on top, hence ``embedding_backward_accumulate``.
"""

import numpy as np

from ._jit import kernel


@kernel
def embedding_forward(out, tokens, wte, wpe):
    """out[b,t,:] = wte[tokens[b,t]] + wpe[t]."""
    # out: (B, T, C); tokens: (B, T) int32; wte: (V, C); wpe: (maxT, C), T <= maxT
    B, T, C = out.shape
    for b in range(B):
        for t in range(T):
            ix = tokens[b, t]
            for c in range(C):
                out[b, t, c] = wte[ix, c] + wpe[t, c]


@kernel
def embedding_backward_accumulate(dwte, dwpe, dout, tokens):
    """dwte[tokens[b,t]] += dout[b,t] and dwpe[t] += dout[b,t]: both ADD into what is there."""
    # dwte: (V, C); dwpe: (maxT, C); dout: (B, T, C); tokens: (B, T) int32
    B, T, C = dout.shape
    for b in range(B):
        for t in range(T):
            ix = tokens[b, t]
            for c in range(C):
                d = dout[b, t, c]
                dwte[ix, c] += d
                dwpe[t, c] += d


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    tokens = np.zeros((1, 2), dtype=np.int32)
    wte = np.zeros((3, 4), dtype=np.float32)
    wpe = np.zeros((2, 4), dtype=np.float32)
    out = np.zeros((1, 2, 4), dtype=np.float32)
    embedding_forward(out, tokens, wte, wpe)
    embedding_backward_accumulate(wte, wpe, out, tokens)
