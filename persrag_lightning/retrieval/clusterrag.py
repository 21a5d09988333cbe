"""ClusterRAG (seed 002) as a Strategy: cohort neighbours (no training) + the cluster-level doc
index, in the seed's three profile modes: `user` (own docs), `collab` (the top-k cohort neighbours'
docs only) and `hybrid` (both).

Degenerate inputs give a logged message, a counter in `notes`, and a defined result instead of an
exception: an unknown query user gets no docs; a user without docs has no own docs (and, with MEAN
user vectors, no vector, so no neighbours either); a user without neighbours (noise under
`noise="own"`, a cohort of one, all users noise) falls back to user-only retrieval in `collab`,
which is what the noise policy "own" promises.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from persrag_lightning.bundles import require_bundle
from persrag_lightning.llm.profile_budget import BudgetSettings
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.retrieval.cluster_index import ClusterIndex, ClusterIndexSettings
from persrag_lightning.retrieval.cohort_settings import CohortSettings
from persrag_lightning.retrieval.cohorts import CohortModel, Neighbour
from persrag_lightning.retrieval.user_clustering import mean_user_vectors

__all__ = ["ClusterRAG", "ClusterRAGSettings", "CorpusEmbedder", "encoder_user_vectors"]

log = logging.getLogger(__name__)

Mode = Literal["user", "collab", "hybrid"]
MODES: tuple[Mode, ...] = ("user", "collab", "hybrid")


class DocEmbedder(Protocol):
    """What ClusterRAG needs from an encoder: one vector per corpus row (aligned with
    `store.corpus`) and query vectors in the same space. `data_key` names the doc vectors for the
    index cache ("" = hash them)."""

    data_key: str

    def doc_vectors(self, store: DocStore) -> np.ndarray: ...

    def query_vectors(self, texts: list[str]) -> np.ndarray: ...


class CorpusEmbedder:
    """The frozen text encoder over the shared corpus-embedding cache (the Dense baseline's
    vectors)."""

    def __init__(self, encoder: str = "minilm", cache_dir: str | Path = ".cache/persrag", max_length: int = 256,
                 pooling: str = "mean") -> None:
        self.encoder, self.cache_dir, self.max_length, self.pooling = encoder, cache_dir, max_length, pooling
        self.retriever = None
        self.data_key = ""

    def doc_vectors(self, store: DocStore) -> np.ndarray:
        from persrag_lightning.models.corpus_embeddings import corpus_embedding_key
        from persrag_lightning.retrieval.corpus_retriever import EncoderRetriever

        self.retriever = EncoderRetriever(
            self.encoder, store.corpus, self.cache_dir, self.max_length, self.pooling
        )
        self.retriever.prepare()
        self.retriever.load()
        self.data_key = corpus_embedding_key(
            store.corpus, self.encoder, self.max_length, self.pooling
        )
        return self.retriever.doc_vectors.float().numpy()

    def query_vectors(self, texts: list[str]) -> np.ndarray:
        if self.retriever is None:
            raise RuntimeError("CorpusEmbedder.doc_vectors(store) must run before query_vectors")
        return self.retriever.query_vectors(texts).float().numpy()


def encoder_user_vectors(user_encoder: str | Path) -> tuple[list[str], np.ndarray]:
    """CFRAG's trained user table (stage-1 export): (user ids, embeddings); a missing export names
    its command."""
    from persrag_lightning.models.user_encoder import UserEncoder

    encoder = UserEncoder.from_pretrained(require_bundle(user_encoder))
    return list(encoder.user_ids), encoder.user_embeddings.float().numpy()


@dataclass(frozen=True)
class ClusterRAGSettings:
    """The seed's defaults: hybrid mode (its best, ClusterRAG-H), k = 1 neighbour, B = 1 cluster.

    Args:
        mode: `user` (the user's own docs), `collab` (the cohort neighbours' docs) or `hybrid`
            (both, the seed's best).
        cohorts: how users become cohorts (the seed's HDBSCAN over MEAN vectors, k = 1 neighbour).
        index: how docs are clustered and how many clusters a query visits (B = 1).
        max_history: own/neighbour docs read per user, most recent first; None = all.
    """

    mode: Mode = "hybrid"
    cohorts: CohortSettings = field(default_factory=CohortSettings)
    index: ClusterIndexSettings = field(default_factory=ClusterIndexSettings)
    max_history: int | None = None


@dataclass
class RetrievalNotes:
    """How often each degenerate case happened (a run of 100k queries logs each kind once, counts
    all)."""

    unknown_users: int = 0
    users_without_docs: int = 0
    no_neighbours: int = 0  # collab fell back to user-only retrieval
    no_vector: int = 0  # the user is not in the cohort model (no docs under MEAN vectors)
    # a neighbour without docs in the store (private, removed): the next one taken
    skipped_neighbours: int = 0
    queries: int = 0
    docs: int = 0  # docs returned over all queries
    # queries that got fewer than k docs (the top-B clusters held fewer, or few candidates)
    short_queries: int = 0

    @property
    def docs_per_query(self) -> float:
        return self.docs / self.queries if self.queries else 0.0

    def summary(self) -> str:
        counts = ", ".join(
            f"{f.name.replace('_', ' ')}: {getattr(self, f.name)}" for f in fields(self)
        )
        return f"{counts}, docs per query: {self.docs_per_query:.2f}"


class ClusterRAG(Strategy):
    """ClusterRAG in one mode; `prepare` fits the cohorts (unless given) and builds or loads the
    cluster index.

    In an evaluate config (`configs/evaluate_cfrag.yaml`): `settings` (mode, cohorts, index),
    `embedder` (default: the frozen MiniLM over the shared corpus-embedding cache, the Dense
    baseline's vectors), `user_encoder` (the stage-1 export, read only with `cohorts.user_vectors:
    encoder`) and `prompt_gamma` (Eq. 3's γ, the seed's 0.55; the prompt builder counts it in the
    LLM's tokens)."""

    def __init__(self, embedder: DocEmbedder | None = None, settings: ClusterRAGSettings | None = None,
                 cache_dir: str | Path = ".cache/persrag", user_vectors: tuple[Sequence[str], np.ndarray] | None = None,
                 cohorts: CohortModel | None = None, user_encoder: str | None = None,
                 prompt_gamma: float | None = BudgetSettings().gamma, name: str | None = None) -> None:
        """Settings from the config; the embedder, user vectors and cohorts may be injected instead
        of built.

        Args:
            embedder: the doc embedder; None = the frozen MiniLM over the shared corpus-embedding
                cache (the Dense baseline's vectors).
            settings: mode, cohorts and cluster index; None = the seed's defaults
                (ClusterRAGSettings()).
            cache_dir: the shared corpus-embedding cache and the cluster index, keyed by
                fingerprints.
            user_vectors: (user ids, vectors) to cluster instead of computing them (e.g. CFRAG's
                user table).
            cohorts: a fitted CohortModel to use instead of fitting one on `prepare`.
            user_encoder: the stage-1 export, read only with `cohorts.user_vectors: encoder`.
            prompt_gamma: Eq. 3's γ, the query's largest share of the prompt budget (the seed's
                0.55; the prompt builder counts it in the LLM's tokens); None: CFRAG's even split.
            name: the strategy's row name in the evaluation's table; None = `ClusterRAG (<mode>)`.
        """
        self.settings = settings or ClusterRAGSettings()
        if self.settings.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.settings.mode!r}")
        if (self.settings.cohorts.user_vectors == "encoder" and user_vectors is None and cohorts is None
                and user_encoder is None):
            raise ValueError(
                "user_vectors='encoder' needs the trained user embeddings: pass user_encoder=<the "
                "stage-1 export>, user_vectors=(ids, vectors) (CFRAG's user table) or a fitted "
                "CohortModel"
            )
        if prompt_gamma is not None and not 0.0 <= prompt_gamma <= 1.0:
            raise ValueError(f"prompt_gamma (Eq. 3's γ) must be in [0, 1], got {prompt_gamma}")
        self.name = name or f"ClusterRAG ({self.settings.mode})"
        self.embedder = embedder if embedder is not None else CorpusEmbedder(cache_dir=cache_dir)
        self.cache_dir = Path(cache_dir)
        self.user_vectors = user_vectors
        self.user_encoder = user_encoder
        self.prompt_gamma = prompt_gamma
        self.cohorts = cohorts
        self.index: ClusterIndex | None = None
        self.notes = RetrievalNotes()
        self._said: set[str] = set()

    def cache_config(self) -> dict:
        """What identifies this strategy's retrievals (the evaluation's cache key): every setting,
        the embedder, and the user vectors or cohorts it was given (the user-encoder export by the
        digest of its files)."""
        from persrag_lightning.utils import bundle_digest, fingerprint

        emb = self.embedder
        given = None
        if self.cohorts is not None and self.cohorts.data_fingerprint:
            given = {"cohorts": self.cohorts.data_fingerprint}
        elif self.user_vectors is not None:
            vectors = np.ascontiguousarray(self.user_vectors[1], np.float32)
            given = {"user_vectors": fingerprint(list(self.user_vectors[0]),
                                                 hashlib.sha256(vectors.tobytes()).hexdigest())}
        encoder = None
        if self.user_encoder is not None and self.settings.cohorts.user_vectors == "encoder":
            encoder = bundle_digest(require_bundle(self.user_encoder))
        return {"version": "clusterrag/v1", "settings": asdict(self.settings),
                "embedder": {"class": type(emb).__qualname__,
                             **{k: v for k, v in vars(emb).items()
                                if k not in ("cache_dir", "retriever", "data_key")
                                and isinstance(v, (str, int, float, bool, type(None)))}},
                "given": given, "user_encoder": encoder}

    # ---- preparation -----------------------------------------------------------------------------
    def prepare(self, store: DocStore) -> None:
        super().prepare(store)
        doc_vectors = np.asarray(self.embedder.doc_vectors(store), dtype=np.float32)
        if len(doc_vectors) != len(store.corpus):
            raise ValueError(f"{len(doc_vectors)} doc vectors for {len(store.corpus)} corpus rows")
        if self.cohorts is None and self.settings.mode != "user":
            self.cohorts = self.fit_cohorts(store, doc_vectors)
        self.index = ClusterIndex.build_or_load(doc_vectors, self.cache_dir / "cluster_index", self.settings.index,
                                                data_key=getattr(self.embedder, "data_key", "") or None)
        self.index.clamp_b()  # B > clusters: warned here, once, not at the first query

    def fit_cohorts(self, store: DocStore, doc_vectors: np.ndarray) -> CohortModel:
        """Cohorts over MEAN user vectors (Eq. 1) or the given ones; users without docs are left
        out, said once."""
        if self.user_vectors is None and self.settings.cohorts.user_vectors == "encoder":
            self.user_vectors = encoder_user_vectors(self.user_encoder)
        if self.user_vectors is not None:
            ids, vectors = list(self.user_vectors[0]), np.asarray(self.user_vectors[1], dtype=np.float32)
        else:
            # Eq. 1 over each user's collaborative pool (data/histories.py), never over test
            # profiles
            ids, vectors, empty = mean_user_vectors(
                doc_vectors, {u: store.rows(u) for u in store.corpus.user_ids}
            )
            if empty:
                log.warning("%d user(s) have no docs, hence no MEAN vector and no cohort (e.g. %s); they get no "
                            "neighbours", len(empty), ", ".join(map(repr, empty[:3])))
        model = CohortModel(self.settings.cohorts).fit(ids, vectors)
        log.info("ClusterRAG cohorts:\n%s", model.summary())
        return model

    # ---- retrieval -------------------------------------------------------------------------------
    def _say(self, kind: str, message: str) -> None:
        setattr(self.notes, kind, getattr(self.notes, kind) + 1)
        if kind not in self._said:
            self._said.add(kind)
            log.warning(
                "%s: %s (further cases are counted in `notes`, not logged)", self.name, message
            )

    def usable_neighbours(self, uid: str, query: Query) -> list[tuple[Neighbour, np.ndarray]]:
        """The top-k cohort neighbours that have docs in the store, with their rows: a neighbour who
        is private or removed (in the cohort model, not in the store, or without docs) is skipped
        for the next one."""
        want = self.settings.cohorts.top_k_users
        asked = want
        while want > 0:
            found = self.cohorts.neighbours(uid, asked)
            out: list[tuple[Neighbour, np.ndarray]] = []
            skipped = 0
            for n in found:
                usable = n.user_id in self.store and self.store.shares(n.user_id)
                rows = (self.store.rows(n.user_id, self.settings.max_history, query) if usable
                        else np.zeros(0, np.int64))
                if len(rows) == 0:
                    skipped += 1
                    continue
                out.append((n, rows))
                if len(out) == want:
                    break
            if len(out) == want or len(found) < asked:  # enough, or the cohort has no more members
                if skipped:
                    self._say("skipped_neighbours", f"user {uid!r}: {skipped} cohort neighbour(s) have no docs in "
                              "the store (private or removed); the next one(s) were taken")
                    self.notes.skipped_neighbours += skipped - 1
                return out
            asked *= 4
        return []

    def candidates(self, query: Query) -> tuple[np.ndarray, np.ndarray]:
        """The mode's candidate rows and, per row, its owner's cosine to the query user (1 for own
        docs)."""
        store, mode, uid = self.store, self.settings.mode, query.user_id
        known = uid in store
        in_cohorts = self.cohorts is not None and uid in self.cohorts
        if not known and not in_cohorts:
            self._say("unknown_users", f"user {uid!r} (example {query.example_id!r}) is unknown: no docs retrieved")
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        own = store.rows(uid, self.settings.max_history, query) if known else np.zeros(0, np.int64)
        if len(own) == 0 and mode != "collab":
            self._say("users_without_docs", f"user {uid!r} has no docs of their own")
        parts, sims = (
            ([own], [np.ones(len(own), np.float32)]) if mode in ("user", "hybrid") else ([], [])
        )
        if mode != "user":
            neighbours = []
            if in_cohorts:
                neighbours = self.usable_neighbours(uid, query)
            else:
                self._say("no_vector", f"user {uid!r} has no user vector (no docs under MEAN vectors): no neighbours")
            for n, rows in neighbours:
                parts.append(rows)
                sims.append(np.full(len(rows), n.similarity, np.float32))
            if not neighbours and in_cohorts:
                self._say("no_neighbours", f"user {uid!r} has no cohort neighbours (noise, or alone in the cohort)"
                          + ("; collab falls back to the user's own docs" if mode == "collab" else ""))
            if mode == "collab" and not neighbours:
                parts, sims = [own], [np.ones(len(own), np.float32)]
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        return np.concatenate(parts).astype(np.int64), np.concatenate(sims)

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        if self.index is None:
            raise RuntimeError("ClusterRAG.prepare(store) must run before retrieve")
        if k <= 0 or not queries:
            return [[] for _ in queries]
        vectors = np.asarray(
            self.embedder.query_vectors([q.query for q in queries]), dtype=np.float32
        )
        out = []
        for query, vector in zip(queries, vectors):
            rows, user_sims = self.candidates(query)
            if len(rows) == 0:
                self.notes.queries += 1
                self.notes.short_queries += 1
                out.append([])
                continue
            sim_of = dict(zip(rows.tolist(), user_sims.tolist()))
            found = self.index.search_within(vector, rows, k)
            self.notes.queries += 1
            self.notes.docs += found.rows.shape[1]
            self.notes.short_queries += found.rows.shape[1] < k
            out.append([self.store.doc(int(r), user_sim=float(sim_of.get(int(r), math.nan)),
                                       retriever_score=float(s))
                        for s, r in zip(found.scores[0], found.rows[0])])
        return out

    # ---- serving ---------------------------------------------------------------------------------
    def add_user(
        self, user_id: str, doc_vectors: np.ndarray, user_vector: np.ndarray | None = None
    ) -> None:
        """A user already appended to the store (`DocStore.add_user`) with its docs' vectors: its
        docs are filed under the index's centroids and it joins the nearest cohort, nothing rebuilt.
        `user_vector` defaults to the MEAN of `doc_vectors` (Eq. 1)."""
        if self.index is None:
            raise RuntimeError("ClusterRAG.prepare(store) must run before add_user")
        rows = self.store.rows(user_id)
        if len(rows) != len(doc_vectors) or (len(rows) and rows[0] != self.index.ntotal):
            raise ValueError(
                f"user {user_id!r}: the store holds rows {rows[:1]}..{rows[-1:]} but the index has "
                f"{self.index.ntotal} docs and {len(doc_vectors)} vectors were given"
            )
        if len(doc_vectors):
            self.index.add(doc_vectors)
        if self.cohorts is not None:
            vector = user_vector if user_vector is not None else (
                np.asarray(doc_vectors, np.float32).mean(axis=0) if len(doc_vectors) else None)
            if vector is None:
                log.warning(
                    "user %r has no docs and no user vector: not assigned to a cohort", user_id
                )
            else:
                self.cohorts.add(user_id, vector)
