"""The training order of the datamodules that shuffle on one process (the reader's, the generator's): seeded
by the epoch, so a resumed fit replays the uninterrupted one."""

from __future__ import annotations

import numpy as np
from torch.utils.data import Sampler

__all__ = ["EpochShuffle", "LengthBatches"]

POOL = 16  # batches whose examples are sorted by length together: batches of alike lengths, still random


class EpochShuffle(Sampler[int]):
    """A permutation seeded by (seed, epoch): a fit resumed from an epoch's checkpoint sees the same
    order as an uninterrupted one (Lightning calls set_epoch; under DDP its DistributedSampler does
    the same)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class LengthBatches(Sampler[list[int]]):
    """Batches of examples of alike lengths, in a random order seeded by (seed, epoch): each epoch's
    permutation is cut into pools of `POOL` batches, each pool sorted by length and cut into batches,
    and the batches shuffled. A batch is padded to its longest example, so where lengths vary (a
    review of 20 tokens beside one of 256) this cuts the padding that a random batch pays for.

    Args:
        lengths: each example's length.
        batch_size: examples per batch (the last of a pool may be smaller).
        seed: the shuffle's seed.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int) -> None:
        self.lengths, self.batch_size, self.seed, self.epoch = np.asarray(lengths), batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        order, size, out = rng.permutation(len(self.lengths)), self.batch_size, []
        for start in range(0, len(order), POOL * size):
            pool = order[start:start + POOL * size]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            out += [pool[i:i + size].tolist() for i in range(0, len(pool), size)]
        return [out[i] for i in rng.permutation(len(out))]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.batches())
