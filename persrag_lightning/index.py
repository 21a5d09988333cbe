"""Faiss indexes over L2-normalised vectors (inner product = cosine): exact, IVF or HNSW, GPU when
available.

Below `models/` in the layers (pyproject.toml's import-linter contract): the user encoder exports
its index with it, and retrieval and serving search it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import faiss
import numpy as np
import torch

from persrag_lightning.utils import atomic_replace

__all__ = ["BLAS_MIN_QUERIES", "FAISS_DEFAULT_BLAS_THRESHOLD", "IndexKind", "TorchFlatIndex",
           "build_index", "faiss_has_gpus", "index_kind", "index_params", "load_index",
           "normalized", "save_index", "search", "to_gpu_if_available"]

IndexKind = Literal["auto", "flat", "ivf", "hnsw"]

# The index parameters, in one place (export, evaluation, serving and purge all build through
# build_index), set from benchmarks/bench_retrieval.py (figures: docs/training/stages.md; top-6, d =
# 384, one search thread, 2 cores):
# - exact search grows with the users: "auto" keeps it (recall 1) up to 20k users, where it stays
#   under the goal of two milliseconds per query;
# - HNSW M 32, efConstruction 100, efSearch 64 over 1M users drawn as SynthLaMP draws them and
#   embedded by the trained encoder: well under the goal at recall@6 near 1, built in minutes with 2
#   threads (M 64 / efConstruction 200 doubles the build time and searches no faster at the same
#   recall). The Gaussian set (pessimistic, near-isotropic) needs a larger efSearch for the same
#   recall; efSearch is a search-time setting of the loaded index.
AUTO_EXACT_MAX_USERS = 20_000   # index "auto": exact (flat) up to this many users, HNSW above
HNSW_M = 32                     # links per node
# candidate list while linking (faiss's default, 40, loses recall at scale)
HNSW_EF_CONSTRUCTION = 100
HNSW_EF_SEARCH = 64             # candidate list per query
IVF_NPROBE = 16                 # lists scanned per query

# faiss (≥ 1.10; 1.15 here) sends a batch of nq queries to BLAS only when nq·d ≥ 128,000 — 334
# queries of 384-d. Below that, each query streams the whole table through a per-pair SIMD dot
# product, so a batch costs nq single queries, several times numpy's matmul
# (benchmarks/bench_retrieval.py; figures: docs/training/stages.md). With BLAS from 4 queries on,
# batches cost about what the matmul does; a single query stays on the SIMD path, which is faster
# there.
FAISS_DEFAULT_BLAS_THRESHOLD = 128_000
BLAS_MIN_QUERIES = 4


def _use_blas_for_batches(dim: int = 384, min_queries: int = BLAS_MIN_QUERIES) -> None:
    """Let faiss's exact search (flat indexes, IVF coarse quantizers, k-means assignment) use BLAS
    from `min_queries` queries of `dim` dimensions on (the threshold is global: larger dims switch a
    little earlier)."""
    faiss.cvar.distance_compute_blas_threshold = min_queries * dim


_use_blas_for_batches()


def normalized(vectors: np.ndarray) -> np.ndarray:
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    return vectors / np.clip(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12, None)


def resolve_kind(kind: IndexKind, n: int) -> IndexKind:
    """The concrete kind for `n` vectors: "auto" is exact up to AUTO_EXACT_MAX_USERS, HNSW above."""
    if kind == "auto":
        return "flat" if n <= AUTO_EXACT_MAX_USERS else "hnsw"
    if kind not in ("flat", "ivf", "hnsw"):
        raise ValueError(f"unknown index kind {kind!r}; expected auto, flat, ivf or hnsw")
    return kind


def build_index(vectors: np.ndarray, kind: IndexKind = "flat", nlist: int | None = None, nprobe: int = IVF_NPROBE,
                hnsw_m: int = HNSW_M, ef_construction: int = HNSW_EF_CONSTRUCTION,
                ef_search: int = HNSW_EF_SEARCH) -> faiss.Index:
    """Cosine index: exact, IVF (nlist ≈ 4·√n) or HNSW; "auto" picks by the number of vectors
    (resolve_kind)."""
    x = normalized(vectors)
    n, dim = x.shape
    kind = resolve_kind(kind, n)
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "ivf":
        nlist = nlist or max(1, min(n // 39, int(4 * np.sqrt(n))))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(x)
        index.nprobe = min(nprobe, nlist)
    else:
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        # before adding: it applies to each vector as it is linked
        index.hnsw.efConstruction = ef_construction
        index.hnsw.efSearch = ef_search
    index.add(x)
    return index


def index_kind(index: faiss.Index) -> IndexKind:
    """The kind of a built index, CPU or GPU (faiss has no GPU HNSW)."""
    if isinstance(index, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(index, (faiss.IndexIVF, *_gpu_classes("GpuIndexIVF"))):
        return "ivf"
    if isinstance(index, (faiss.IndexFlat, TorchFlatIndex, *_gpu_classes("GpuIndexFlat"))):
        return "flat"
    raise ValueError(f"not an index build_index makes: {type(index).__name__}")


def index_params(index: faiss.Index) -> dict:
    """build_index keyword arguments that rebuild `index`'s kind with its parameters (M,
    efConstruction, efSearch; nlist, nprobe), so a rebuild over other vectors (a deletion, a purge)
    searches as the original did."""
    kind = index_kind(index)
    if kind == "hnsw":
        # level ≥ 1 holds M links, level 0 2·M
        return {"kind": kind, "hnsw_m": int(index.hnsw.nb_neighbors(1)),
                "ef_construction": int(index.hnsw.efConstruction), "ef_search": int(index.hnsw.efSearch)}
    if kind == "ivf":
        return {"kind": kind, "nlist": int(index.nlist), "nprobe": int(index.nprobe)}
    return {"kind": kind}


def _gpu_classes(name: str) -> tuple[type, ...]:
    return (getattr(faiss, name),) if hasattr(faiss, name) else ()


class TorchFlatIndex:
    """Exact inner-product search on a CUDA device as one matmul + top-k in torch: the GPU path of
    every flat index, faiss-gpu installed or not. Over 1M users on an H200 it answered faster than
    faiss-gpu's GpuIndexFlatIP, one query at a time and in batches
    (docs/performance/user-retrieval.md, benchmarks/results/h200-2026-11-26/), and it runs on
    whatever CUDA torch was built for. float32 like faiss's IndexFlatIP, so the neighbours are the
    same up to float rounding. Duck-types the part of faiss.Index that UserIndex and save_index use
    (d, ntotal, add, search)."""

    # queries per matmul: a score per query and user, 1 GiB of float32 scratch at 1M users
    QUERY_CHUNK = 256

    def __init__(self, index: faiss.IndexFlat, device: str | torch.device = "cuda") -> None:
        if index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError("TorchFlatIndex holds cosine (inner-product) indexes only")
        self.d = int(index.d)
        # capacity ≥ ntotal
        self._rows = torch.from_numpy(index.reconstruct_n(0, index.ntotal)).to(device)
        self._n = int(index.ntotal)

    @property
    def ntotal(self) -> int:
        return self._n

    @property
    def table(self) -> torch.Tensor:
        return self._rows[:self._n]

    def add(self, vectors: np.ndarray) -> None:
        """Append rows; the buffer grows by a quarter at a time (1M users: 0.4 GB more, not 1.5), so
        adding users one at a time (a serving process's new users) does not copy the whole table
        each time."""
        x = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)).to(self._rows.device)
        if self._n + len(x) > len(self._rows):
            grown = self._rows.new_empty((max(len(self._rows) * 5 // 4, self._n + len(x)), self.d))
            grown[:self._n] = self.table
            self._rows = grown
        self._rows[self._n:self._n + len(x)] = x
        self._n += len(x)

    @torch.inference_mode()
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.table.device)
        parts = [torch.topk(q[s:s + self.QUERY_CHUNK] @ self.table.T, k, dim=-1)
                 for s in range(0, len(q), self.QUERY_CHUNK)]
        if not parts:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return (torch.cat([p.values for p in parts]).cpu().numpy(),
                torch.cat([p.indices for p in parts]).cpu().numpy())

    def to_faiss(self) -> faiss.IndexFlatIP:
        index = faiss.IndexFlatIP(self.d)
        index.add(self.table.cpu().numpy())
        return index


def faiss_has_gpus() -> bool:
    """Whether this faiss is a GPU build (faiss-gpu-cuvs, faiss-gpu) that sees a device."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def to_gpu_if_available(index: faiss.Index) -> faiss.Index | TorchFlatIndex:
    """The index on GPU 0 where one is usable: a flat index as a TorchFlatIndex whenever torch sees
    CUDA (faster than faiss-gpu's flat index, measured above), an IVF index through faiss-gpu when
    faiss is a GPU build; otherwise unchanged (IVF and HNSW stay on the CPU)."""
    if torch.cuda.is_available() and isinstance(index, faiss.IndexFlat):
        return TorchFlatIndex(index)
    if faiss_has_gpus() and isinstance(index, faiss.IndexIVF):
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
    return index


def save_index(index: faiss.Index | TorchFlatIndex, path: str | Path) -> None:
    if isinstance(index, TorchFlatIndex):
        index = index.to_faiss()
    if hasattr(faiss, "index_gpu_to_cpu") and not isinstance(
        index, (faiss.IndexFlat, faiss.IndexIVF, faiss.IndexHNSW)
    ):
        index = faiss.index_gpu_to_cpu(index)
    with atomic_replace(path) as tmp:
        faiss.write_index(index, str(tmp))


def load_index(path: str | Path) -> faiss.Index:
    return faiss.read_index(str(path))


def search(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (scores, ids) per query row; ids are -1 where the index holds fewer than k vectors."""
    return index.search(normalized(np.atleast_2d(queries)), min(k, index.ntotal))
