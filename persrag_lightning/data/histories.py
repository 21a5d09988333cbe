"""Users' histories as doc-table id sequences, the user encoder's input format: 0 pads, 1 is the [mask] token of
the mask augmentation, and corpus row r is id r + 2."""

from __future__ import annotations

import numpy as np
import torch

PAD_ID = 0
MASK_ID = 1
FIRST_DOC_ID = 2  # doc-table row of corpus row r is r + FIRST_DOC_ID


def history_ids(rows: np.ndarray) -> np.ndarray:
    """Corpus rows → doc-table ids."""
    return rows + FIRST_DOC_ID


def pad_histories(histories: list[np.ndarray]) -> torch.Tensor:
    """Right-pad doc-table id sequences with PAD_ID into a [B, L] tensor (L ≥ 1)."""
    length = max(1, max((len(h) for h in histories), default=1))
    out = torch.full((len(histories), length), PAD_ID, dtype=torch.long)
    for i, h in enumerate(histories):
        out[i, :len(h)] = torch.as_tensor(h, dtype=torch.long)
    return out
