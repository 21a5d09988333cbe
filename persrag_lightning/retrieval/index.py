"""Faiss indexes over L2-normalised vectors (inner product = cosine): exact, IVF or HNSW, GPU when available."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import faiss
import numpy as np

from persrag_lightning.utils import atomic_replace

IndexKind = Literal["flat", "ivf", "hnsw"]

# faiss (≥ 1.10; 1.15 here) sends a batch of nq queries to BLAS only when nq·d ≥ 128,000 — 334 queries of 384-d.
# Below that, each query streams the whole table through a per-pair SIMD dot product, so a batch costs nq single
# queries: 5.3–6.0 ms per query at any batch size over 100k × 384 on one thread, against 0.8–1.2 ms for numpy's
# matmul (benchmarks/bench_retrieval.py, "batched exact search"). With BLAS from 4 queries on, batches of 64 cost
# 0.84 ms and of 256 0.71 ms per query; a single query stays on the SIMD path, which is faster there (5.9 vs 12 ms).
FAISS_DEFAULT_BLAS_THRESHOLD = 128_000
BLAS_MIN_QUERIES = 4


def use_blas_for_batches(dim: int = 384, min_queries: int = BLAS_MIN_QUERIES) -> None:
    """Let faiss's exact search (flat indexes, IVF coarse quantizers, k-means assignment) use BLAS from
    `min_queries` queries of `dim` dimensions on (the threshold is global: larger dims switch a little earlier)."""
    faiss.cvar.distance_compute_blas_threshold = min_queries * dim


use_blas_for_batches()


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
