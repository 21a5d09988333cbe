"""A million SynthLaMP users without a million users' text: histories drawn as the generator draws
them (community, length, kinds by the community's taste, each item's style), each item played by a
real doc of the same kind and style from a small embedded SynthLaMP, and embedded by a trained user
encoder — the system's own path to e_u.

Used by benchmarks/bench_retrieval.py for realistic user vectors at 1M users: the Gaussian mixture
it also samples is nearly isotropic within a community, the worst case for an ANN index and unlike
real users. The encoder is any module with the user encoder's config and call (`HistoryEncoder`), so
data/ needs nothing from models/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.histories import (
    FIRST_DOC_ID,
    PAD_ID,
    history_ids,
    pad_histories,
    visible_histories,
)
from persrag_lightning.data.records import LampDataset
from persrag_lightning.data.synth import iter_synth_users
from persrag_lightning.data.synth_world import SynthConfig, build_world, draw_histories
from persrag_lightning.progress import Progress

__all__ = ["ScaledSynthUsers"]


class HistoryEncoderConfig(Protocol):
    num_docs: int
    max_history: int
    dim: int


class HistoryEncoder(Protocol):
    """What the scaled users need of a user encoder (models.user_encoder.UserEncoder): its doc
    table's size, its history length and width, and doc-table ids [n, L] → e_u [n, dim]."""

    config: HistoryEncoderConfig

    def __call__(self, history: torch.Tensor) -> torch.Tensor: ...
    def eval(self) -> HistoryEncoder: ...
    def to(self, dtype: torch.dtype) -> HistoryEncoder: ...
    def float(self) -> HistoryEncoder: ...


DRAW_STREAM = 7  # rng stream of the drawn users (the generator uses 1 and 2), (seed, stream, chunk)


@dataclass
class DocsByKindStyle:
    """Corpus rows grouped by (kind, style), and by kind alone for an item whose style no real doc
    has."""

    rows: np.ndarray  # corpus rows sorted by key = kind * num_styles + style
    key_start: np.ndarray  # [num_kinds * num_styles + 1] CSR offsets into rows
    kind_rows: np.ndarray  # corpus rows sorted by kind
    kind_start: np.ndarray  # [num_kinds + 1]
    num_styles: int

    @classmethod
    def build(cls, rows: np.ndarray, kind: np.ndarray, style: np.ndarray, num_kinds: int,
              num_styles: int) -> DocsByKindStyle:
        key = kind * num_styles + style
        by_key, by_kind = np.argsort(key, kind="stable"), np.argsort(kind, kind="stable")
        key_start = np.searchsorted(key[by_key], np.arange(num_kinds * num_styles + 1))
        kind_start = np.searchsorted(kind[by_kind], np.arange(num_kinds + 1))
        return cls(rows[by_key], key_start, rows[by_kind], kind_start, num_styles)

    def sample(
        self, kind: np.ndarray, style: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, int]:
        """One corpus row per item with the item's kind and style (uniform among them); (rows, items
        that fell back to a doc of the same kind in another style)."""
        key = kind * self.num_styles + style
        lo, count = self.key_start[key], self.key_start[key + 1] - self.key_start[key]
        missing = count == 0
        if (self.kind_start[kind + 1] - self.kind_start[kind] == 0).any():
            raise ValueError(
                "a drawn kind has no doc in the corpus: not the world the corpus was generated from"
            )
        u = rng.random(len(key))
        out = self.rows[np.minimum(lo + (u * count).astype(np.int64), len(self.rows) - 1)]
        k = kind[missing]
        k_lo, k_count = self.kind_start[k], self.kind_start[k + 1] - self.kind_start[k]
        out[missing] = self.kind_rows[k_lo + (u[missing] * k_count).astype(np.int64)]
        return out, int(missing.sum())


