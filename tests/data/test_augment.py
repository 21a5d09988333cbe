from collections import Counter

import numpy as np
import pytest

from persrag_lightning.data.augment import (
    AugmentConfig,
    augment_view,
    document_crop,
    document_mask,
    document_reorder,
)

MASK = 1


@pytest.mark.parametrize("n", [2, 3, 7, 10, 100])
def test_crop_is_contiguous_window_of_floor_ratio(n):
    seq = np.arange(10, 10 + n)
    for seed in range(20):
        out = document_crop(seq, 0.7, np.random.default_rng(seed))
        assert len(out) == max(1, int(np.floor(0.7 * n)))
        start = int(out[0]) - 10
        assert (out == seq[start:start + len(out)]).all()


@pytest.mark.parametrize("n", [2, 4, 10, 33])
def test_mask_replaces_floor_ratio_positions_and_keeps_the_rest(n):
    seq = np.arange(10, 10 + n)
    out = document_mask(seq, 0.3, np.random.default_rng(n), MASK)
    masked = out == MASK
    assert masked.sum() == int(np.floor(0.3 * n))
    assert (out[~masked] == seq[~masked]).all()
    assert len(out) == n


@pytest.mark.parametrize("n", [4, 10, 50])
def test_reorder_keeps_multiset_and_touches_one_span(n):
    seq = np.arange(10, 10 + n)
    for seed in range(20):
        out = document_reorder(seq, 0.3, np.random.default_rng(seed))
        assert Counter(out.tolist()) == Counter(seq.tolist())
        changed = np.flatnonzero(out != seq)
        if len(changed):
            assert changed[-1] - changed[0] + 1 <= int(np.floor(0.3 * n))


def test_short_histories_are_unchanged_and_views_are_seeded():
    cfg = AugmentConfig()
    one = np.array([5])
    assert (augment_view(one, cfg, np.random.default_rng(0), MASK) == one).all()
    seq = np.arange(10, 40)
    a = augment_view(seq, cfg, np.random.default_rng(3), MASK)
    b = augment_view(seq, cfg, np.random.default_rng(3), MASK)
    assert (a == b).all()
    kinds = set()
    for seed in range(60):
        v = augment_view(seq, cfg, np.random.default_rng(seed), MASK)
        kinds.add("crop" if len(v) < len(seq) else "mask" if (v == MASK).any() else "reorder")
    assert kinds == {"crop", "mask", "reorder"}  # each view picks its augmentation uniformly
