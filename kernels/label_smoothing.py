"""Label-smoothed softmax cross-entropy (Szegedy et al. 2016; Vaswani et al. 2017, 5.4).

With smoothing eps over V classes the target distribution is (1 - eps) on the label plus
eps / V on every class (the label included), PyTorch's ``CrossEntropyLoss(label_smoothing)``.
Per row: loss = (1 - eps) (logZ - l_t) + eps (logZ - mean_v l_v), logZ = log sum exp l;
its gradient is softmax - (1 - eps) onehot - eps / V. Rows whose label is ``ignore`` (the
padding of variable-length targets) get loss 0 and, through a zero row weight, gradient 0.
Max, exp and sums are ``rowops``' (vectorised, float32), as in ``loss.py``.
"""

import numpy as np

from ._jit import kernel
from .rowops import exp_f32, row_max, row_sum

F32 = np.float32


@kernel
def smoothed_cross_entropy_forward(losses, probs, logits, targets, eps, ignore):
    """losses[N] (overwritten) and probs[N, V] = softmax(logits) for backward."""
    # losses: (N,); probs, logits: (N, V); targets: (N,) int32; eps: float32; ignore: int
    N, V = logits.shape
    one = F32(1.0)
    inv_v = one / F32(V)
    for n in range(N):
        row = logits[n]
        p = probs[n]
        maxv = row_max(row, V)
        mean = row_sum(row, V) * inv_v - maxv  # mean of the shifted logits
        for v in range(V):
            p[v] = exp_f32(row[v] - maxv)
        total = row_sum(p, V)
        for v in range(V):
            p[v] /= total
        t = targets[n]
        if t == ignore:
            losses[n] = F32(0.0)
        else:
            logz = np.log(total)
            losses[n] = (one - eps) * (logz - (row[t] - maxv)) + eps * (logz - mean)


@kernel
def smoothed_cross_entropy_backward(dlogits, probs, targets, weights, scale, eps):
    """dlogits[n] = (probs[n] - (1 - eps) onehot - eps / V) * weights[n] * scale (dlogits
    may be probs). weights (N,) float32: a row's share of its sample's loss (1 / the
    sample's label count; 0 on ignored rows); scale (float32): d(loss) of a sample."""
    N, V = probs.shape
    one = F32(1.0)
    u = eps / F32(V)
    for n in range(N):
        w = weights[n] * scale
        t = targets[n]
        p_t = probs[n, t]  # read before the row is overwritten (aliasing)
        for v in range(V):
            dlogits[n, v] = (probs[n, v] - u) * w
        dlogits[n, t] = (p_t - u - (one - eps)) * w


def _warm() -> None:
    """Compile (or load from cache): 2-D C float32 logits, int32 targets, float32 weights."""
    logits = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]], F32)
    targets = np.array([2, 0], np.int32)
    losses = np.empty(2, F32)
    probs = np.empty_like(logits)
    smoothed_cross_entropy_forward(losses, probs, logits, targets, F32(0.1), 0)
    smoothed_cross_entropy_backward(probs, probs, targets, np.ones(2, F32), F32(0.5), F32(0.1))