class ScaledSynthUsers:
    """Users drawn from `config`'s world (its communities' tastes and styles) whose items are docs
    of the export's corpus; `encode` runs the export's user encoder over them (doc-table rows, as at
    export)."""

    def __init__(self, encoder: HistoryEncoder, dataset: LampDataset, config: SynthConfig) -> None:
        self.encoder, self.config = encoder.eval(), config
        self.world = build_world(config)
        corpus = Corpus.from_dataset(dataset)
        if encoder.config.num_docs != len(corpus.doc_ids):
            raise ValueError(
                f"the user encoder's doc table has {encoder.config.num_docs} rows but {config} makes a "
                f"corpus of {len(corpus.doc_ids)} docs: not the data it was trained on"
            )
        self.pools = visible_histories(dataset, corpus, encoder.config.max_history).pool
        self.pool_users = [u for u in corpus.user_ids if len(self.pools.get(u, ()))]
        row_of = {d: r for r, d in enumerate(corpus.doc_ids)}
        pooled = np.zeros(len(corpus.doc_ids), bool)
        for rows in self.pools.values():
            pooled[rows] = True
        rows, kinds, styles = [], [], []
        for user in iter_synth_users(config, self.world):
            for doc in user.docs:
                r = row_of.get(doc.doc_id)
                # docs the encoder trained on (never a test profile's)
                if r is not None and pooled[r]:
                    rows.append(r)
                    kinds.append(doc.kind)
                    styles.append(doc.style)
        self.docs = DocsByKindStyle.build(np.array(rows), np.array(kinds), np.array(styles),
                                          self.world.styles.shape[1], self.world.num_styles)
        self.fallbacks = 0

    @torch.inference_mode()
    def real_embeddings(self, batch_size: int = 256) -> torch.Tensor:
        """e_u of the export's own users recomputed from their pools: equal to the export's table
        when the corpus is the one it was trained on (the check that doc rows map right)."""
        hist = [history_ids(self.pools[u]) for u in self.pool_users]
        return torch.cat([self.encoder(pad_histories(hist[s:s + batch_size])).float()
                          for s in range(0, len(hist), batch_size)])

    def draw(self, n: int, seed: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(doc-table ids [n, L] right-padded, oldest first, the last max_history kept; communities
        [n])."""
        rng = np.random.default_rng([seed, DRAW_STREAM, chunk])
        h = draw_histories(rng, self.config, self.world, n)
        rows, missing = self.docs.sample(h.kind, h.style, rng)
        self.fallbacks += missing
        length = min(int(h.n_docs.max()), self.encoder.config.max_history)
        keep = np.maximum(h.n_docs - length, 0)  # oldest items dropped where a history is longer
        pos = np.arange(len(rows)) - h.starts[h.owner] - keep[h.owner]
        ids = np.full((n, length), PAD_ID, np.int64)
        ok = pos >= 0
        ids[h.owner[ok], pos[ok]] = rows[ok] + FIRST_DOC_ID
        return ids, h.comm

    @torch.inference_mode()
    def encode(self, n: int, seed: int, chunk_users: int = 50_000, batch_size: int = 1024,
               dtype: torch.dtype = torch.float32, progress: Progress | None = None) -> tuple[np.ndarray, np.ndarray]:
        """e_u [n, d] float32 and communities [n] of n drawn users, chunk by chunk (progress lines
        per chunk); batches of similar length (less padding); `dtype` bfloat16 runs the encoder
        faster on a CPU with native bf16, for vectors whose distribution, not last bits, matters (an
        index benchmark: docs/training/stages.md)."""
        encoder = self.encoder.to(dtype)
        out = np.empty((n, encoder.config.dim), np.float32)
        comm = np.empty(n, np.int64)
        try:
            for c, start in enumerate(range(0, n, chunk_users)):
                size = min(chunk_users, n - start)
                ids, comm[start:start + size] = self.draw(size, seed, c)
                by_length = np.argsort((ids != PAD_ID).sum(1), kind="stable")
                for s in range(0, size, batch_size):
                    rows = by_length[s:s + batch_size]
                    length = max(1, int((ids[rows] != PAD_ID).sum(1).max()))
                    batch = torch.from_numpy(ids[rows, :length])
                    out[start + rows] = encoder(batch).float().numpy()
                if progress is not None:
                    progress.advance(size)
        finally:
            self.encoder.float()
        return out, comm
