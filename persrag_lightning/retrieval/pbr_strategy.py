"""PBR and its ablations as `Strategy`s of `persrag evaluate` (LaMP / SynthLaMP), next to CFRAG and the baselines.

A thin adapter: each query user's own history (corpus rows) becomes a PBR user index on first use; q* is searched
over those rows only. The LLM (for P-PRF) is loaded lazily and always used through the on-disk answer cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.retrieval.llm_cache import CachedLLM, Generator
from persrag_lightning.retrieval.pbr import PBRRetriever, PBRSettings


class PBRStrategy(Strategy):
    """`variant` is one of pbr.VARIANTS; `settings` the rest of PBR's knobs (switches are set from `variant`).

    `encode` / `llm` may be injected (tests, a shared encoder); otherwise `encoder` (a TextEncoder alias or folder)
    and `llm_backend` / `llm_model` are loaded on `prepare`.
    """

    def __init__(self, name: str | None = None, variant: str = "PBR", settings: PBRSettings | None = None,
                 encoder: str = "minilm", max_length: int = 256, llm_backend: str = "hf",
                 llm_model: str = "smollm2", llm_batch_size: int = 8, cache_dir: str = ".cache/pbr",
                 max_history: int | None = None, encode: Callable[[list[str]], np.ndarray] | None = None,
                 llm: Generator | None = None) -> None:
        self.settings = (settings or PBRSettings()).for_variant(variant)
        self.name = name or variant
        self.encoder_name, self.max_length = encoder, max_length
        self.llm_backend, self.llm_model, self.llm_batch_size = llm_backend, llm_model, llm_batch_size
        self.cache_dir = Path(cache_dir)
        self.max_history = max_history
        self._encode = encode
        self._llm = llm
        self.retriever: PBRRetriever | None = None
        self._rows: dict[str, np.ndarray] = {}

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
            llm = self._llm
            if llm is None:
                from persrag_lightning.llm.registry import load_llm

                llm = load_llm(self.llm_backend, self.llm_model, batch_size=self.llm_batch_size)
            cached = CachedLLM(llm, self.cache_dir / "llm", batch_size=self.llm_batch_size)
        self.retriever = PBRRetriever(encode, self.settings, cached, self.cache_dir / "anchors")
        self._rows = {}

    def _profile(self, query: Query) -> tuple[str, np.ndarray]:
        """The docs this query may see (its question's profile, data/histories.py), indexed for PBR once per
        distinct profile: the key is the user and a digest of the rows."""
        if query.user_id not in self.store:
            raise KeyError(f"user {query.user_id!r} has no history in the store")
        rows = self.store.rows(query.user_id, self.max_history, query)
        key = f"{query.user_id}#{hashlib.sha256(rows.tobytes()).hexdigest()[:12]}"
        if key not in self._rows:
            assert self.retriever is not None
            self.retriever.add_user(key, [self.store.text(int(r)) for r in rows])
            self._rows[key] = rows
        return key, rows

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        if self.retriever is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(store) must run before retrieve")
        out: list[list[RetrievedDoc]] = [[] for _ in queries]
        if k <= 0:
            return out
        by_profile: dict[str, list[int]] = {}
        for i, q in enumerate(queries):
            by_profile.setdefault(self._profile(q)[0], []).append(i)
        for key, idx in by_profile.items():
            rows = self._rows[key]
            rankings = self.retriever.retrieve(key, [queries[i].query for i in idx], k)
            for i, ranking in zip(idx, rankings):
                out[i] = [self.store.doc(int(rows[j]), retriever_score=s)
                          for j, s in zip(ranking.indices, ranking.scores)]
        return out
