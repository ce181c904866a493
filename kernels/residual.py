"""Residual connection: out = inp1 + inp2, elementwise on flat 1-D views.

Its backward is the identity on both inputs, so there is no kernel for it: the model keeps
one residual-stream gradient buffer that each branch's backward adds into. The GPT-2 model
itself uses ``layernorm.residual_layernorm_forward``, this add fused with the layernorm
that always follows it.
"""

import numpy as np

from ._jit import kernel


@kernel
def residual_forward(out, inp1, inp2):
    """out = inp1 + inp2; out may be the same array as either input."""
    # out, inp1, inp2: (n,)
    for i in range(out.shape[0]):
        out[i] = inp1[i] + inp2[i]


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    x = np.ones(3, dtype=np.float32)
    residual_forward(x, x, x)
