"""Recall (seed §3.5, Fig. 2): vector top N of one user, rank score N..1, +1 per query tag whose
best cosine to a row's tags reaches a threshold, keep score >= N - 2, at most k."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from persrag_lightning.memory.records import MemoryCandidate, Recalled

__all__ = ["Encoder", "RecallSettings", "TagEmbeddings", "encode_numpy", "rerank"]


class Encoder(Protocol):
    """Anything that embeds texts as L2-normalised rows (our TextEncoder, or a test fake)."""

    def encode(self, texts: list[str]): ...


def encode_numpy(encoder: Encoder, texts: list[str]) -> np.ndarray:
    """Encoder output (torch tensor or array) as float32 numpy, shape (len(texts), d).

    Args:
        encoder: the text encoder.
        texts: the texts to embed.
    """
    out = encoder.encode(texts)
    if hasattr(out, "detach"):
        out = out.detach().cpu().numpy()
    return np.asarray(out, dtype=np.float32).reshape(len(texts), -1)


@dataclass(frozen=True)
class RecallSettings:
    """The seed's defaults: N = 20, k = 5, tag cosine >= 0.75, final score >= N - 2 (= 18)."""

    top_n: int = 20
    k: int = 5
    tag_threshold: float = 0.75
    score_margin: int = 2  # keep rows with score >= top_n - score_margin

    def __post_init__(self) -> None:
        if self.top_n < 1 or self.k < 1 or self.score_margin < 0:
            raise ValueError(f"invalid recall settings {self}")

    @property
    def min_score(self) -> int:
        return self.top_n - self.score_margin


class TagEmbeddings:
    """LRU cache of tag embeddings: tags repeat across rows and queries, and the seed embeds them
    per query."""

    def __init__(self, encoder: Encoder, max_size: int = 50_000) -> None:
        self.encoder = encoder
        self.max_size = max_size
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, tags: Sequence[str]) -> np.ndarray:
        with self._lock:
            return self._embed(tags)

    def _embed(self, tags: Sequence[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(tags) if t not in self._cache]
        if missing:
            for t, v in zip(missing, encode_numpy(self.encoder, missing), strict=True):
                self._cache[t] = v
        out = []
        for t in tags:
            self._cache.move_to_end(t)
            out.append(self._cache[t])
        while len(self._cache) > self.max_size:
            self._cache.popitem(last=False)
        return np.stack(out) if out else np.zeros((0, 0), dtype=np.float32)


def rank_score(rank: int, top_n: int) -> int:
    """Seed §3.5: the nearest row scores N, the next N - 1, ... (rank is 0-based).

    Args:
        rank: the row's 0-based rank in the vector search.
        top_n: N, the candidates the vector search returns.
    """
    return top_n - rank


def tag_bonus(query_tags: np.ndarray, row_tags: np.ndarray, threshold: float) -> int:
    """Seed §3.5: +1 per query tag whose best cosine to any of the row's tags reaches the threshold
    (rows are L2-normalised, so the dot product is the cosine).

    Args:
        query_tags: [q, d] the query's tag embeddings.
        row_tags: [r, d] the row's tag embeddings.
        threshold: the cosine a pair of tags must reach.
    """
    if len(query_tags) == 0 or len(row_tags) == 0:
        return 0
    best = (query_tags @ row_tags.T).max(axis=1)
    return int((best >= threshold - 1e-6).sum())


def rerank(candidates: Sequence[MemoryCandidate], query_tags: Sequence[str], embed: TagEmbeddings | None,
           settings: RecallSettings) -> list[Recalled]:
    """Score the vector-search candidates, keep those at or above the minimum, best first (ties:
    nearer first).

    Args:
        candidates: the vector search's rows, nearest first.
        query_tags: the query's tags (from the extraction).
        embed: the tag-embedding cache; None gives no tag bonus.
        settings: the top N, the tag threshold, the minimum score and how many to keep (k).
    """
    q = embed(list(query_tags)) if (embed is not None and query_tags) else np.zeros((0, 0), dtype=np.float32)
    scored = []
    for c in candidates:
        base = rank_score(c.rank, settings.top_n)
        row_tags = c.memory.tags.flat()
        bonus = tag_bonus(q, embed(list(row_tags)), settings.tag_threshold) if (len(q) and row_tags) else 0
        scored.append(Recalled(c.memory, base + bonus, base, bonus, c.distance))
    kept = [r for r in scored if r.score >= settings.min_score]
    kept.sort(key=lambda r: (-r.score, -r.rank_score))
    return kept[:settings.k]
