"""T5's relative-position bias: bucketed query-key offsets, one learned scalar per head.

The bucket of an offset (key position minus query position) follows Hugging Face's
``T5Attention._relative_position_bucket``: half of the buckets for each sign when
bidirectional (encoder), only the past when not (decoder); offsets below
``max_exact = buckets / 2`` get their own bucket, larger ones share buckets spaced
logarithmically up to ``max_distance``, beyond which all share the last. The logarithm is
evaluated in float32 as PyTorch does, with log(max_distance / max_exact) passed in
(PyTorch takes it in float64 and rounds it once): exact-integer cases such as offset 16
with 32 buckets then land where Hugging Face puts them.

The table (buckets, heads) lives in the first layer of each stack and its bias is shared
by all the stack's layers (T5): ``relpos_bias_forward`` expands it once per step into the
(heads, Tq, Tk) bias the attention adds to its scores, and ``relpos_bias_backward`` folds
the summed score gradients of all the layers back into the one table.
"""

import numpy as np

from ._jit import kernel

F32 = np.float32


@kernel
def relpos_buckets(out, bidirectional, num_buckets, max_distance_log, max_exact_div):
    """out[t, j] = bucket of offset j - t (int32), Hugging Face's bucketing.

    ``max_distance_log`` is float32(log(max_distance / max_exact)) and ``max_exact_div``
    float32(max_exact); both come from the caller (``bucket_args``)."""
    # out: (Tq, Tk) int32
    Tq, Tk = out.shape
    nb = num_buckets // 2 if bidirectional else num_buckets
    max_exact = nb // 2
    span = F32(nb - max_exact)
    for t in range(Tq):
        for j in range(Tk):
            rel = j - t
            bucket = 0
            if bidirectional:
                if rel > 0:
                    bucket = nb
                rel = abs(rel)
            else:
                rel = -min(rel, 0)
            if rel < max_exact:
                bucket += rel
            else:
                r = np.log(F32(rel) / max_exact_div) / max_distance_log * span
                large = max_exact + np.int64(r)
                bucket += min(large, nb - 1)
            out[t, j] = np.int32(bucket)


def bucket_args(num_buckets: int, max_distance: int, bidirectional: bool) -> tuple:
    """(max_distance_log, max_exact_div) for ``relpos_buckets``, rounded as PyTorch rounds."""
    import math

    nb = num_buckets // 2 if bidirectional else num_buckets
    max_exact = nb // 2
    return F32(math.log(max_distance / max_exact)), F32(max_exact)


@kernel
def relpos_bias_forward(bias, table, buckets):
    """bias[h, t, j] = table[buckets[t, j], h] (overwritten)."""
    # bias: (NH, Tq, Tk); table: (num_buckets, NH); buckets: (Tq, Tk) int32
    NH, Tq, Tk = bias.shape
    for h in range(NH):
        for t in range(Tq):
            for j in range(Tk):
                bias[h, t, j] = table[buckets[t, j], h]


@kernel
def relpos_bias_backward(dtable, dbias, buckets):
    """dtable[b, h] = sum of dbias[h, t, j] over the (t, j) in bucket b (overwritten)."""
    NH, Tq, Tk = dbias.shape
    dtable[:] = F32(0.0)
    for h in range(NH):
        for t in range(Tq):
            for j in range(Tk):
                dtable[buckets[t, j], h] += dbias[h, t, j]


def _warm() -> None:
    """Compile (or load from the cache) with the dtypes and layouts the model uses."""
    buckets = np.zeros((2, 3), np.int32)
    for bi in (True, False):
        relpos_buckets(buckets, bi, 32, *bucket_args(32, 128, bi))
    table = np.ones((32, 2), np.float32)
    bias = np.zeros((2, 2, 3), np.float32)
    relpos_bias_forward(bias, table, buckets)
    relpos_bias_backward(table, bias, buckets)
