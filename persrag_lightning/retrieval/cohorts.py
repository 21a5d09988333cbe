"""User cohorts of ClusterRAG (seed 002, §4.1): user vectors clustered by HDBSCAN (or k-means),
neighbours ranked by cosine inside the cohort, new users assigned to the nearest centroid without
re-clustering everyone.

What the seed does, and where we differ on purpose:
- user vector z_u = mean of the user's doc embeddings (Eq. 1); CFRAG's trained user embeddings may
  replace it (`user_vectors="encoder"`; the caller passes ids + vectors either way);
- HDBSCAN(min_cluster_size=2, metric="euclidean") on the vectors; we L2-normalise them first, so
  euclidean distance is a monotone function of cosine (|a-b|² = 2 - 2·cos) and long histories do not
  dominate;
- members are ranked by similarity to the query user inside the cluster (Eq. 2, ColBERTv2 there;
  cosine of the user vectors here), top k = 1 similar users (§5);
- their code keeps HDBSCAN's noise label -1 as if it were one more cluster, so unrelated "noise"
  users become each other's neighbours; here a noise user gets the nearest cohort
  (`noise="nearest"`, the default: the seed's collaborative and hybrid modes assume every user has
  neighbours) or none (`noise="own"`: user-only retrieval).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from persrag_lightning.retrieval.cohort_export import FORMAT, array_digest, read_cohorts, write_cohorts
from persrag_lightning.retrieval.cohort_settings import CohortSettings
from persrag_lightning.retrieval.user_clustering import (
    NOISE,
    dense_labels,
    hdbscan_labels,
    kmeans_fit,
    normalize_rows,
)
from persrag_lightning.utils import fingerprint

__all__ = ["Assignment", "CohortModel", "CohortWarning", "Neighbour"]

log = logging.getLogger(__name__)

ASSIGN_CHUNK = 2 ** 24  # users × centroids distances computed at a time (~64 MiB): 1M users never need 4+ GiB
# A cohort holding more than this share of all users is scored by one product with the whole
# (contiguous) table instead of gathering its members' vectors first: the gather grows with the
# cohort, the whole product does not, and they cross near an eighth of the users
# (benchmarks/bench_cohort_neighbours.py, docs/methods/clusterrag.md).
FULL_SCAN_SHARE = 0.125


class CohortWarning(UserWarning):
    """Degenerate clustering (all users noise, a cohort of one, ...): the run goes on, the user is
    told why."""


@dataclass(frozen=True)
class Neighbour:
    """A cohort member similar to the query user, with its cosine similarity."""

    user_id: str
    similarity: float


@dataclass(frozen=True)
class Assignment:
    """Where a (new) user lands: `label` is the clustering's own label (-1 = noise); `cohort` is the
    cohort used for neighbours after the noise policy (-1 = none, user-only retrieval)."""

    label: int
    cohort: int
    distance: float



@dataclass
class CohortModel:
    """Users' cohorts, centroids and normalised vectors: everything `neighbours` and `assign` need,
    and what the export under `clusters/` holds."""

    settings: CohortSettings = field(default_factory=CohortSettings)
    user_ids: list[str] = field(default_factory=list)
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # L2-normalised
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # clustering labels, -1 = noise
    cohorts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # after the noise policy
    centroids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    radii: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # farthest clustered member;
    # -1 marks a cohort whose clustered members were all removed (deleted users): nobody is assigned
    # to it
    data_fingerprint: str = ""
    encoder: str = ""  # the text encoder of MEAN user vectors ("" when unknown or user_vectors="encoder")

    def __post_init__(self) -> None:
        self._row: dict[str, int] = {u: i for i, u in enumerate(self.user_ids)}
        self._members: list[np.ndarray] | None = None

    # ---- fitting ---------------------------------------------------------------------------------
    def fit(self, user_ids: Sequence[str], vectors: np.ndarray) -> CohortModel:
        """Cluster the users (row i of `vectors` = user_ids[i]); with `fit_sample`, HDBSCAN/k-means
        sees only a seeded random sample and every other user goes to its nearest centroid, as
        `assign` does."""
        user_ids = list(user_ids)
        x = normalize_rows(vectors)
        if len(user_ids) != len(x):
            raise ValueError(f"{len(user_ids)} user ids for {len(x)} vectors")
        if len(set(user_ids)) != len(user_ids):
            raise ValueError("user ids must be unique")
        s = self.settings
        if s.min_cluster_size < 2:
            raise ValueError(f"min_cluster_size must be ≥ 2 (got {s.min_cluster_size}): a cluster of one user "
                             "has no neighbours")
        self.user_ids, self.vectors = user_ids, x
        self._row = {u: i for i, u in enumerate(user_ids)}
        self._members = None
        self.data_fingerprint = fingerprint(FORMAT, asdict(s), user_ids, array_digest(x))
        n = len(x)
        sample = np.arange(n)
        if s.fit_sample is not None and s.fit_sample < n:
            sample = np.sort(np.random.default_rng(s.seed).choice(n, s.fit_sample, replace=False))
        if s.method == "kmeans":  # the spherical centroids the clustering used, so `assign` agrees with the fit
            fit_labels, centroids = kmeans_fit(x[sample], s)
            self._set_centroids(x[sample], fit_labels, centroids)
        else:
            fit_labels = dense_labels(hdbscan_labels(x[sample], s))
            self._set_centroids(x[sample], fit_labels)
        if len(sample) == n:
            labels = fit_labels
        else:  # the users outside the sample: nearest centroid, noise beyond the cohort's radius
            labels = np.full(n, NOISE, dtype=np.int64)
            labels[sample] = fit_labels
            rest = np.setdiff1d(np.arange(n), sample)
            labels[rest] = self._nearest(x[rest])[0]
        self.labels = labels
        self.cohorts = self._apply_noise_policy(labels, x)
        self._warn_degenerate()
        return self

    def _centroid(self, members: np.ndarray) -> np.ndarray:
        """A cohort's centroid: the mean of its members (HDBSCAN, euclidean), L2-normalised under
        spherical k-means, whose clustering compares users to unit centroids."""
        mean = members.mean(axis=0)
        return normalize_rows(mean[None, :])[0] if self.settings.method == "kmeans" else mean

    def _set_centroids(self, x: np.ndarray, labels: np.ndarray, centroids: np.ndarray | None = None) -> None:
        k = int(labels.max()) + 1 if len(labels) and labels.max() >= 0 else 0
        dim = x.shape[1] if x.ndim == 2 else 0
        self.centroids = np.zeros((k, dim), np.float32)
        self.radii = np.zeros(k, np.float32)
        for c in range(k):
            members = x[labels == c]
            self.centroids[c] = centroids[c] if centroids is not None else self._centroid(members)
            self.radii[c] = float(np.linalg.norm(members - self.centroids[c], axis=1).max())

    def _nearest(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(label, nearest cohort, distance) per row: label is -1 beyond the nearest cohort's radius
        (HDBSCAN; k-means has no noise). Euclidean on normalised vectors, the metric the clustering
        used (to unit centroids under k-means: the highest cosine, as the fit labelled its
        users)."""
        if len(self.centroids) == 0 or (self.radii < 0).all():
            none = np.full(len(x), NOISE, dtype=np.int64)
            return none, none, np.full(len(x), np.inf, np.float32)
        nearest = np.empty(len(x), np.int64)
        dist = np.empty(len(x), np.float32)
        c2 = (self.centroids ** 2).sum(1)[None, :]
        c2 = np.where(self.radii[None, :] < 0, np.inf, c2)  # emptied cohorts are never the nearest
        step = max(1, ASSIGN_CHUNK // max(1, len(self.centroids)))
        for start in range(0, len(x), step):
            xs = x[start:start + step]
            d2 = (xs * xs).sum(1)[:, None] - 2 * xs @ self.centroids.T + c2
            best = d2.argmin(axis=1)
            nearest[start:start + len(xs)] = best
            # the distance to the chosen centroid from the difference, not the expansion above: |x|²
            # − 2⟨x, c⟩ + |c|² loses ~√eps in float32, enough to move a cohort's farthest member
            # across its radius
            dist[start:start + len(xs)] = np.linalg.norm(xs - self.centroids[best], axis=1)
        if self.settings.method == "kmeans":
            return nearest.astype(np.int64), nearest.astype(np.int64), dist
        inside = dist <= self.radii[nearest] + 1e-6
        return np.where(inside, nearest, NOISE).astype(np.int64), nearest.astype(np.int64), dist

    def _apply_noise_policy(self, labels: np.ndarray, x: np.ndarray) -> np.ndarray:
        cohorts = labels.copy()
        noise = labels == NOISE
        if noise.any() and self.settings.noise == "nearest" and len(self.centroids):
            cohorts[noise] = self._nearest(x[noise])[1]
        return cohorts

    def _warn_degenerate(self) -> None:
        n, k, noise = len(self.user_ids), len(self.centroids), self.noise_count
        if n and k == 0:
            warnings.warn(f"all {n} users are noise (no cohort found with min_cluster_size="
                          f"{self.settings.min_cluster_size}); every user gets user-only retrieval",
                          CohortWarning, stacklevel=3)
        elif noise:
            log.info("%d of %d users are HDBSCAN noise; policy %r", noise, n, self.settings.noise)
        ones = int((self.sizes == 1).sum())
        if ones:
            warnings.warn(f"{ones} cohort(s) of one user: those users have no neighbours (user-only retrieval)",
                          CohortWarning, stacklevel=3)

    # ---- queries ---------------------------------------------------------------------------------
    def __contains__(self, user_id: str) -> bool:
        return user_id in self._row

    def __len__(self) -> int:
        return len(self.user_ids)

    @property
    def n_cohorts(self) -> int:
        return len(self.centroids)

    @property
    def sizes(self) -> np.ndarray:
        """Users per cohort after the noise policy (noise users placed by `nearest` count in their
        cohort)."""
        return np.bincount(self.cohorts[self.cohorts >= 0], minlength=self.n_cohorts)

    @property
    def noise_count(self) -> int:
        return int((self.labels == NOISE).sum())

    def cohort_of(self, user_id: str) -> int:
        """The user's cohort (-1: none, user-only retrieval); an unknown user is a KeyError naming
        it."""
        if user_id not in self._row:
            raise KeyError(f"user {user_id!r} is not in the cohort model ({len(self)} users); "
                           "add it with `add(user_id, vector)`")
        return int(self.cohorts[self._row[user_id]])

    def is_noise(self, user_id: str) -> bool:
        self.cohort_of(user_id)
        return bool(self.labels[self._row[user_id]] == NOISE)

    def members(self, cohort: int) -> np.ndarray:
        """Rows of the cohort's users (built once for all cohorts: O(n), not O(n) per query)."""
        if self._members is None:
            order = np.argsort(self.cohorts, kind="stable")
            bounds = np.searchsorted(self.cohorts[order], np.arange(self.n_cohorts + 1))
            self._members = [order[bounds[c]:bounds[c + 1]] for c in range(self.n_cohorts)]
        return self._members[cohort] if 0 <= cohort < self.n_cohorts else np.zeros(0, np.int64)

    def neighbours(self, user_id: str, k: int | None = None) -> list[Neighbour]:
        """The k most similar other members of the user's cohort by cosine (Eq. 2 with cosine), best
        first; ties by user id. Empty for a user without a cohort (noise under `noise="own"`) or
        alone in it."""
        k = self.settings.top_k_users if k is None else k
        cohort = self.cohort_of(user_id)
        row = self._row[user_id]
        rows = self.members(cohort)
        rows = rows[rows != row]
        if k <= 0 or len(rows) == 0:
            return []
        if len(rows) > FULL_SCAN_SHARE * len(self.vectors):  # one pass over the contiguous table, then pick
            sims = (self.vectors @ self.vectors[row])[rows]
        else:  # gather the members' vectors
            sims = self.vectors[rows] @ self.vectors[row]
        if len(rows) > k:  # a big cohort (k-means with few clusters over 1M users: 125k+ members): keep the k best
            # and everything tied with the k-th before sorting by (score, id), so the result is the
            # full sort's
            keep = np.flatnonzero(sims >= np.partition(sims, len(sims) - k)[len(sims) - k])
            rows, sims = rows[keep], sims[keep]
        ids = np.array([self.user_ids[r] for r in rows])
        order = np.lexsort((ids, -sims))[:k]
        return [Neighbour(str(ids[i]), float(sims[i])) for i in order]

    def assign(self, vector: np.ndarray) -> Assignment:
        """Cohort of a new user from its vector: nearest centroid, noise beyond that cohort's
        farthest clustered member (HDBSCAN), then the noise policy. Nothing is re-clustered; the
        model is not changed."""
        x = normalize_rows(np.atleast_2d(vector))
        if x.shape[1] != self.dim:
            raise ValueError(f"user vector has dim {x.shape[1]}, the cohort model {self.dim}")
        label, nearest, dist = (a[0] for a in self._nearest(x))
        cohort = nearest if label == NOISE and self.settings.noise == "nearest" else label
        return Assignment(int(label), int(cohort), float(dist))

    def add(self, user_id: str, vector: np.ndarray, assignment: Assignment | None = None) -> Assignment:
        """Assign a new user and keep it, so it has neighbours and is a neighbour from now on;
        `assignment` is one computed (and persisted) earlier by `assign` on the same model, reused
        as is."""
        if user_id in self._row:
            raise ValueError(f"user {user_id!r} is already in the cohort model")
        a = assignment if assignment is not None else self.assign(vector)
        if not -1 <= a.cohort < self.n_cohorts or not -1 <= a.label < self.n_cohorts:
            raise ValueError(f"user {user_id!r}: assignment {a} names a cohort this model does not have "
                             f"({self.n_cohorts} cohorts)")
        self._row[user_id] = len(self.user_ids)
        self.user_ids.append(user_id)
        self.vectors = np.vstack([self.vectors, normalize_rows(np.atleast_2d(vector))])
        self.labels = np.append(self.labels, a.label)
        self.cohorts = np.append(self.cohorts, a.cohort)
        self._members = None
        return a

    def remove(self, user_ids: Sequence[str]) -> list[str]:
        """Forget users (a deletion): their rows go, and the centroid and radius of each cohort they
        were clustered in are recomputed over its remaining clustered members, so no aggregate keeps
        their vector; a cohort left without clustered members is marked empty (radius -1: nobody is
        assigned to it again, the noise users placed in it stay each other's neighbours). Cohort
        numbers do not change. Returns the ids that were present."""
        gone = [u for u in dict.fromkeys(user_ids) if u in self._row]
        if not gone:
            return []
        drop = np.array([self._row[u] for u in gone], np.int64)
        touched = sorted({int(c) for c in self.labels[drop] if c >= 0})
        keep = np.setdiff1d(np.arange(len(self.user_ids)), drop)
        self.user_ids = [self.user_ids[i] for i in keep]
        self.vectors, self.labels, self.cohorts = self.vectors[keep], self.labels[keep], self.cohorts[keep]
        self.centroids, self.radii = self.centroids.copy(), self.radii.copy()
        for c in touched:
            members = self.vectors[self.labels == c]
            if len(members):
                self.centroids[c] = self._centroid(members)
                self.radii[c] = float(np.linalg.norm(members - self.centroids[c], axis=1).max())
            else:
                self.centroids[c] = 0.0
                self.radii[c] = -1.0
        self._row = {u: i for i, u in enumerate(self.user_ids)}
        self._members = None
        return gone

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1]) if self.vectors.ndim == 2 else 0

    # ---- diagnostics -----------------------------------------------------------------------------
    def adjusted_rand(self, true_communities: Sequence[str] | Sequence[int], after_policy: bool = False) -> float:
        """ARI (sklearn) against true communities (aligned with `user_ids`). By default of the clustering labels,
        each noise user its own singleton (not one big "noise" cluster); `after_policy=True` scores the cohorts
        users actually get (noise placed by `noise="nearest"`). Diagnostics only."""
        from sklearn.metrics import adjusted_rand_score

        if len(true_communities) != len(self):
            raise ValueError(f"{len(true_communities)} communities for {len(self)} users")
        pred = (self.cohorts if after_policy else self.labels).copy()
        noise = pred == NOISE
        pred[noise] = self.n_cohorts + np.arange(int(noise.sum()))
        return float(adjusted_rand_score(list(true_communities), pred))

    def summary(self) -> str:
        """A few lines for the CLI: how many cohorts, how big, how much noise and what happened to it."""
        s = self.settings
        sizes = self.sizes
        lines = [f"{len(self)} users, {self.n_cohorts} cohorts ({s.method}"
                 + (f", min_cluster_size={s.min_cluster_size}" if s.method == "hdbscan" else "")
                 + (f", fitted on a sample of {s.fit_sample}" if s.fit_sample and s.fit_sample < len(self) else "")
                 + f", user vectors: {s.user_vectors})"]
        if len(sizes):
            lines.append(f"cohort size: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()}; "
                         f"cohorts of one: {int((sizes == 1).sum())}")
        noise_fate = "nearest cohort" if s.noise == "nearest" else "user-only retrieval"
        lines.append(f"noise users: {self.noise_count} ({self.noise_count / max(1, len(self)):.1%}) -> {noise_fate}")
        return "\n".join(lines)

    # ---- persistence -----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Export to `directory` (retrieval/cohort_export.py: cohorts.json written last, so a folder
        with it is complete)."""
        return write_cohorts(self, directory)

    @classmethod
    def load(cls, directory: str | Path) -> CohortModel:
        """Read an export of `save`; a missing or foreign folder is an error naming the file."""
        return cls(**read_cohorts(directory))
