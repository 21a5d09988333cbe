"""The length-bucketed batches of the tuned reader: every example once per epoch, a random order seeded by the
epoch, and far less padding than random batches of the same size."""

from __future__ import annotations

import numpy as np

from persrag_lightning.datamodules.sampling import EpochShuffle, LengthBatches


def padding(batches: list[list[int]], lengths: np.ndarray) -> int:
    return sum(int(lengths[b].max()) * len(b) - int(lengths[b].sum()) for b in batches)


def test_length_batches_cover_each_example_once_and_pad_less_than_random_batches():
    lengths = np.random.default_rng(0).choice([8, 20, 46, 120, 256], size=1000, p=[.2, .3, .3, .1, .1])
    sampler = LengthBatches(lengths.tolist(), 32, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert all(len(b) <= 32 for b in batches)
    order = list(EpochShuffle(1000, 0))
    random = [order[i:i + 32] for i in range(0, 1000, 32)]
    assert padding(batches, lengths) < padding(random, lengths) / 3


def test_length_batches_are_seeded_by_the_epoch():
    sampler = LengthBatches(list(range(300)), 16, seed=1)
    first = list(sampler)
    assert list(sampler) == first  # a resumed epoch replays the same batches
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert LengthBatches(list(range(300)), 16, seed=1).batches() == first
