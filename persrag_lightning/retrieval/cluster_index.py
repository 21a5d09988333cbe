"""ClusterRAG's cluster-level document index (seed 002, §4.2): docs grouped into clusters whose
centroids form the index; a query keeps the top B clusters and ranks only the docs inside them, O(K
+ B·N/K) instead of O(N).

The seed's code re-clusters the candidate docs with HDBSCAN on every query, keeps no index and
hard-codes B = 1 (REFERENCE.md). Here the clusters are built once and persisted as a faiss
IndexIVFFlat over inner product on L2-normalised vectors: its coarse quantizer *is* the centroid
index and nprobe *is* B. A query restricted to some users' docs (`search_within`) groups just those
docs by their cluster, takes each group's mean as its centroid (what the seed's per-query clustering
computes over the candidates) and keeps the top B groups.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import ClassVar, Literal

import faiss
import numpy as np

from persrag_lightning.utils import atomic_replace, atomic_write_json, fingerprint

__all__ = ["ClusterIndex", "ClusterIndexSettings"]

log = logging.getLogger(__name__)

FORMAT = "persrag-cluster-index/v1"
DocClusterMethod = Literal["kmeans", "hdbscan"]
FillRule = Literal["fewer", "next_cluster"]


class ClusterIndexWarning(UserWarning):
    """A setting that cannot hold as asked (B > clusters, more clusters than docs): clamped, and
    said so."""


@dataclass(frozen=True)
class ClusterIndexSettings:
    """How docs are clustered and how many clusters a query visits.

    Args:
        top_b: B, the clusters a query visits: the seed's code hard-codes B = 1 (the paper leaves it
            open); a query-time setting.
        fill: when the top-B clusters of a query's candidates hold fewer than k docs: `fewer`
            returns them (the seed's code), `next_cluster` adds the next-best clusters until k docs
            are in; a query-time setting.
        method: `kmeans` (ours: it scales to the whole corpus; the seed runs HDBSCAN per query) or
            `hdbscan`.
        n_clusters: K for k-means; None = 4·√N, at most N/39 (faiss' k-means rule), at least 1.
        min_cluster_size: HDBSCAN's smallest cluster of docs, as the seed's user clustering.
        kmeans_iter: k-means iterations.
        seed: k-means' seed.
    """

    top_b: int = 1
    fill: FillRule = "fewer"
    method: DocClusterMethod = "kmeans"
    n_clusters: int | None = None
    min_cluster_size: int = 2
    kmeans_iter: int = 20
    seed: int = 0

    def build_key(self) -> ClusterIndexSettings:
        """The settings that shape the built index (B and the fill rule apply at query time: not in
        the key)."""
        return replace(self, top_b=1, fill="fewer")


@dataclass(frozen=True)
class ClusterIndexMeta:
    """cluster_index-<fp>.json, written last: its presence means the index and its list file are
    complete."""

    format: str
    fingerprint: str
    settings: ClusterIndexSettings
    docs: int
    dim: int
    clusters: int


@dataclass(frozen=True)
class SearchResult:
    """Scores [n, k] (cosine, -inf where missing) and rows [n, k] (-1 where missing), best first."""

    scores: np.ndarray
    rows: np.ndarray


def default_n_clusters(n_docs: int) -> int:
    """K ≈ 4·√N (faiss' guideline for IVF), capped so every centroid gets ≥ 39 training docs, at
    least 1."""
    return max(1, min(int(4 * np.sqrt(n_docs)), n_docs // 39))


def _normalized(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32).copy()
    faiss.normalize_L2(x)
    return x


def _hdbscan_centroids(x: np.ndarray, settings: ClusterIndexSettings) -> np.ndarray:
    """Normalised mean of each HDBSCAN cluster; noise docs are filed under their nearest centroid by
    IVF `add`."""
    from sklearn.cluster import HDBSCAN

    labels = HDBSCAN(min_cluster_size=max(2, settings.min_cluster_size), metric="euclidean",
                     copy=True).fit_predict(x) \
        if len(x) >= 2 else np.full(len(x), -1)
    k = int(labels.max()) + 1
    if k == 0:
        warnings.warn(f"HDBSCAN found no cluster among {len(x)} docs (all noise): the index has one cluster, "
                      "the mean of all docs", ClusterIndexWarning, stacklevel=4)
        return _normalized(x.mean(axis=0, keepdims=True))
    return _normalized(np.stack([x[labels == c].mean(axis=0) for c in range(k)]))


class ClusterIndex:
    """A persisted IVF index over docs plus each doc's cluster; rows are the caller's row ids
    (0..N-1)."""

    # how many indexes this process has trained (tests assert a reload trains none)
    builds: ClassVar[int] = 0

    def __init__(self, index: faiss.IndexIVFFlat, lists: np.ndarray, settings: ClusterIndexSettings,
                 data_fingerprint: str = "", path: Path | None = None, loaded: bool = False) -> None:
        self.index = index
        self.lists = lists
        self.settings = settings
        self.fingerprint = data_fingerprint
        self.path = path
        self.loaded = loaded  # True: read from disk; False: trained in this process
        self._warned_b: set[int] = set()
        self._centroids: np.ndarray | None = None

    # ---- build / persist -------------------------------------------------------------------------
    @classmethod
    def build(cls, vectors: np.ndarray, settings: ClusterIndexSettings | None = None,
              data_fingerprint: str = "") -> ClusterIndex:
        """Cluster the docs (row i = vectors[i]) and file each under its centroid; trains once."""
        settings = settings or ClusterIndexSettings()
        x = _normalized(vectors)
        n, dim = x.shape
        if n == 0:
            raise ValueError("cannot build a cluster index over zero docs")
        quantizer = faiss.IndexFlatIP(dim)
        if settings.method == "hdbscan":
            centroids = _hdbscan_centroids(x, settings)
            index = faiss.IndexIVFFlat(quantizer, dim, len(centroids), faiss.METRIC_INNER_PRODUCT)
            quantizer.add(centroids)
            index.is_trained = True
        else:
            k = settings.n_clusters or default_n_clusters(n)
            if k > n:
                warnings.warn(f"n_clusters={k} > {n} docs; using {n} clusters", ClusterIndexWarning, stacklevel=2)
                k = n
            index = faiss.IndexIVFFlat(quantizer, dim, k, faiss.METRIC_INNER_PRODUCT)
            index.cp.niter = settings.kmeans_iter
            index.cp.seed = settings.seed
            # small corpora: no faiss warning, k is already capped
            index.cp.min_points_per_centroid = 1
            index.cp.spherical = True
            index.train(x)
        index.add(x)
        index.make_direct_map()  # reconstruct(row) for `search_within`; serialised with the index
        _, lists = index.quantizer.search(x, 1)
        ClusterIndex.builds += 1
        log.info("cluster index: %d docs in %d clusters (%s)", n, index.nlist, settings.method)
        return cls(index, lists[:, 0].astype(np.int64), settings, data_fingerprint)

    @staticmethod
    def key(
        vectors: np.ndarray, settings: ClusterIndexSettings, data_key: str | None = None
    ) -> str:
        """Fingerprint of (doc vectors or the caller's key for them, build settings): changed data
        rebuilds."""
        data = data_key or hashlib.sha256(np.ascontiguousarray(vectors, dtype=np.float32).tobytes()).hexdigest()
        # keys of older indexes
        shape = {k: v for k, v in asdict(settings.build_key()).items() if k != "fill"}
        return fingerprint(FORMAT, data, np.shape(vectors), shape)

    @classmethod
    def build_or_load(cls, vectors: np.ndarray, cache_dir: str | Path, settings: ClusterIndexSettings | None = None,
                      data_key: str | None = None) -> ClusterIndex:
        """Load `cache_dir/cluster_index-<fingerprint>.*` if present, else build and save it.
        `data_key` (e.g. the corpus-embedding cache key) spares hashing the vectors; without it
        their bytes are hashed."""
        settings = settings or ClusterIndexSettings()
        fp = cls.key(vectors, settings, data_key)
        base = Path(cache_dir) / f"cluster_index-{fp}"
        if base.with_suffix(".json").exists():
            found = cls.load(base)
            found.settings = replace(found.settings, top_b=settings.top_b, fill=settings.fill)
            return found
        built = cls.build(vectors, settings, fp)
        built.save(base)
        return built

    def save(self, base: str | Path) -> Path:
        """Write `<base>.faiss`, `<base>.lists.npy`, then `<base>.json` (the completion marker),
        atomically."""
        base = Path(base)
        base.parent.mkdir(parents=True, exist_ok=True)
        with atomic_replace(base.with_suffix(".faiss")) as tmp:
            faiss.write_index(self.index, str(tmp))
        with atomic_replace(base.with_suffix(".lists.npy")) as tmp, open(tmp, "wb") as f:
            np.save(f, self.lists)
        meta = ClusterIndexMeta(FORMAT, self.fingerprint, self.settings.build_key(), self.ntotal, self.dim,
                                self.n_clusters)
        atomic_write_json(base.with_suffix(".json"), asdict(meta))
        self.path = base
        return base

    @classmethod
    def load(cls, base: str | Path) -> ClusterIndex:
        base = Path(base)
        meta_path = base.with_suffix(".json")
        if not meta_path.exists():
            raise FileNotFoundError(f"no cluster index at {meta_path}")
        raw = json.loads(meta_path.read_text())
        meta = ClusterIndexMeta(**{**raw, "settings": ClusterIndexSettings(**{
            k: v for k, v in raw["settings"].items() if k != "fill"})})
        if meta.format != FORMAT:
            raise ValueError(f"{meta_path}: format {meta.format!r}, expected {FORMAT!r}")
        index = faiss.read_index(str(base.with_suffix(".faiss")))
        lists = np.load(base.with_suffix(".lists.npy"))
        if index.ntotal != meta.docs or len(lists) != meta.docs:
            raise ValueError(
                f"{base}: index holds {index.ntotal} docs, lists {len(lists)}, meta {meta.docs}"
            )
        log.info(
            "cluster index loaded from %s (%d docs, %d clusters)", base, meta.docs, meta.clusters
        )
        return cls(index, lists, meta.settings, meta.fingerprint, base, loaded=True)

    def add(self, vectors: np.ndarray) -> np.ndarray:
        """File new docs (a user added at serving time) under the trained centroids, nothing
        re-clustered; returns their rows. The in-memory index then differs from its file, whose
        fingerprint named the old data."""
        x = _normalized(vectors)
        start = self.ntotal
        self.index.add(x)
        _, lists = self.index.quantizer.search(x, 1)
        self.lists = np.concatenate([self.lists, lists[:, 0].astype(np.int64)])
        return np.arange(start, self.ntotal, dtype=np.int64)

    # ---- search ----------------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @property
    def n_clusters(self) -> int:
        return int(self.index.nlist)

    @property
    def centroids(self) -> np.ndarray:
        if self._centroids is None:
            self._centroids = self.index.quantizer.reconstruct_n(0, self.n_clusters)
        return self._centroids

    def clamp_b(self, top_b: int | None = None) -> int:
        """B to use: the setting (or `top_b`), at least 1, at most the number of clusters (warned
        once per B)."""
        b = self.settings.top_b if top_b is None else top_b
        if b < 1:
            raise ValueError(f"B (top_b) must be ≥ 1, got {b}")
        if b > self.n_clusters:
            if b not in self._warned_b:
                warnings.warn(f"B={b} is larger than the {self.n_clusters} clusters of the index; using "
                              f"B={self.n_clusters} (every cluster: an exhaustive search)", ClusterIndexWarning,
                              stacklevel=3)
                self._warned_b.add(b)
            b = self.n_clusters
        return b

    def search(self, queries: np.ndarray, k: int, top_b: int | None = None) -> SearchResult:
        """Top-k docs of the whole index per query, visiting the B clusters whose centroids score
        highest."""
        q = _normalized(queries)
        self.index.nprobe = self.clamp_b(top_b)
        if k <= 0:
            return SearchResult(np.zeros((len(q), 0), np.float32), np.zeros((len(q), 0), np.int64))
        scores, rows = self.index.search(q, min(k, self.ntotal))
        return SearchResult(
            np.where(rows < 0, -np.inf, scores).astype(np.float32), rows.astype(np.int64)
        )

    def search_within(self, query: np.ndarray, rows: np.ndarray, k: int,
                      top_b: int | None = None, fill: FillRule | None = None) -> SearchResult:
        """Top-k of the given docs only (a mode's candidate docs): the candidates are grouped by
        cluster, each group's mean is its centroid, the B best groups are kept and their docs ranked
        by cosine to the query; ties go to the higher row (the more recent doc of a user). When the
        B groups hold fewer than k docs, `fill` (default: the setting) says whether to return fewer
        ("fewer", the seed's code) or to add the next groups by centroid score until k docs are in
        ("next_cluster"). One query; rows are a [1, k'] batch.

        This is the path ClusterRAG's retrieval takes (its candidates are some users' docs, not the
        corpus); the whole-corpus `search` (faiss IVF, nprobe = B) is what serves a query over every
        doc."""
        fill = self.settings.fill if fill is None else fill
        if fill not in ("fewer", "next_cluster"):
            raise ValueError(f"fill must be 'fewer' or 'next_cluster', got {fill!r}")
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        b = self.clamp_b(top_b)
        if k <= 0 or len(rows) == 0:
            return SearchResult(np.zeros((1, 0), np.float32), np.zeros((1, 0), np.int64))
        if rows[0] < 0 or rows[-1] >= self.ntotal:
            raise IndexError(
                f"rows outside the index of {self.ntotal} docs: {rows[rows >= self.ntotal][:5]}"
            )
        q = _normalized(query)[0]
        vecs = self.index.reconstruct_batch(rows)
        groups, inverse = np.unique(self.lists[rows], return_inverse=True)
        sums = np.zeros((len(groups), self.dim), np.float32)
        np.add.at(sums, inverse, vecs)
        centroid_scores = _normalized(sums) @ q
        ranked = np.argsort(-centroid_scores, kind="stable")
        n_groups = b
        if fill == "next_cluster":  # the fewest best groups that hold k docs, never fewer than B
            held = np.cumsum(np.bincount(inverse, minlength=len(groups))[ranked])
            n_groups = max(b, int(np.searchsorted(held, min(k, len(rows)))) + 1)
        keep = ranked[:n_groups]
        chosen = np.isin(inverse, keep)
        cand, scores = rows[chosen], vecs[chosen] @ q
        order = np.lexsort((-cand, -scores))[:k]
        return SearchResult(scores[order][None, :].astype(np.float32), cand[order][None, :])
