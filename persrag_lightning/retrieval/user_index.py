"""Top-m similar users over a user-embedding table (CFRAG §4.1.4) with faiss, and a torch
brute-force scan to compare it with; cosine similarity throughout, the query user is not excluded
(as the official code does)."""

from __future__ import annotations

from collections.abc import Sequence

import faiss
import numpy as np
import torch
import torch.nn.functional as F

from persrag_lightning.index import (
    IndexKind,
    build_index,
    index_kind,
    normalized,
    search,
    to_gpu_if_available,
)

__all__ = ["UserIndex", "torch_topk_users"]


def torch_topk_users(table: torch.Tensor, vectors: torch.Tensor, m: int,
                     normalize_table: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-m (cosine scores, table rows) per query by one matmul: the baseline indexes are
    measured by. A caller that scans many times normalises the table once and passes
    normalize_table=False."""
    table = F.normalize(table.float(), dim=-1) if normalize_table else table
    vectors = F.normalize(torch.atleast_2d(vectors.float()), dim=-1)
    return torch.topk(vectors @ table.T, min(m, table.shape[0]), dim=-1)


class UserIndex:
    """User ids + a faiss cosine index over their embeddings: exact ("flat"), "ivf" or "hnsw", on
    GPU when faiss has GPUs (flat and IVF; faiss has no GPU HNSW). `add` makes new users retrievable
    at once."""

    def __init__(
        self, index: faiss.Index, user_ids: Sequence[str] = (), kind: IndexKind = "flat"
    ) -> None:
        if index.ntotal != len(user_ids):
            raise ValueError(
                f"index holds {index.ntotal} vectors but {len(user_ids)} user ids were given"
            )
        self.index = index
        self.kind = kind
        self.user_ids: list[str] = list(user_ids)
        self._row: dict[str, int] = {u: i for i, u in enumerate(self.user_ids)}
        if len(self._row) != len(self.user_ids):
            raise ValueError("user ids must be unique")

    @classmethod
    def build(cls, user_ids: Sequence[str], vectors: np.ndarray | torch.Tensor, kind: IndexKind = "flat",
              gpu: bool = True, **params) -> UserIndex:
        """Index `vectors` (row i = user_ids[i]) with build_index ("auto" resolved by the number of
        users); `params` are build_index's (nlist, nprobe, hnsw_m, ef_construction, ef_search;
        defaults in index.py)."""
        x = _numpy(vectors)
        if len(user_ids) != x.shape[0]:
            raise ValueError(f"{len(user_ids)} user ids for {x.shape[0]} vectors")
        return cls.wrap(build_index(x, kind, **params), user_ids, gpu)

    @classmethod
    def wrap(cls, index: faiss.Index, user_ids: Sequence[str], gpu: bool = True) -> UserIndex:
        """A built (or exported, loaded) index of `user_ids`' vectors, moved to GPU when it can be
        (flat, IVF)."""
        kind = index_kind(index)
        if gpu and kind != "hnsw":
            index = to_gpu_if_available(index)
        return cls(index, user_ids, kind)

    def __len__(self) -> int:
        return len(self.user_ids)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    def add(self, user_ids: Sequence[str], vectors: np.ndarray | torch.Tensor) -> None:
        """Append users: IVF files them under its trained centroids, HNSW links them; nothing is
        rebuilt."""
        x = _numpy(vectors)
        if len(user_ids) != x.shape[0]:
            raise ValueError(f"{len(user_ids)} user ids for {x.shape[0]} vectors")
        dup = [u for u in user_ids if u in self._row]
        if dup or len(set(user_ids)) != len(user_ids):
            raise ValueError(
                f"users already indexed or repeated: {dup[:5] or 'repeated ids in the batch'}"
            )
        self.index.add(normalized(x))
        for u in user_ids:
            self._row[u] = len(self.user_ids)
            self.user_ids.append(u)

    def search_rows(
        self, vectors: np.ndarray | torch.Tensor, m: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-m (cosine scores, table rows) per query; rows -1 (scores -inf) where fewer than m are
        found."""
        x = _numpy(vectors)
        if len(self) == 0 or m <= 0:
            return np.zeros((len(x), 0), np.float32), np.zeros((len(x), 0), np.int64)
        scores, rows = search(self.index, x, m)
        scores = np.where(rows < 0, -np.inf, scores).astype(np.float32)
        return scores, rows.astype(np.int64)

    def search(
        self, vectors: np.ndarray | torch.Tensor, m: int
    ) -> tuple[np.ndarray, list[list[str]]]:
        """Top-m (cosine scores [n, m'], user ids) per query, best first; m' = min(m, users)."""
        scores, rows = self.search_rows(vectors, m)
        return scores, [[self.user_ids[r] for r in row if r >= 0] for row in rows]

    def __contains__(self, user_id: str) -> bool:
        return user_id in self._row


def _numpy(vectors: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(vectors, torch.Tensor):
        vectors = vectors.detach().float().cpu().numpy()
    return np.atleast_2d(np.ascontiguousarray(vectors, dtype=np.float32))
