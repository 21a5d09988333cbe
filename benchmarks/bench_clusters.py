"""ClusterRAG at scale: user clustering time / memory / quality, and the cluster index vs flat search.

    python benchmarks/bench_clusters.py --quick          # 10k users only (minutes on 2 shared cores)
    python benchmarks/bench_clusters.py                  # 10k, 100k, 1M users

Part 1 clusters users three ways with the real `CohortModel`: full HDBSCAN (the seed), faiss k-means (K = ⌈√n⌉,
the CohortSettings default) and HDBSCAN on a sample followed by nearest-centroid assignment (`fit_sample`). Each
run happens in a child process with a wall-clock cap: past it the child is killed and the table says "stopped:
> cap"; a bigger n of a method that already stopped says "not run: > cap" instead of hanging. Memory is the child's
peak RSS growth during the fit (libraries imported before). ARI against the generating communities is a diagnostic:
"ARI" of the clustering labels (noise users as singletons), "ARI cohorts" of the cohorts users get after the noise
policy (default: nearest cohort).

Part 2 builds the `ClusterIndex` over docs and compares the top-B search with exact flat inner-product search over
the same docs: query time per query and recall@k of the exact top-k at B = 1, 2, 4.

Vectors (until the realistic generator of a later issue): per-community Gaussian mixtures. A community's centre is
a random unit vector; its members are centre + noise whose per-dimension std is base·10^u, u ~ U(-a/2, a/2)
drawn per community and dimension (`--anisotropy a`, default 1: stds differ by up to 10×). Users are one such
draw each; docs are draws from the user's community with a second, topic-level mixture (each community has
`--topics` sub-centres). All vectors are L2-normalised by the code under test, as in the framework.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np


@dataclass(frozen=True)
class Mixture:
    """The synthetic user/doc space (documented in the module docstring)."""

    dim: int = 64
    communities: int = 100
    base_std: float = 0.08
    anisotropy: float = 1.0
    topics: int = 4
    seed: int = 0


def user_vectors(n: int, mix: Mixture) -> tuple[np.ndarray, np.ndarray]:
    """n users drawn from the community mixture: (vectors [n, dim], true community [n])."""
    rng = np.random.default_rng(mix.seed)
    centres = rng.normal(size=(mix.communities, mix.dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    stds = (mix.base_std * 10 ** rng.uniform(-mix.anisotropy / 2, mix.anisotropy / 2,
                                             size=(mix.communities, mix.dim))).astype(np.float32)
    community = rng.integers(0, mix.communities, size=n)
    x = np.empty((n, mix.dim), np.float32)
    for start in range(0, n, 100_000):  # chunks: 1M × dim float64 temporaries would double the memory
        c = community[start:start + 100_000]
        x[start:start + len(c)] = centres[c] + rng.standard_normal((len(c), mix.dim), np.float32) * stds[c]
    return x, community


def doc_vectors(n_docs: int, mix: Mixture) -> np.ndarray:
    """Docs: a community, then one of its topics (a sub-centre), then anisotropic noise around it."""
    rng = np.random.default_rng(mix.seed + 1)
    centres = rng.normal(size=(mix.communities, mix.dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    topics = centres[:, None, :] + 0.5 * rng.normal(size=(mix.communities, mix.topics, mix.dim)).astype(
        np.float32) / np.sqrt(mix.dim)
    stds = (mix.base_std * 10 ** rng.uniform(-mix.anisotropy / 2, mix.anisotropy / 2,
                                             size=(mix.communities, mix.dim))).astype(np.float32)
    c = rng.integers(0, mix.communities, size=n_docs)
    t = rng.integers(0, mix.topics, size=n_docs)
    return (topics[c, t] + rng.standard_normal((n_docs, mix.dim), np.float32) * stds[c]).astype(np.float32)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def sample_size(n: int, cap: int) -> int:
    """Users HDBSCAN sees in the sample path: a tenth of them, at least 1,000, at most `cap`."""
    return min(n, max(1_000, min(cap, n // 10)))


def _cluster_child(method: str, n: int, mix: Mixture, sample: int, out: mp.Queue) -> None:
    from persrag_lightning.retrieval.cohorts import CohortModel, CohortSettings

    x, truth = user_vectors(n, mix)
    ids = [str(i) for i in range(n)]
    settings = {"hdbscan": CohortSettings(),
                "kmeans": CohortSettings(method="kmeans"),
                "hdbscan-sample": CohortSettings(fit_sample=sample_size(n, sample))}[method]
    import faiss  # noqa: F401  (imported before the baseline: library code is not the method's memory)
    import sklearn.cluster  # noqa: F401

    base = _rss_mib()
    t0 = time.perf_counter()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = CohortModel(settings).fit(ids, x)
    seconds = time.perf_counter() - t0
    peak = _rss_mib() - base
    out.put((seconds, peak, model.n_cohorts, model.noise_count / n, model.adjusted_rand(truth.tolist()),
             model.adjusted_rand(truth.tolist(), after_policy=True)))


def run_clustering(sizes: list[int], mix: Mixture, cap: float, sample: int) -> None:
    print(f"\n## User clustering (dim {mix.dim}, {mix.communities} communities, anisotropy {mix.anisotropy}, "
          f"cap {cap:.0f} s per run, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})\n")
    print(f"| {'users':>9} | {'method':<26} | {'time s':>8} | {'+RSS MiB':>8} | {'cohorts':>7} | {'noise':>6} | "
          f"{'ARI':>5} | {'ARI cohorts':>11} |")
    print(f"|{'-' * 11}|{'-' * 28}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 8}|{'-' * 7}|{'-' * 13}|")
    stopped: set[str] = set()
    ctx = mp.get_context("fork")
    for n in sizes:
        for method in ("hdbscan", "kmeans", "hdbscan-sample"):
            label = method if method != "hdbscan-sample" else f"hdbscan on {sample_size(n, sample):,} + assign"
            if method in stopped:
                print(f"| {n:>9,} | {label:<26} | {'not run: > cap (smaller n stopped)':<58} |")
                continue
            q: mp.Queue = ctx.Queue()
            p = ctx.Process(target=_cluster_child, args=(method, n, mix, sample, q))
            p.start()
            p.join(cap + 30)  # the child also generates the data: allow for it beyond the fit's cap
            if p.is_alive():
                p.kill()
                p.join()
                stopped.add(method)
                print(f"| {n:>9,} | {label:<26} | {'stopped: > cap':<58} |")
                continue
            if q.empty():
                stopped.add(method)
                print(f"| {n:>9,} | {label:<26} | {f'failed (exit code {p.exitcode}, e.g. out of memory)':<58} |")
                continue
            seconds, peak, k, noise, ari, ari_cohorts = q.get()
            if seconds > cap:
                stopped.add(method)
            print(f"| {n:>9,} | {label:<26} | {seconds:>8.2f} | {peak:>8.0f} | {k:>7} | {noise:>6.1%} | "
                  f"{ari:>5.3f} | {ari_cohorts:>11.3f} |", flush=True)


def run_index(n_docs: int, mix: Mixture, n_queries: int, k: int) -> None:
    import faiss

    from persrag_lightning.retrieval.cluster_index import ClusterIndex, ClusterIndexSettings

    faiss.omp_set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    x = doc_vectors(n_docs, mix)
    rng = np.random.default_rng(mix.seed + 2)
    queries = doc_vectors(n_queries, Mixture(**{**mix.__dict__, "seed": mix.seed})) \
        + 0.02 * rng.standard_normal((n_queries, mix.dim)).astype(np.float32)
    t0 = time.perf_counter()
    index = ClusterIndex.build(x, ClusterIndexSettings())
    build = time.perf_counter() - t0
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    qn = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(mix.dim)
    flat.add(xn)

    def timed(fn) -> tuple[float, np.ndarray]:
        """Best of 3 passes (the machine is shared), one query at a time as a server sees them."""
        best = np.inf
        for _ in range(3):
            t = time.perf_counter()
            rows = np.vstack([fn(qn[i:i + 1]) for i in range(n_queries)])
            best = min(best, time.perf_counter() - t)
        return best / n_queries * 1e3, rows

    flat_ms, truth = timed(lambda q: flat.search(q, k)[1])
    print(f"\n## Cluster index vs flat search ({n_docs:,} docs, dim {mix.dim}, K = {index.n_clusters} clusters "
          f"(built in {build:.1f} s), {n_queries} single queries, recall@{k} of the exact top-{k})\n")
    print(f"| {'search':<16} | {'ms / query':>10} | {f'recall@{k}':>9} | {'speed-up':>8} |")
    print(f"|{'-' * 18}|{'-' * 12}|{'-' * 11}|{'-' * 10}|")
    print(f"| {'flat (exact)':<16} | {flat_ms:>10.3f} | {1.0:>9.3f} | {1.0:>7.1f}x |")
    for b in (1, 2, 4):
        ms, rows = timed(lambda q, b=b: index.search(q, k, top_b=b).rows)
        recall = np.mean([len(set(r) & set(t)) / k for r, t in zip(rows, truth)])
        print(f"| {f'cluster, B = {b}':<16} | {ms:>10.3f} | {recall:>9.3f} | {flat_ms / ms:>7.1f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k users (and 100k docs) only")
    ap.add_argument("--cap", type=float, default=300.0, help="seconds per clustering run before it is stopped")
    ap.add_argument("--sample", type=int, default=10_000,
                    help="most users HDBSCAN sees in the sample path (a tenth of them, at least 1,000)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--communities", type=int, default=100)
    ap.add_argument("--anisotropy", type=float, default=1.0)
    ap.add_argument("--docs-per-user", type=int, default=10)
    ap.add_argument("--max-docs", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--sizes", type=int, nargs="+", help="user counts to cluster (overrides --quick's and the default)")
    ap.add_argument("--skip-index", action="store_true")
    args = ap.parse_args()
    sizes = args.sizes or ([10_000] if args.quick else [10_000, 100_000, 1_000_000])
    mix = Mixture(args.dim, args.communities, anisotropy=args.anisotropy)
    run_clustering(sizes, mix, args.cap, args.sample)
    if not args.skip_index:
        run_index(min(sizes[-1] * args.docs_per_user, args.max_docs), mix, args.queries, args.k)


if __name__ == "__main__":
    main()
