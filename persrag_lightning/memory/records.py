"""Typed records of the memory bank (memories, tags, session turns), shared by store, recall and
extraction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DIMENSIONS", "ROLES", "Memory", "MemoryCandidate", "Recalled", "Tags", "Turn"]

# The seed's five tag dimensions (§3.3/§3.5), in the order of the extraction prompt and of the table
# columns.
DIMENSIONS: tuple[str, ...] = ("topics", "entities", "query_type", "intent", "preferences")
ROLES: tuple[str, ...] = ("user", "assistant")


def _clean(values: Iterable[str]) -> tuple[str, ...]:
    """Strip, drop empties and duplicates (first occurrence wins), so equal tag sets compare
    equal."""
    seen: dict[str, None] = {}
    for v in values:
        v = " ".join(str(v).split())
        if v and v not in seen:
            seen[v] = None
    return tuple(seen)


@dataclass(frozen=True)
class Tags:
    """Tags of a memory or a query on the seed's five dimensions; recall compares them across
    dimensions."""

    topics: tuple[str, ...] = ()
    entities: tuple[str, ...] = ()
    query_type: tuple[str, ...] = ()
    intent: tuple[str, ...] = ()
    preferences: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for dim in DIMENSIONS:
            object.__setattr__(self, dim, _clean(getattr(self, dim)))

    def flat(self) -> tuple[str, ...]:
        """All tags of all dimensions, deduplicated: the seed matches a query tag against any of a
        row's tags."""
        return _clean(t for dim in DIMENSIONS for t in getattr(self, dim))

    def with_topic(self, topic: str) -> Tags:
        """A copy with one more topic (the questionnaire category of a sign-up answer).

        Args:
            topic: the topic to add.
        """
        return Tags(**{d: getattr(self, d) for d in DIMENSIONS if d != "topics"}, topics=(*self.topics, topic))

    def __bool__(self) -> bool:
        return bool(self.flat())


@dataclass(frozen=True)
class Memory:
    """One stored memory: a one-sentence fact about a user, its embedding, tags and usage
    statistics."""

    id: str
    user_id: str
    text: str
    tags: Tags
    usage_count: int
    created_at: float
    last_used_at: float
    source: str  # "chat" | "questionnaire" | "manual"
    vector: np.ndarray = field(repr=False, compare=False)


@dataclass(frozen=True)
class Turn:
    """One turn of a session, of either role (the seed's code keeps only the assistant's)."""

    id: str
    session_id: str
    user_id: str
    role: str
    text: str
    created_at: float


@dataclass(frozen=True)
class MemoryCandidate:
    """A memory returned by the vector search with its rank (0 = nearest) and cosine distance."""

    memory: Memory
    rank: int
    distance: float


@dataclass(frozen=True)
class Recalled:
    """A memory kept by the tag re-ranking: final score = rank score + tag bonus (seed §3.5)."""

    memory: Memory
    score: int
    rank_score: int
    tag_bonus: int
    distance: float
