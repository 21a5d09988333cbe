"""Usage-aware FIFO eviction of one user's memories (seed §3.4), as a pure function over (id, usage,
age).

Past `capacity`, remove the oldest rows whose usage is below mean - 1 std; when fewer such rows
exist than must go, remove that many rows at random (seeded) among all of the user's rows, as the
seed writes (`fallback="random"`), or, with `fallback="least_used"`, all the rarely used ones and
then the least used of the rest (random among ties). Per user and by row id: the seed's code counted
all users together, matched rows by text and never ran the eviction at all.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["EvictionSettings", "UsageRow", "select_evictions"]

Fallback = Literal["random", "least_used"]


@dataclass(frozen=True)
class EvictionSettings:
    """`fraction` of `capacity` is removed per round (the seed's max_entries x 0.2)."""

    capacity: int = 200
    fraction: float = 0.2
    seed: int = 0
    # the seed's: too few rarely used rows -> remove a fifth of capacity at random
    fallback: Fallback = "random"

    def __post_init__(self) -> None:
        if self.fallback not in ("random", "least_used"):
            raise ValueError(f"fallback must be 'random' or 'least_used', got {self.fallback!r}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")


@dataclass(frozen=True)
class UsageRow:
    """What eviction needs to know about a memory."""

    id: str
    usage_count: int
    created_at: float


def _eviction_size(n_rows: int, settings: EvictionSettings) -> int:
    """How many rows to remove: 20 % of capacity (at least 1), and never fewer than the overflow, so
    one round always brings the user back to at most `capacity` even after a bulk insert.

    Args:
        n_rows: the user's memories now.
        settings: the capacity and the eviction share.
    """
    if n_rows <= settings.capacity:
        return 0
    batch = max(1, math.floor(settings.fraction * settings.capacity + 1e-9))
    return min(n_rows, max(batch, n_rows - settings.capacity))


def select_evictions(
    rows: Sequence[UsageRow], settings: EvictionSettings, rng_key: str = ""
) -> list[str]:
    """Ids to delete (empty when within capacity). `rng_key` (the user id) makes the random fill
    stable per user and across restarts."""
    n = _eviction_size(len(rows), settings)
    if n == 0:
        return []
    usage = np.array([r.usage_count for r in rows], dtype=np.float64)
    threshold = usage.mean() - usage.std()  # population std, as numpy's default
    oldest_first = sorted(rows, key=lambda r: (r.created_at, r.id))
    low = [r for r in oldest_first if r.usage_count < threshold]
    if len(low) >= n:
        return [r.id for r in low[:n]]
    rng = random.Random(f"{settings.seed}:{rng_key}")
    if settings.fallback == "random":  # the seed: "randomly remove max_entries x 0.2 results"
        return rng.sample([r.id for r in sorted(rows, key=lambda r: r.id)], n)
    # Too few clearly-unused rows: take them all, then fill at random among the least used of the
    # rest.
    chosen = [r.id for r in low]
    taken = set(chosen)
    rest = sorted(
        (r for r in rows if r.id not in taken), key=lambda r: (r.usage_count, r.created_at, r.id)
    )
    need = n - len(chosen)
    boundary = rest[need - 1].usage_count  # usage level where the cut falls
    sure = [r.id for r in rest if r.usage_count < boundary]
    ties = [r.id for r in rest if r.usage_count == boundary]
    return chosen + sure + rng.sample(ties, need - len(sure))
