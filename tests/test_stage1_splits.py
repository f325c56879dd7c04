"""Stage 1's split count (`request_decode.stage1_splits`): its scheduling model against the
split sweep it was fitted on (H100, 2026-12-06, `request_decode_sweep.py --splits`,
benchmarks/results/h100_2026-12-06b_stage1_splits/): the count it picks must be within 5% of
the best measured at each point, where the rule it replaced ("fill the slots once, rounded up")
was 1.40x and 1.55x off."""
from __future__ import annotations

import pytest

from mosaickv_kernels.request_decode import MIN_PAGES_PER_SPLIT, stage1_makespan, stage1_splits

SLOTS = 2 * 132  # two CTAs per SM on an H100 / H200
HOT = 3  # hot-token programs per (request, head) at the default graph_hot_tokens
# (request, KV head) pairs -> {splits: stage 1 + 2 in us}; 128 selected pages per pair
MEASURED = {
    8: {16: 46.2, 24: 43.1, 33: 36.7, 40: 36.5, 66: 46.6, 132: 57.2},
    64: {2: 323.4, 3: 225.5, 4: 177.9, 5: 248.4, 6: 224.4, 8: 181.5, 10: 204.9, 12: 186.9,
         16: 190.0, 20: 197.7, 24: 201.0, 32: 213.5},
    136: {1: 617.5, 2: 575.5, 3: 428.5, 4: 448.4, 5: 389.8, 6: 406.1, 8: 394.2, 10: 375.1,
          12: 371.6, 16: 383.4},
}


@pytest.mark.parametrize("pairs", sorted(MEASURED))
def test_the_pick_is_within_5_percent_of_the_measured_best(pairs):
    times = MEASURED[pairs]
    pick = stage1_splits(pairs, 128, HOT, SLOTS)
    # the nearest measured count at or around the pick (the sweep did not time every count)
    near = min(times, key=lambda s: (abs(s - pick), s))
    assert abs(near - pick) <= 1, (pairs, pick, sorted(times))
    assert times[near] <= 1.05 * min(times.values()), (pairs, pick, times[near], times)


@pytest.mark.parametrize("pairs", sorted(MEASURED))
def test_the_model_ranks_the_measured_counts_like_the_gpu(pairs):
    """Modelled and measured times, over the counts timed: the same best within 5%, and a
    count the GPU found >= 20% slower than another is modelled slower too."""
    times = MEASURED[pairs]
    model = {s: stage1_makespan(pairs, 128, s, HOT, SLOTS) for s in times}
    for a in times:
        for b in times:
            if times[a] >= 1.2 * times[b]:
                assert model[a] > model[b], (pairs, a, b, times, model)


def test_bounds_and_small_requests():
    assert stage1_splits(8, MIN_PAGES_PER_SPLIT - 1, HOT, SLOTS) == 1  # too few pages to split
    for pairs in (1, 7, 64, 300, 1000):
        for pages in (4, 37, 138, 512):
            s = stage1_splits(pairs, pages, HOT, SLOTS)
            assert 1 <= s <= max(1, min(64, pages // MIN_PAGES_PER_SPLIT))
    # fewer slots than programs of one split: one split (more would only add waves)
    assert stage1_splits(4 * SLOTS, 138, HOT, SLOTS) == 1
