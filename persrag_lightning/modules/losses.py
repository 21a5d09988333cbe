"""Losses of the CFRAG stages, one function per formula of the paper."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Negatives = Literal["all_views", "cross_view"]


def info_nce(view_a: torch.Tensor, view_b: torch.Tensor, temperature: float = 0.1,
             negatives: Negatives = "all_views") -> torch.Tensor:
    """Eq. 2: symmetric InfoNCE over cosine similarities of two views of the same N users.

    `all_views` (default, the official SimCLR-style code): every one of the 2N views is an anchor and the other
    2N-2 views are its negatives. `cross_view` is Eq. 2 read literally: anchor e'_u against e''_{u-} and the
    mirrored term, i.e. the mean of two cross-entropies over the N×N cross-view similarity matrix.
    """
    a = F.normalize(view_a, dim=-1)
    b = F.normalize(view_b, dim=-1)
    n = a.shape[0]
    if negatives == "cross_view":
        logits = a @ b.T / temperature
        target = torch.arange(n, device=a.device)
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    z = torch.cat([a, b])
    logits = z @ z.T / temperature
    logits = logits.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device)
    return F.cross_entropy(logits, target)
