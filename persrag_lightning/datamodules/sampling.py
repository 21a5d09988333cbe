"""The training order of the datamodules that shuffle on one process (the reader's, the generator's): seeded
by the epoch, so a resumed fit replays the uninterrupted one."""

from __future__ import annotations

import numpy as np
from torch.utils.data import Sampler

__all__ = ["EpochShuffle"]


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
