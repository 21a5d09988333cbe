"""`CohortModel.neighbours` per query in one big cohort: gathering the members' vectors vs one product with the whole
user table, by the cohort's share of the users — the measurement behind `FULL_SCAN_SHARE` (retrieval/cohorts.py).

    python benchmarks/bench_cohort_neighbours.py                 # 1M users x 384, shares 5-75 %
    python benchmarks/bench_cohort_neighbours.py --users 100000

Users are random unit vectors (scores do not change the cost); the model is built directly (no clustering) with the
chosen cohort sizes (cohort 0 = the measured share, cohort 1 = the rest), so only `neighbours` is timed: the
whole call (scores, the k-best partition with ties, the (score, id) sort), median of `--queries` queries, each
path forced through `FULL_SCAN_SHARE`. "default" is the path the product takes for that share. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from persrag_lightning.retrieval import cohorts
from persrag_lightning.retrieval.cohort_settings import CohortSettings
from persrag_lightning.retrieval.cohorts import CohortModel


def model_with_cohort(vectors: np.ndarray, share: float) -> CohortModel:
    """A two-cohort k-means model over `vectors` whose cohort 0 holds `share` of the users (the first rows)."""
    n = len(vectors)
    ids = [f"u{i:07d}" for i in range(n)]
    labels = (np.arange(n) >= int(share * n)).astype(np.int64)
    centroids = np.stack([vectors[labels == c].mean(0) for c in (0, 1)]).astype(np.float32)
    return CohortModel(CohortSettings(method="kmeans", n_clusters=2), ids, vectors, labels, labels.copy(),
                       centroids, np.ones(2, np.float32))


def time_queries(model: CohortModel, users: list[str], k: int) -> float:
    model.neighbours(users[0], k)  # the members index is built once per model
    times = []
    for user in users:
        start = time.perf_counter()
        model.neighbours(user, k)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.05, 0.125, 0.25, 0.5, 0.75])
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--k", type=int, default=6)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((args.users, args.dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    print(f"{args.users:,} users x {args.dim}, top-{args.k}, median of {args.queries} queries; "
          f"FULL_SCAN_SHARE = {cohorts.FULL_SCAN_SHARE}")
    print("| cohort share | members | gather ms | whole-table product ms | default path |")
    print("|---:|---:|---:|---:|---|")
    default = cohorts.FULL_SCAN_SHARE
    try:
        for share in args.shares:
            model = model_with_cohort(vectors, share)
            members = int(share * args.users)
            users = [model.user_ids[i] for i in rng.choice(members, args.queries, replace=False)]
            cohorts.FULL_SCAN_SHARE = 1.0  # never scan: gather
            gather = time_queries(model, users, args.k)
            cohorts.FULL_SCAN_SHARE = 0.0  # always scan
            scan = time_queries(model, users, args.k)
            path = "whole-table product" if share > default else "gather"
            print(f"| {share:.3f} | {members:,} | {gather:.1f} | {scan:.1f} | {path} |", flush=True)
    finally:
        cohorts.FULL_SCAN_SHARE = default


if __name__ == "__main__":
    main()
