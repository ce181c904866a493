"""Flat layout: views, padding to equal aligned slices, segments for ZeRO."""

import numpy as np

from simdist.arena import Layout
from simdist.models.base import ParamSpec

SPECS = [
    ParamSpec("a.weight", (3, 5), True),
    ParamSpec("a.bias", (5,), False),
    ParamSpec("b.weight", (7,), True),
]


def test_views_share_the_flat_buffer():
    layout = Layout(SPECS, world=3, align=4)
    assert layout.numel == 27
    assert layout.padded % 12 == 0 and layout.padded >= 27
    flat = np.zeros(layout.padded, np.float32)
    v = layout.views(flat)
    v["a.bias"][...] = 1
    assert flat[15:20].sum() == 5 and flat.sum() == 5
    assert v["a.weight"].shape == (3, 5)


def test_shards_cover_the_buffer_and_segments_straddle():
    layout = Layout(SPECS, world=4, align=1)
    shards = [layout.shard(r) for r in range(4)]
    assert shards[0][0] == 0 and shards[-1][1] == layout.padded
    assert all(shards[i][1] == shards[i + 1][0] for i in range(3))
    pieces = [seg for r in range(4) for seg in layout.segments(*layout.shard(r))]
    covered = sum(s.hi - s.lo for s in pieces)
    assert covered == layout.numel  # every real element once, padding left out
    names = [s.name for s in layout.segments(*layout.shard(0))]
    assert names == ["a.weight"]  # 7 elements per shard, inside a.weight
    assert [s.weight_decay for s in layout.segments(0, layout.padded)] == [True, False, True]


def test_more_ranks_than_elements():
    layout = Layout([ParamSpec("w", (2,), True)], world=8, align=1)
    assert layout.padded == 8
    assert sum(len(layout.segments(*layout.shard(r))) for r in range(8)) == 2
