"""The distributed sampler: disjoint shares, per-epoch shuffling, remainder dropped."""

import numpy as np
import pytest

from simdist.data.sampler import DistributedSampler


@pytest.mark.parametrize("replicas,accum", [(1, 1), (2, 1), (3, 2), (4, 1)])
def test_each_sample_at_most_once_per_epoch(replicas, accum):
    n, g = 1000, 48
    samplers = [DistributedSampler(n, g, replicas, r, seed=3, accum=accum) for r in range(replicas)]
    spe = samplers[0].steps_per_epoch
    assert spe == n // g
    for epoch in range(2):
        seen = np.concatenate(
            [
                s.indices(step).ravel()
                for step in range(epoch * spe, (epoch + 1) * spe)
                for s in samplers
            ]
        )
        assert len(seen) == spe * g
        assert len(np.unique(seen)) == len(seen)  # no sample twice within an epoch
    assert samplers[0].indices(0).shape == (accum, g // (replicas * accum))


def test_union_of_replicas_equals_single_process_batch():
    single = DistributedSampler(500, 64, 1, 0, seed=7)
    parts = [DistributedSampler(500, 64, 4, r, seed=7) for r in range(4)]
    for step in (0, 5, 9, 23):
        union = np.concatenate([p.indices(step).ravel() for p in parts])
        np.testing.assert_array_equal(union, single.indices(step).ravel())


def test_shuffles_per_epoch_and_is_deterministic():
    a = DistributedSampler(100, 10, 1, 0, seed=1)
    b = DistributedSampler(100, 10, 1, 0, seed=1)
    assert not np.array_equal(a.indices(0), a.indices(10))  # epoch 0 vs epoch 1
    np.testing.assert_array_equal(a.indices(13), b.indices(13))  # pure function of step
    ordered = DistributedSampler(100, 10, 1, 0, seed=1, shuffle=False)
    np.testing.assert_array_equal(ordered.indices(1).ravel(), np.arange(10, 20))


def test_bad_sizes():
    with pytest.raises(ValueError, match="not divisible"):
        DistributedSampler(100, 10, 3, 0, seed=1)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DistributedSampler(5, 10, 1, 0, seed=1)
