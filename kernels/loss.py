"""Softmax + cross-entropy over the last axis of (B, V) float32 logits, int32 targets.

Forward keeps the probabilities for backward; the per-sample loss is
``log(sum_v exp(l_v - max)) - (l_t - max)``, which stays finite even when the target's
probability underflows to 0 in float32 (``-log(prob)`` would give inf). Sums are float32:
each term is in (0, 1] after the max shift, so for V up to ~50k the relative rounding
error stays around 1e-6 (checked against float64 in the tests). The max, exp and sum
vectorise: ``rowops``' maxima and sums (32 lanes) and its ``exp_f32`` (within 2 ulp;
libm's ``expf`` is called one element at a time), each row swept while it sits in L1.
"""

import numpy as np

from ._jit import kernel
from .rowops import exp_f32, row_max, row_sum

F32 = np.float32


@kernel
def softmax_cross_entropy_forward(losses, probs, logits, targets):
    """losses[B] = -log softmax(logits[B,V])[targets[B]], probs[B,V] = softmax (overwritten)."""
    B, V = logits.shape
    for b in range(B):
        row = logits[b]
        p = probs[b]
        maxv = row_max(row, V)
        for v in range(V):
            p[v] = exp_f32(row[v] - maxv)
        total = row_sum(p, V)
        for v in range(V):
            p[v] /= total  # a true division: correctly rounded, unlike * (1/total)
        losses[b] = np.log(total) - (row[targets[b]] - maxv)


@kernel
def softmax_cross_entropy_backward(dlogits, probs, targets, dloss):
    """dlogits[B,V] = (probs - onehot(targets)) * dloss; dlogits may alias probs.

    dloss (float32) scales every row: 1/B for a mean loss, 1/B_local for a data-parallel
    rank whose gradients are later averaged.
    """
    B, V = probs.shape
    d = F32(dloss)  # a float64 caller costs one truncation, not float64 arithmetic
    one = F32(1.0)
    for b in range(B):
        t = targets[b]
        p_t = probs[b, t]  # read before the row is overwritten (aliasing)
        for v in range(V):
            dlogits[b, v] = probs[b, v] * d
        dlogits[b, t] = (p_t - one) * d


# numpy's float32 -> float64 sum: casts in buffers of 8192 elements, each summed pairwise
# (blocks of at most 128 over 8 accumulators, halves above), the buffers' sums in order
_NUMPY_BUFFER, _PAIRWISE_BLOCK = 8192, 128


@kernel
def _pairwise_sum(x, lo, n):
    """numpy's pairwise_sum of x[lo:lo + n] in float64, operation for operation."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += np.float64(x[i])
        return res
    if n <= _PAIRWISE_BLOCK:
        f = np.float64
        r0, r1, r2, r3 = f(x[lo]), f(x[lo + 1]), f(x[lo + 2]), f(x[lo + 3])
        r4, r5, r6, r7 = f(x[lo + 4]), f(x[lo + 5]), f(x[lo + 6]), f(x[lo + 7])
        end = n - n % 8
        for i in range(lo + 8, lo + end, 8):
            r0, r1, r2, r3 = r0 + f(x[i]), r1 + f(x[i + 1]), r2 + f(x[i + 2]), r3 + f(x[i + 3])
            r4, r5, r6, r7 = r4 + f(x[i + 4]), r5 + f(x[i + 5]), r6 + f(x[i + 6]), r7 + f(x[i + 7])
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        for i in range(end, n):
            res += np.float64(x[lo + i])
        return res
    half = n // 2
    half -= half % 8
    return _pairwise_sum(x, lo, half) + _pairwise_sum(x, lo + half, n - half)


@kernel
def mean_loss(losses):
    """The mean of float32 ``losses`` (1-D, contiguous) in float64: bitwise
    ``losses.mean(dtype=np.float64)`` (numpy's order, tested), in one compiled call instead
    of numpy's dozen Python-level steps, which cost 10-30 us between a step's kernels."""
    n = losses.size
    res = 0.0
    for lo in range(0, n, _NUMPY_BUFFER):
        res += _pairwise_sum(losses, lo, min(_NUMPY_BUFFER, n - lo))
    return res / n


def _warm() -> None:
    """Compile (or load from cache): 2-D C float32 logits, 1-D int32 targets, float32 dloss."""
    logits = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]], F32)
    targets = np.array([2, 0], np.int32)
    losses = np.empty(2, F32)
    probs = np.empty_like(logits)
    softmax_cross_entropy_forward(losses, probs, logits, targets)
    softmax_cross_entropy_backward(probs, probs, targets, F32(0.5))
    mean_loss(losses)
    _pairwise_sum(losses, 0, 2)  # its callee too: its dispatcher then carries a signature
