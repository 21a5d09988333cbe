"""How ClusterRAG's users become cohorts (seed 002): the settings a CohortModel is fitted with
(retrieval/cohorts.py), written once, every default the seed's unless its entry says otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CohortSettings"]

UserVectors = Literal["mean", "encoder"]
ClusterMethod = Literal["hdbscan", "kmeans"]
NoisePolicy = Literal["nearest", "own"]


@dataclass(frozen=True)
class CohortSettings:
    """How users become cohorts; every default is the seed's unless its entry says otherwise.

    Args:
        user_vectors: what is clustered: `mean` doc embeddings per user (Eq. 1) or `encoder`,
            CFRAG's trained user embeddings.
        method: `hdbscan` (the seed's choice) or `kmeans` (its ablation, "slightly weaker").
        min_cluster_size: HDBSCAN's smallest cluster (the seed's HDBSCAN(min_cluster_size=2)).
        min_samples: HDBSCAN's core-point neighbourhood; None = sklearn's default (=
            min_cluster_size).
        n_clusters: k-means only; None = ⌈√n⌉ (ours: the seed does not say).
        top_k_users: similar users taken from the cohort (the seed's §5: k = 1).
        noise: what HDBSCAN's noise users get: the `nearest` cohort (ours, see retrieval/cohorts.py)
            or none (`own`: user-only retrieval); the seed lumps noise into one cluster.
        fit_sample: cluster a random sample of this many users and assign the rest (for scale); None
            = all.
        kmeans_iter: k-means iterations.
        seed: seed of the sample and of k-means.
    """

    user_vectors: UserVectors = "mean"
    method: ClusterMethod = "hdbscan"
    min_cluster_size: int = 2
    min_samples: int | None = None
    n_clusters: int | None = None
    top_k_users: int = 1
    noise: NoisePolicy = "nearest"
    fit_sample: int | None = None
    kmeans_iter: int = 20
    seed: int = 0
