"""PBR (seed 001): personalized query expansion by P-PRF (LLM pseudo-feedback) + P-Anchor (PageRank
anchor) + fusion.

One function per equation of the paper (named after it, the equation in a comment), a `PBRRetriever`
with switches for the four variants of the evaluation (PBR, PBR w/o P-PRF, PBR w/o P-Anchor, Base;
the settings are pbr_settings.py's), and `expand_query`, the vector-level fusion that CFRAG's
retriever can apply to its first-stage query.

Embeddings are L2-normalised float32 numpy rows (the encoder's output); each user searches only
their own chunks with exact inner product (faiss IndexFlatIP), as the paper and the PersonaBench
protocol do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from persrag_lightning.retrieval.llm_cache import CachedLLM
from persrag_lightning.retrieval.pbr_anchor import (
    PageRankResult,
    anchor_embedding,
    cosine_similarity_matrix,
    pagerank,
    sparse_adjacency,
    transition_matrix,
)
from persrag_lightning.retrieval.pbr_prompts import (
    JSONSchemaLLM,
    constrained_cache,
    format_history,
    json_candidates,
    parse_utterances,
    reasoning_prompt,
    utterance_prompt,
    utterance_schema,
)
from persrag_lightning.retrieval.pbr_settings import VARIANTS, PBRSettings

__all__ = ["VARIANTS", "Encode", "PBRRetriever", "PBRSettings", "PseudoFeedback", "expand_query"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------- P-PRF (Eqs. 4-6)

def personal_history(query_emb: np.ndarray, chunk_embs: np.ndarray, k1: int) -> np.ndarray:
    """Eq. 4, H_q = TopK_t sim(q, c_t), |H_q| = k1: indices of the user's k1 nearest chunks, best
    first (all of them when the user has fewer than k1)."""
    scores = chunk_embs @ query_emb
    order = np.argsort(-scores, kind="stable")
    return order[:min(k1, len(order))]


def _mean_utterance_embedding(utterance_embs: np.ndarray, dim: int) -> np.ndarray:
    """Eq. 5, f_avg = (1/m) Σ_i φ(f_i); zero when there is no utterance (the fusion then ignores
    it)."""
    if len(utterance_embs) == 0:
        return np.zeros(dim, dtype=np.float32)
    return utterance_embs.mean(axis=0).astype(np.float32)


# ----------------------------------------------------------------------------- P-Anchor (Eqs. 7-10)

def user_anchor(chunk_embs: np.ndarray, settings: PBRSettings) -> tuple[np.ndarray, PageRankResult]:
    """Eqs. 7-10 for one user: graph, PageRank, anchor."""
    adjacency = sparse_adjacency(cosine_similarity_matrix(chunk_embs), settings.theta, settings.k2,
                                 settings.self_in_top_k2)
    result = pagerank(
        transition_matrix(adjacency), settings.damping, settings.max_iter, settings.tol
    )
    return anchor_embedding(result.pi, chunk_embs), result


def _anchor_fingerprint(chunk_embs: np.ndarray, settings: PBRSettings) -> str:
    """Cache key of an anchor: the user's chunk embeddings (bytes) and the graph/PageRank
    settings."""
    h = hashlib.sha256(np.ascontiguousarray(chunk_embs, dtype=np.float32).tobytes())
    h.update(json.dumps([chunk_embs.shape, settings.theta, settings.k2, settings.damping, settings.max_iter,
                         settings.tol] + ([] if settings.self_in_top_k2 else ["k2-others"])).encode())
    return h.hexdigest()[:20]


# ------------------------------------------------------------------------------ fusion (Eqs. 11-14)

def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """sim(·,·) of Eqs. 11-12; 0 when either vector is zero (a missing signal)."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return 0.0 if na == 0.0 or nb == 0.0 else float(a @ b) / (na * nb)


def fusion_weight(query_emb: np.ndarray, anchor: np.ndarray, feedback: np.ndarray) -> float:
    """Eqs. 11-12, w = 1 + sim((q + c_Anchor)/2, f) for f = f_avg (w1) or f = r (w2)."""
    return 1.0 + cosine((query_emb + anchor) / 2.0, feedback)


def _personalization_shift(anchor: np.ndarray, w1: float, f_avg: np.ndarray, w2: float, r: np.ndarray
                          ) -> np.ndarray:
    """Eq. 13, Δ_user = c_Anchor + w1 · f_avg + w2 · r."""
    return anchor + w1 * f_avg + w2 * r


