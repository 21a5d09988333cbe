"""Faiss indexes over L2-normalised vectors (inner product = cosine): exact, IVF or HNSW, GPU when available."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import faiss
import numpy as np

from persrag_lightning.utils import atomic_replace

IndexKind = Literal["flat", "ivf", "hnsw"]


def normalized(vectors: np.ndarray) -> np.ndarray:
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    return vectors / np.clip(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12, None)


def build_index(vectors: np.ndarray, kind: IndexKind = "flat", nlist: int | None = None, nprobe: int = 16,
                hnsw_m: int = 32) -> faiss.Index:
    """Cosine index: exact by default; IVF (nlist ≈ 4·√n) or HNSW for large user sets."""
    x = normalized(vectors)
    n, dim = x.shape
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "ivf":
        nlist = nlist or max(1, min(n // 39, int(4 * np.sqrt(n))))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(x)
        index.nprobe = min(nprobe, nlist)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    else:
        raise ValueError(f"unknown index kind {kind!r}; expected flat, ivf or hnsw")
    index.add(x)
    return index


def to_gpu_if_available(index: faiss.Index) -> faiss.Index:
    """Move an index to GPU 0 when faiss was built with GPUs (faiss-gpu); otherwise return it unchanged."""
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
    return index


def save_index(index: faiss.Index, path: str | Path) -> None:
    if hasattr(faiss, "index_gpu_to_cpu") and not isinstance(index, (faiss.IndexFlat, faiss.IndexIVF,
                                                                        faiss.IndexHNSW)):
        index = faiss.index_gpu_to_cpu(index)
    with atomic_replace(path) as tmp:
        faiss.write_index(index, str(tmp))


def load_index(path: str | Path) -> faiss.Index:
    return faiss.read_index(str(path))


def search(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (scores, ids) per query row; ids are -1 where the index holds fewer than k vectors."""
    return index.search(normalized(np.atleast_2d(queries)), min(k, index.ntotal))
