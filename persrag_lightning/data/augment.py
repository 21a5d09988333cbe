"""History augmentations of CFRAG §4.1.2 (crop, mask, reorder) on sequences of doc-row ids."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["AugmentConfig", "augment_view"]


@dataclass(frozen=True)
class AugmentConfig:
    """Ratios η_c, η_m, η_r of the paper; the official defaults are 0.7 / 0.3 / 0.3.

    Args:
        crop_ratio: η_c, the share of a history a crop keeps as one contiguous window.
        mask_ratio: η_m, the share of history docs replaced by the [mask] doc.
        reorder_ratio: η_r, the length of the contiguous span that is shuffled, as a share of the
            history.
    """

    crop_ratio: float = 0.7
    mask_ratio: float = 0.3
    reorder_ratio: float = 0.3


def document_crop(seq: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """H^crop: a random contiguous window of floor(η_c·N) docs (at least one)."""
    length = max(1, int(np.floor(ratio * len(seq))))
    start = int(rng.integers(0, len(seq) - length + 1))
    return seq[start:start + length].copy()


def document_mask(
    seq: np.ndarray, ratio: float, rng: np.random.Generator, mask_id: int
) -> np.ndarray:
    """H^mask: floor(η_m·N) random positions replaced by the [mask] row."""
    out = seq.copy()
    count = int(np.floor(ratio * len(seq)))
    out[rng.choice(len(seq), size=count, replace=False)] = mask_id
    return out


def document_reorder(seq: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """H^reorder: a random contiguous span of floor(η_r·N) docs shuffled in place."""
    out = seq.copy()
    length = int(np.floor(ratio * len(seq)))
    if length > 1:
        start = int(rng.integers(0, len(seq) - length + 1))
        out[start:start + length] = rng.permutation(out[start:start + length])
    return out


def augment_view(
    seq: np.ndarray, config: AugmentConfig, rng: np.random.Generator, mask_id: int
) -> np.ndarray:
    """One view: the augmentation is picked uniformly per view; histories of length ≤ 1 stay
    unchanged."""
    if len(seq) <= 1:
        return seq.copy()
    choice = int(rng.integers(0, 3))
    if choice == 0:
        return document_crop(seq, config.crop_ratio, rng)
    if choice == 1:
        return document_mask(seq, config.mask_ratio, rng, mask_id)
    return document_reorder(seq, config.reorder_ratio, rng)
