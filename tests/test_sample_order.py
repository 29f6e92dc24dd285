"""The global sample order on synthetic dataset shapes: a permutation of the kept samples,
deterministic, block/window locality, blends by weight, equal step counts, DP slices."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from mimo_data.loading.sample_order import DatasetShape, OrderError, SampleOrder, micro_batch_slice


def shape(*shard_sizes, dropped=()) -> DatasetShape:
    kept = np.ones(sum(shard_sizes), dtype=bool)
    kept[list(dropped)] = False
    return DatasetShape(tuple(shard_sizes), kept)


def test_an_epoch_is_a_permutation_of_the_kept_samples_and_depends_on_seed_and_epoch():
    data = shape(100, 37, 64, dropped=[0, 5, 150])
    order = SampleOrder([data], seed=7, global_batch_size=1)
    _, positions = order.epoch(0)
    assert sorted(positions.tolist()) == sorted(set(range(201)) - {0, 5, 150})
    again = SampleOrder([data], seed=7, global_batch_size=1).epoch(0)[1]
    assert np.array_equal(positions, again)
    assert not np.array_equal(positions, order.epoch(1)[1])
    assert not np.array_equal(positions, SampleOrder([data], 8, 1).epoch(0)[1])
    assert not np.array_equal(positions, np.sort(positions))


def test_reads_stay_within_a_few_consecutive_blocks():
    sizes = (50, 20, 90)
    order = SampleOrder([shape(*sizes)], seed=3, global_batch_size=1, block_size=8,
                        window_blocks=2)
    _, positions = order.epoch(0)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shard_of = np.searchsorted(starts, positions, side="right") - 1
    blocks = list(zip(shard_of.tolist(), ((positions - starts[shard_of]) // 8).tolist()))
    # Consecutive samples come from at most ``window_blocks`` blocks per window, and every
    # block is read in one window (so each shard region is visited once, front to back).
    windows, current = [], []
    for block in blocks:
        if block not in current and len(current) == 2:
            windows.append(current)
            current = []
        if block not in current:
            current.append(block)
    windows.append(current)
    flat = [block for window in windows for block in window]
    assert len(flat) == len(set(flat)) == sum(-(-s // 8) for s in sizes)


def test_steps_are_decided_by_counts_and_the_remainder_is_dropped_or_wrapped():
    data = shape(30, 3)
    dropping = SampleOrder([data], 0, global_batch_size=8)
    assert dropping.steps_per_epoch == 33 // 8 and dropping.remainder_samples == 33 % 8
    assert len(set(dropping.epoch(0)[1].tolist())) == 32
    wrapping = SampleOrder([data], 0, global_batch_size=8, remainder="wrap")
    assert wrapping.steps_per_epoch == 5 and wrapping.remainder_samples == 40 - 33
    positions = wrapping.epoch(0)[1]
    assert set(positions.tolist()) == set(range(33))
    assert positions[33:].tolist() == positions[:7].tolist()
    with pytest.raises(OrderError, match="fewer than one global batch of 64"):
        SampleOrder([data], 0, global_batch_size=64)


def test_unweighted_blend_serves_every_kept_sample_once():
    a, b = shape(3), shape(300, 50, dropped=[299])
    datasets, positions = SampleOrder([a, b], 1, global_batch_size=1).epoch(0)
    pairs = list(zip(datasets.tolist(), positions.tolist()))
    assert len(pairs) == len(set(pairs)) == 3 + 349
    # The small dataset is spread through the epoch, not bunched at one end.
    at = np.flatnonzero(datasets == 0)
    assert at.min() < 352 / 2 < at.max()


def test_weighted_blend_gives_each_dataset_its_share_with_fresh_passes():
    small, large = shape(3), shape(200, 100)
    order = SampleOrder([small, large], 5, global_batch_size=1, weights=[1.0, 1.0])
    datasets, positions = order.epoch(0)
    counts = Counter(datasets.tolist())
    assert counts[0] + counts[1] == 303 and abs(counts[0] - counts[1]) <= 1
    stream = positions[datasets == 0].tolist()
    for start in range(0, len(stream) - 2, 3):       # each pass over the 3 samples is whole
        assert sorted(stream[start:start + 3]) == [0, 1, 2]
    # Proportions hold in every stretch of the epoch.
    for start in range(0, 300, 50):
        share = np.mean(datasets[start:start + 50] == 0)
        assert 0.4 <= share <= 0.6


def test_a_downsampled_dataset_continues_across_epochs_without_repeats():
    small, large = shape(50), shape(100)
    order = SampleOrder([small, large], 2, global_batch_size=1, weights=[3, 1])
    seen = []
    for epoch in range(3):
        datasets, positions = order.epoch(epoch)
        assert Counter(datasets.tolist()) == {0: 113, 1: 37}   # 112.5 / 37.5, tie: first
        seen += positions[datasets == 1].tolist()
    assert len(set(seen[:100])) == 100          # a full pass before any repeat
    assert sorted(seen[:100]) == list(range(100))


def test_a_dataset_of_weight_0_is_left_out_of_the_epoch():
    """Weight 0 leaves a dataset out: none of its samples drawn, and none counted in the
    epoch's length, so the others' samples come once an epoch each, not repeated to fill its
    place."""
    order = SampleOrder([shape(8), shape(19), shape(10)], 3, global_batch_size=1,
                        weights=[1, 0, 1])
    datasets, positions = order.epoch(0)
    assert order.epoch_length == 18 and order.quotas == [9, 0, 9]
    assert len(set(positions[datasets == 2].tolist())) == 9     # 9 of its 10, none twice
    assert 1 not in datasets.tolist()
    alone = SampleOrder([shape(8), shape(19)], 3, global_batch_size=1, weights=[1, 0])
    assert alone.epoch_length == 8
    assert sorted(alone.epoch(0)[1].tolist()) == list(range(8))  # each sample once


def test_bad_weights_are_refused():
    with pytest.raises(OrderError, match="a finite number >= 0"):
        SampleOrder([shape(4), shape(4)], 0, 1, weights=[float("inf"), 1])
    # a library caller's strings or booleans, and finite weights whose sum is not: the same
    # refusal (a TypeError, a NaN share), numpy's numbers taken
    for weights in (["1", "2"], [True, 1], [1e308, 1e308]):
        with pytest.raises(OrderError, match=re.escape(f"blend weights {weights}: each a share")):
            SampleOrder([shape(4), shape(4)], 0, 1, weights=weights)
    assert SampleOrder([shape(4), shape(4)], 0, 1, weights=[np.int64(1), np.float32(3)]
                       ).quotas == [2, 6]
    # a single dataset keeping nothing: its data or config to fix (weight 0 would leave none)
    with pytest.raises(OrderError, match=r"^dataset 0 has weight 1 but preprocessing keeps none "
                       r"of its samples: fix its data/config \(mimo-inspect report"):
        SampleOrder([shape(4, dropped=range(4))], 0, 1, weights=[1])
    # the weighted one keeping nothing, beside one of weight 0: said as that, not as an
    # epoch too short for a global batch
    with pytest.raises(OrderError, match="^dataset 0 has weight 1 but preprocessing keeps none"):
        SampleOrder([shape(4, dropped=range(4)), shape(100)], 0, 4, weights=[1, 0])
    with pytest.raises(OrderError, match="^s3://b/speech has weight 1 but preprocessing keeps "
                       "none of its samples"):
        SampleOrder([shape(4), shape(4, dropped=range(4))], 0, 1, weights=[1, 1],
                    names=["shards/images", "s3://b/speech"])
    with pytest.raises(OrderError, match="one per dataset"):
        SampleOrder([shape(4)], 0, 1, weights=[1, 1])
    # unweighted, a dataset of the mix that keeps nothing is refused too, not trained around
    with pytest.raises(OrderError, match=re.escape(
            "s3://b/speech: preprocessing keeps none of its samples (4 read), so the mix would "
            "go without it: drop it from the list")):
        SampleOrder([shape(4), shape(4, dropped=range(4))], 0, 1,
                    names=["shards/images", "s3://b/speech"])
    # weights whose shares of an epoch round to no sample: never drawn, so refused with the
    # least weight that draws one (of each, when all take it); that weight draws one of each
    for kept, weights, said, least, quotas in [
        # 0.4 / 39.6 of 40 samples; 1 / 39 of the others' 1
        ([22, 18], [1, 0.01], "s3://b/speech has weight 0.01, a share of 0.40 of an epoch's 40 "
         "samples, which rounds to none: it would never be drawn. Give it a weight of at least "
         "0.0257 (one sample an epoch), or 0 to leave it out", [1, 0.0257], [39, 1]),
        # several: said at once
        ([100, 25, 25], [1, 0.001, 0.001], "dataset 1 has weight 0.001, a share of 0.15; "
         "dataset 2 has weight 0.001, a share of 0.15 of an epoch's 150 samples, which round "
         "to none: they would never be drawn. Give each a weight of at least 0.00676 (one "
         "sample an epoch), or 0 to leave them out", [1, 0.00676, 0.00676], [148, 1, 1]),
        # one under a sample that the remainders round up is named too: the advice raises both
        ([216, 261, 257], [0.0012, 0.00125, 2], "dataset 0 has weight 0.0012, a share of "
         "0.44; dataset 1 has weight 0.00125, a share of 0.46 of an epoch's 734 samples, "
         "under one sample each: drawn by the rounding alone, or never. Give each a weight of "
         "at least 0.00274", [0.00274, 0.00274, 2], [1, 1, 732])]:
        datasets = [shape(n) for n in kept]
        with pytest.raises(OrderError, match=re.escape(said)):
            SampleOrder(datasets, 0, 1, weights=weights,
                        names=["shards/images", "s3://b/speech"] if len(kept) == 2 else ())
        assert SampleOrder(datasets, 0, 1, weights=least).quotas == quotas


def test_dp_parts_tile_each_global_micro_batch():
    global_batch, group = 12, 6
    for dp in (1, 2, 3, 6):
        covered = []
        for step in range(2):
            for micro in range(global_batch // group):
                parts = [micro_batch_slice(step, micro, global_batch, group, dp, r)
                         for r in range(dp)]
                covered += [i for part in parts for i in range(part.start, part.stop)]
        assert covered == list(range(2 * global_batch))


def test_the_order_is_the_one_earlier_versions_drew_and_holds_little_memory():
    """A seed's order is the one mimo drew before its computation was made leaner (values
    printed by the earlier code, 2026-12-06: a resume across an upgrade continues the same
    stream); computing an epoch's order of one dataset holds under 40 bytes a sample at its
    peak (every rank and loader worker computes it; it was 60)."""
    import tracemalloc
    data = shape(100, 37, 0, 64, dropped=[0, 5, 150])
    order = SampleOrder([data], seed=7, global_batch_size=1, block_size=8, window_blocks=2)
    assert order.epoch(0)[1][:12].tolist() == [66, 64, 81, 83, 86, 82, 70, 80, 71, 84, 87, 67]
    assert order.epoch(1)[1][-6:].tolist() == [110, 147, 108, 151, 145, 149]
    count = 1_000_000
    large = SampleOrder([shape(*[5000] * (count // 5000))], seed=1, global_batch_size=256)
    tracemalloc.start()
    try:
        large.dataset_order(0, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak / count < 40, peak / count


def test_wrap_adds_no_step_when_the_epoch_fills_its_last_one():
    """``remainder: wrap`` completes a last step only where one is short: an epoch whose kept
    samples fill whole global batches has as many steps as with ``drop``, every sample once and
    none repeated."""
    data = shape(30, 2)
    for remainder in ("drop", "wrap"):
        order = SampleOrder([data], 0, global_batch_size=8, remainder=remainder)
        assert (order.steps_per_epoch, order.remainder_samples) == (4, 0), remainder
        assert sorted(order.epoch(0)[1].tolist()) == list(range(32)), remainder


def test_a_blends_order_is_the_one_this_version_draws():
    """A weighted blend's order (which dataset at each place, and where each continues from
    epoch to epoch) is pinned as drawn on 2026-12-07, like the single dataset's above: a
    resumed blend continues the same stream after an upgrade; the interleaving's phases are
    drawn anew each epoch."""
    order = SampleOrder([shape(5), shape(40, 9, dropped=[3]), shape(13)], seed=11,
                        global_batch_size=4, weights=[2, 1, 1], block_size=8, window_blocks=2)
    assert order.quotas == [33, 17, 16]
    datasets, positions = order.epoch(0)
    assert "".join(map(str, datasets.tolist())) == \
        "2010201020102010201020102010201020102010201020100210021001201020"
    assert positions[:12].tolist() == [10, 3, 18, 4, 11, 1, 19, 0, 8, 2, 22, 1]
    datasets, positions = order.epoch(1)
    assert "".join(map(str, datasets.tolist())) == \
        "1020102010201020102010201020102010201020102010210012001200102010"
    assert positions[:12].tolist() == [11, 1, 5, 0, 37, 0, 7, 4, 35, 1, 0, 3]


def test_a_dataset_of_weight_0_may_keep_nothing_and_all_weights_0_are_refused():
    """A dataset whose samples preprocessing all drops can be left out of a blend by weight 0
    (refused only where it is weighted); weights that are all 0 draw nothing and are refused
    saying so, not as a division by zero."""
    order = SampleOrder([shape(4), shape(4, dropped=range(4))], 0, 1, weights=[1, 0])
    assert order.quotas == [4, 0] and sorted(order.epoch(0)[1].tolist()) == [0, 1, 2, 3]
    with pytest.raises(OrderError, match=r"blend weights \[0, 0\]: .*and not all 0"):
        SampleOrder([shape(4), shape(4)], 0, 1, weights=[0, 0])