def _personalized_query(query_emb: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Eq. 14, q* = q + Δ_user."""
    return query_emb + shift


def expand_query(query_emb: np.ndarray, anchor: np.ndarray | None = None, f_avg: np.ndarray | None = None,
                 r: np.ndarray | None = None) -> np.ndarray:
    """q* of Eqs. 11-14 from whatever signals are given (None = module switched off = zero vector),
    so the ablations are the same code: no anchor → w from q alone; no feedback → q* = q + c;
    nothing → q* = q. This is the transform CFRAG's first-stage retriever can apply to its query
    embedding."""
    q = np.asarray(query_emb, dtype=np.float32)
    zero = np.zeros_like(q)
    c = zero if anchor is None else np.asarray(anchor, dtype=np.float32)
    f = zero if f_avg is None else np.asarray(f_avg, dtype=np.float32)
    rv = zero if r is None else np.asarray(r, dtype=np.float32)
    w1 = fusion_weight(q, c, f) if f_avg is not None else 0.0
    w2 = fusion_weight(q, c, rv) if r is not None else 0.0
    return _personalized_query(q, _personalization_shift(c, w1, f, w2, rv)).astype(np.float32)


# ---------------------------------------------------------------------------------------- retriever

@dataclass(frozen=True)
class PseudoFeedback:
    """P-PRF's output for one query: the history used, the utterances and the reasoning text."""

    history: tuple[int, ...]
    utterances: tuple[str, ...]
    reasoning: str
    parsed_json: bool = False  # False: the LLM's answer was not JSON candidates (raw-text fallback)


@dataclass(frozen=True)
class Ranking:
    """Top-k chunk indices of a user (best first) with their inner-product scores and q*'s
    diagnostics."""

    indices: tuple[int, ...]
    scores: tuple[float, ...]
    w1: float = 0.0
    w2: float = 0.0
    feedback: PseudoFeedback | None = None


@dataclass
class PBRUserIndex:
    """A user's chunks with their embeddings and an exact inner-product faiss index."""

    texts: list[str]
    embeddings: np.ndarray
    index: object = field(repr=False)


@dataclass
class PBRStats:
    """Counters a benchmark reports: LLM prompts sent vs. read from cache, PageRank seconds per
    user."""

    llm_calls: int = 0
    llm_hits: int = 0
    anchors_built: int = 0
    anchor_hits: int = 0
    pagerank_seconds: list[float] = field(default_factory=list)
    pagerank_steps: list[int] = field(default_factory=list)
    pagerank_not_converged: int = 0  # anchors whose power iteration stopped at max_iter above tol
    # the last L1 change of each built anchor
    pagerank_residuals: list[float] = field(default_factory=list)


Encode = Callable[[list[str]], np.ndarray]


def _faiss_index(embeddings: np.ndarray) -> object:
    import faiss

    index = faiss.IndexFlatIP(embeddings.shape[1])
    index.add(np.ascontiguousarray(embeddings, dtype=np.float32))
    return index


class PBRRetriever:
    """The four variants as one class: `settings.use_prf` / `settings.use_anchor` switch P-PRF and
    P-Anchor.

    `encode` maps texts to L2-normalised float32 rows (e.g. `TextEncoder.encode(...).numpy()`);
    `llm` is needed only with P-PRF and is always used through the on-disk cache. Anchors are
    memoised per user by `_anchor_fingerprint`, so several variants or queries of one user build the
    graph once.
    """

    def __init__(self, encode: Encode, settings: PBRSettings | None = None, llm: CachedLLM | None = None,
                 anchor_dir: str | Path | None = None) -> None:
        self.encode = encode
        self.settings = settings or PBRSettings()
        if self.settings.use_prf and llm is None:
            raise ValueError(
                f"variant {self.settings.variant!r} uses P-PRF and needs an LLM (CachedLLM)"
            )
        self.llm = llm
        self.anchor_dir = Path(anchor_dir) if anchor_dir is not None else None
        self.users: dict[str, PBRUserIndex] = {}
        self._anchors: dict[str, np.ndarray] = {}
        self.stats = PBRStats()
        self._utterance_llm: CachedLLM | None = None
        self._utterance_for: tuple | None = None

    @property
    def utterance_llm(self) -> CachedLLM | None:
        """The LLM of the utterance prompt: schema-constrained when `json_schema` is on and the
        backend can."""
        if self.llm is None:
            return None
        key = (id(self.llm), self.settings.json_schema, self.settings.max_utterances,
               self.settings.utterance_tokens)
        if self._utterance_for != key:
            constrained = (constrained_cache(self.llm, utterance_schema(self.settings.max_utterances,
                                                                    self.settings.utterance_tokens))
                           if self.settings.json_schema else None)
            if self.settings.json_schema and constrained is None:
                log.warning("the P-PRF LLM %s cannot constrain its decoding to JSON; utterances are decoded "
                            "freely (answers that are not JSON fall back to raw text)", self.llm.fingerprint)
            self._utterance_llm, self._utterance_for = constrained or self.llm, key
        return self._utterance_llm

    @property
    def json_constrained(self) -> bool:
        """Whether utterance answers are decoded under the JSON schema."""
        llm = self.utterance_llm
        return llm is not None and isinstance(llm.llm, JSONSchemaLLM)

    def with_settings(self, settings: PBRSettings) -> PBRRetriever:
        """Same users, indexes, anchors and LLM under other settings (for variants: nothing is
        re-embedded)."""
        other = PBRRetriever(self.encode, settings, self.llm, self.anchor_dir)
        other.users, other._anchors, other.stats = self.users, self._anchors, self.stats
        return other

    def add_user(
        self, user_id: str, texts: list[str], embeddings: np.ndarray | None = None
    ) -> None:
        """Index a user's chunks (embedded now unless given)."""
        if not texts:
            raise ValueError(f"user {user_id!r} has no chunks to search")
        embs = self.encode(texts) if embeddings is None else embeddings
        embs = np.ascontiguousarray(embs, dtype=np.float32)
        self.users[user_id] = PBRUserIndex(list(texts), embs, _faiss_index(embs))

    def anchor(self, user_id: str) -> np.ndarray:
        """c_Anchor of a user, from memory, from `anchor_dir`, or built (and stored there)."""
        user = self.users[user_id]
        key = _anchor_fingerprint(user.embeddings, self.settings)
        if key in self._anchors:
            self.stats.anchor_hits += 1
            return self._anchors[key]
        path = self.anchor_dir / f"{key}.npy" if self.anchor_dir is not None else None
        if path is not None and path.is_file():
            anchor = np.load(path)
            self.stats.anchor_hits += 1
        else:
            t0 = time.perf_counter()
            anchor, result = user_anchor(user.embeddings, self.settings)
            self.stats.pagerank_seconds.append(time.perf_counter() - t0)
            self.stats.pagerank_steps.append(result.steps)
            self.stats.pagerank_residuals.append(result.residual)
            self.stats.anchors_built += 1
            if not result.converged:
                self.stats.pagerank_not_converged += 1
                log.warning("PageRank of user %r did not converge: L1 change %.3g > tol %.3g after %d steps "
                            "(damping %.3g); the anchor uses the last iterate", user_id, result.residual,
                            self.settings.tol, result.steps, self.settings.damping)
            if path is not None:
                from persrag_lightning.utils import atomic_replace

                with atomic_replace(path) as tmp, open(tmp, "wb") as f:
                    np.save(f, anchor)
        self._anchors[key] = anchor
        return anchor

    def prompts(
        self, user_id: str, queries: list[str], query_embs: np.ndarray
    ) -> list[tuple[str, str, tuple]]:
        """(utterance prompt, reasoning prompt, H_q indices) per query."""
        user = self.users[user_id]
        out = []
        for text, q in zip(queries, query_embs):
            hist = personal_history(q, user.embeddings, self.settings.k1)
            history = format_history([user.texts[i] for i in hist], self.settings.history_chars)
            out.append((utterance_prompt(history, text), reasoning_prompt(history, text), tuple(int(i) for i in hist)))
        return out

    def pseudo_feedback(self, user_id: str, queries: list[str], query_embs: np.ndarray,
                        shard: int = 0, num_shards: int = 1) -> list[PseudoFeedback | None]:
        """P-PRF for a user's queries: both prompts of all queries in one cached batch (None:
        another shard's)."""
        assert self.llm is not None
        prompts = self.prompts(user_id, queries, query_embs)
        utt_llm = self.utterance_llm
        assert utt_llm is not None
        # progress lines only where a user's batch is longer than one LLM batch (a benchmark, a
        # Slurm shard)
        utt_answers, s1 = utt_llm.generate([p[0] for p in prompts], self.settings.utterance_tokens, shard,
                                           num_shards, phase=f"PBR pseudo-utterances, {user_id}")
        rea_answers, s2 = self.llm.generate([p[1] for p in prompts], self.settings.reasoning_tokens, shard,
                                            num_shards, phase=f"PBR pseudo-reasoning, {user_id}")
        self.stats.llm_calls += s1.calls + s2.calls
        self.stats.llm_hits += s1.hits + s2.hits
        out: list[PseudoFeedback | None] = []
        for (_, _, hist), utt, rea in zip(prompts, utt_answers, rea_answers):
            if utt is None or rea is None:
                out.append(None)
                continue
            out.append(PseudoFeedback(hist, tuple(parse_utterances(utt, self.settings.max_utterances)), rea.strip(),
                                      json_candidates(utt) is not None))
        return out

    def prefetch(self, groups: list[tuple[str, list[str], np.ndarray]]) -> None:
        """P-PRF answers of many users' queries (user, queries, query embeddings) generated in LLM
        batches across users, with progress: per user, a LaMP user's one question would leave every
        LLM batch at size 1. The per-user pass then reads them from the store; they are counted
        once, as calls."""
        if self.llm is None or not self.settings.use_prf:
            return
        prompts = [
            p for user_id, queries, embs in groups for p in self.prompts(user_id, queries, embs)
        ]
        utt_llm = self.utterance_llm
        assert utt_llm is not None
        _, s1 = utt_llm.generate([p[0] for p in prompts], self.settings.utterance_tokens,
                                 phase="PBR pseudo-utterances")
        _, s2 = self.llm.generate([p[1] for p in prompts], self.settings.reasoning_tokens,
                                  phase="PBR pseudo-reasoning")
        self.stats.llm_calls += s1.calls + s2.calls
        # the per-user pass finds them in the store: not hits
        self.stats.llm_hits -= s1.calls + s2.calls

    def fill_cache(
        self, user_id: str, queries: list[str], shard: int = 0, num_shards: int = 1
    ) -> None:
        """Generate this shard's missing LLM answers for a user's queries (a Slurm array task's
        whole job)."""
        self.pseudo_feedback(user_id, queries, self.encode(queries), shard, num_shards)

    def expanded_queries(
        self, user_id: str, queries: list[str], query_embs: np.ndarray | None = None
    ) -> tuple[np.ndarray, list[tuple[float, float]], list[PseudoFeedback | None]]:
        """q* per query (rows), with (w1, w2) and the pseudo-feedback used."""
        q_embs = (
            self.encode(queries) if query_embs is None else np.asarray(query_embs, dtype=np.float32)
        )
        dim = q_embs.shape[1]
        anchor = self.anchor(user_id) if self.settings.use_anchor else None
        feedback: list[PseudoFeedback | None] = [None] * len(queries)
        f_avgs: list[np.ndarray | None] = [None] * len(queries)
        rs: list[np.ndarray | None] = [None] * len(queries)
        if self.settings.use_prf:
            feedback = self.pseudo_feedback(user_id, queries, q_embs)
            if any(fb is None for fb in feedback):
                raise RuntimeError("some LLM answers are missing (sharded cache not filled)")
            utts = [u for fb in feedback for u in fb.utterances]  # type: ignore[union-attr]
            texts = utts + [fb.reasoning for fb in feedback]  # type: ignore[union-attr]
            embs = self.encode(texts) if texts else np.zeros((0, dim), dtype=np.float32)
            start = 0
            for i, fb in enumerate(feedback):
                m = len(fb.utterances)  # type: ignore[union-attr]
                f_avgs[i] = _mean_utterance_embedding(embs[start:start + m], dim)
                start += m
                rs[i] = embs[len(utts) + i] if fb.reasoning else np.zeros(dim, dtype=np.float32)  # type: ignore
        rows, weights = [], []
        for i, q in enumerate(q_embs):
            rows.append(expand_query(q, anchor, f_avgs[i], rs[i]))
            c = np.zeros(dim, dtype=np.float32) if anchor is None else anchor
            weights.append((fusion_weight(q, c, f_avgs[i]) if f_avgs[i] is not None else 0.0,
                            fusion_weight(q, c, rs[i]) if rs[i] is not None else 0.0))
        return np.stack(rows).astype(np.float32), weights, feedback

    def retrieve(self, user_id: str, queries: list[str], k: int | None = None,
                 query_embs: np.ndarray | None = None) -> list[Ranking]:
        """Top-k of the user's own chunks for q* by exact inner product (fewer when the user has
        fewer chunks)."""
        k = self.settings.top_k if k is None else k
        user = self.users[user_id]
        q_star, weights, feedback = self.expanded_queries(user_id, queries, query_embs)
        scores, idx = user.index.search(q_star, min(k, len(user.texts)))  # type: ignore[attr-defined]
        return [Ranking(tuple(int(j) for j in row_i if j >= 0), tuple(float(s) for s, j in zip(row_s, row_i) if j >= 0),
                        w[0], w[1], fb)
                for row_i, row_s, w, fb in zip(idx, scores, weights, feedback)]

    def describe(self) -> str:
        return json.dumps(asdict(self.settings), sort_keys=True)
