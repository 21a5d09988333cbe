"""ClusterRAG's user vectors and the clustering of them (seed 002, §4.1): Eq. 1's mean user
vectors, L2 normalisation, and the HDBSCAN or spherical k-means labels a CohortModel is fitted from
(retrieval/cohorts.py)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from persrag_lightning.retrieval.cohort_settings import CohortSettings

__all__ = ["dense_labels", "hdbscan_labels", "kmeans_fit", "mean_user_vectors", "normalize_rows"]

NOISE = -1  # HDBSCAN's label for users in no dense region


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    """L2-normalised float32 copy; a zero vector stays zero (it has no direction to compare)."""
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a [users, dim] matrix, got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def mean_user_vectors(doc_vectors: np.ndarray, rows: Mapping[str, np.ndarray]) -> tuple[list[str], np.ndarray,
                                                                                    list[str]]:
    """Eq. 1, z_u = mean of the user's doc embeddings over the given rows of each user (their
    collaborative pool, data/histories.py). Returns (ids with docs, their vectors, ids without
    docs): a user without docs has no mean."""
    kept = [u for u, r in rows.items() if len(r)]
    empty = [u for u, r in rows.items() if not len(r)]
    table = np.asarray(doc_vectors, dtype=np.float32)
    means = np.stack([table[rows[u]].mean(0) for u in kept]) if kept else np.zeros((0, table.shape[1]), np.float32)
    return kept, means.astype(np.float32), empty


def hdbscan_labels(x: np.ndarray, settings: CohortSettings) -> np.ndarray:
    """HDBSCAN's labels of the rows of `x` (euclidean, the seed's); fewer than two users are all
    noise."""
    from sklearn.cluster import HDBSCAN

    if len(x) < 2:
        return np.full(len(x), NOISE, dtype=np.int64)
    model = HDBSCAN(min_cluster_size=max(2, settings.min_cluster_size), min_samples=settings.min_samples,
                    metric="euclidean", copy=True)
    labels = model.fit_predict(x).astype(np.int64)
    return np.where(labels < 0, NOISE, labels)  # -2/-3 (infinite/missing values) are noise too


def kmeans_fit(x: np.ndarray, settings: CohortSettings) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means (faiss): (labels, unit centroids) with each label the centroid of highest
    cosine, which is the nearest unit centroid in euclidean distance, the rule `assign` applies to
    new users."""
    import faiss

    k = settings.n_clusters or int(np.ceil(np.sqrt(len(x))))
    k = max(1, min(k, len(x)))
    km = faiss.Kmeans(x.shape[1], k, niter=settings.kmeans_iter, seed=settings.seed, spherical=True,
                      verbose=False, min_points_per_centroid=1)
    km.train(x)
    centroids = normalize_rows(km.centroids)
    labels = np.asarray(x @ centroids.T).argmax(axis=1).astype(np.int64)
    used = np.unique(labels)  # an empty cluster leaves no centroid and no gap in the numbering
    return np.searchsorted(used, labels).astype(np.int64), centroids[used]


def dense_labels(labels: np.ndarray) -> np.ndarray:
    """Relabel clusters 0..K-1 (sorted), keeping -1: empty k-means clusters leave no gaps in the
    numbering."""
    out = np.full_like(labels, NOISE)
    clustered = labels >= 0
    _, inverse = np.unique(labels[clustered], return_inverse=True)
    out[clustered] = inverse
    return out
