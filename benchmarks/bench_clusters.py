"""ClusterRAG at scale: user clustering time / memory / quality, and the cluster index vs flat search.

    python benchmarks/bench_clusters.py --quick          # 10k users only (minutes on 2 shared cores)
    python benchmarks/bench_clusters.py                  # 10k, 100k, 1M users
    python benchmarks/bench_clusters.py --user-encoder checkpoints/synthlamp-quick/user_encoder   # + contrastive

Part 1 clusters users three ways with the real `CohortModel`: full HDBSCAN (the seed), faiss k-means (K = ⌈√n⌉,
the CohortSettings default, and K = the number of true communities) and HDBSCAN on a sample followed by
nearest-centroid assignment (`fit_sample`). Each run happens in a child process with a wall-clock cap: past it
the child is killed and the table says "stopped: > cap"; a bigger n of a method that already stopped says "not
run" instead of hanging. Memory is the child's peak RSS growth during the fit (libraries imported before). Quality
against the generating communities (diagnostics): "ARI" of the clustering labels (noise users as singletons),
"ARI cohorts" of the cohorts users get after the noise policy (default: nearest cohort), and "nb p@1" = how often
a user's most similar cohort member (the seed's k = 1 neighbour, what retrieval uses) is in the same community.

Part 2 builds the `ClusterIndex` over docs and compares the top-B search with exact flat inner-product search over
the same docs: query time per query and recall@k of the exact top-k at B = 1, 2, 4 — over the real SynthLaMP
corpus (MiniLM vectors, its test questions as queries) and over synthetic docs at scale.

Part 3 is the cohort quality on the real SynthLaMP users themselves (MEAN of MiniLM doc vectors over each user's
pool, exactly as `persrag cluster` and the ClusterRAG strategy fit them; with `--user-encoder`, also CFRAG's
contrastive user table) for each clustering path.

User vectors at scale (`--vectors realistic`, default) are drawn as in benchmarks/bench_retrieval.py: one diagonal
Gaussian per latent community fitted to the MEAN-pooled MiniLM vectors of a real SynthLaMP (`--fit-users`, 384-d,
8 communities); 1M real users would mean embedding ~40M docs. `--vectors gaussian` is the earlier synthetic
64-d mixture (random unit centres, anisotropic noise; `--dim`, `--communities`, `--anisotropy`), which synthetic
docs at scale still use: a community, one of its `--topics` sub-centres, then noise. All vectors are
L2-normalised by the code under test, as in the framework.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
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


def neighbour_precision(model, truth: np.ndarray, users: int = 2_000, seed: int = 0) -> float:
    """Share of (up to `users` random) users whose most similar cohort member is in their community; users
    without a neighbour count as misses (they get user-only retrieval)."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(model), size=min(users, len(model)), replace=False)
    row_of = {u: i for i, u in enumerate(model.user_ids)} if len(model) <= 1_000_000 else None
    hits = 0
    for r in rows:
        nb = model.neighbours(model.user_ids[r], 1)
        hits += bool(nb) and truth[row_of[nb[0].user_id]] == truth[r]
    return hits / len(rows)


def settings_for(method: str, n: int, sample: int, k_true: int):
    from persrag_lightning.retrieval.cohort_settings import CohortSettings

    return {"hdbscan": CohortSettings(),
            "kmeans": CohortSettings(method="kmeans"),
            "kmeans-k": CohortSettings(method="kmeans", n_clusters=k_true),
            "hdbscan-sample": CohortSettings(fit_sample=sample_size(n, sample))}[method]


def method_label(method: str, n: int, sample: int, k_true: int) -> str:
    return {"hdbscan": "hdbscan (full)", "kmeans": f"k-means K = ⌈√n⌉ = {int(np.ceil(np.sqrt(n))):,}",
            "kmeans-k": f"k-means K = {k_true} (true)",
            "hdbscan-sample": f"hdbscan on {sample_size(n, sample):,} + assign"}[method]


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cluster_child(method: str, n: int, draw, k_true: int, sample: int, cap: float, out: mp.Queue) -> None:
    from persrag_lightning.retrieval.cohorts import CohortModel

    # the cap is CPU time, not wall time: on a shared machine a wall-clock cap measures the other jobs too. It covers
    # drawing the vectors and the fit; the diagnostics after the fit get DIAGNOSTICS_CPU_S more (the 2,000-user
    # neighbour check ranks whole cohorts: 125k-500k members per query with 8 or 2 cohorts over 1M users)
    limit = int(_cpu_seconds() + cap) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + DIAGNOSTICS_CPU_S))  # SIGXCPU past the soft limit
    x, truth = draw(n)
    ids = [str(i) for i in range(n)]
    settings = settings_for(method, n, sample, k_true)
    import faiss  # noqa: F401  (imported before the baseline: library code is not the method's memory)
    import sklearn.cluster  # noqa: F401

    base = _rss_mib()
    t0, c0 = time.perf_counter(), _cpu_seconds()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = CohortModel(settings).fit(ids, x)
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    peak = _rss_mib() - base
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))  # the fit is done: the diagnostics' own budget
    out.put((seconds, cpu, peak, model.n_cohorts, model.noise_count / n, model.adjusted_rand(truth.tolist()),
             model.adjusted_rand(truth.tolist(), after_policy=True), neighbour_precision(model, truth)))


METHODS = ("hdbscan", "kmeans", "kmeans-k", "hdbscan-sample")
DIAGNOSTICS_CPU_S = 900  # CPU seconds for the diagnostics of one clustering run, on top of its cap


def run_clustering(sizes: list[int], draw, k_true: int, what: str, cap: float, sample: int,
                   wall_cap: float, hdbscan_cap: float) -> None:
    print(f"\n## User clustering ({what}; cap {cap:.0f} CPU s per run, {hdbscan_cap:.0f} for full HDBSCAN, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})\n")
    print(f"| {'users':>9} | {'method':<30} | {'CPU s':>8} | {'wall s':>8} | {'+RSS MiB':>8} | {'cohorts':>7} | "
          f"{'noise':>6} | {'ARI':>5} | {'ARI cohorts':>11} | {'nb p@1':>6} |")
    print(f"|{'-' * 11}|{'-' * 32}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 8}|{'-' * 7}|{'-' * 13}|"
          f"{'-' * 8}|")
    stopped: set[str] = set()
    ctx = mp.get_context("fork")
    for n in sizes:
        for method in METHODS:
            label = method_label(method, n, sample, k_true)
            if method in stopped:
                print(f"| {n:>9,} | {label:<30} | {'not run: a smaller n stopped at the cap':<69} |")
                continue
            q: mp.Queue = ctx.Queue()
            run_cap = min(cap, hdbscan_cap) if method == "hdbscan" else cap
            p = ctx.Process(target=_cluster_child, args=(method, n, draw, k_true, sample, run_cap, q))
            p.start()
            p.join(wall_cap)  # a last resort: the CPU-time limit stops the child first on an idle machine
            if p.is_alive():
                p.kill()
                p.join()
                stopped.add(method)
                print(f"| {n:>9,} | {label:<30} | {f'stopped: > {wall_cap:.0f} wall s':<69} |")
                continue
            if q.empty():
                stopped.add(method)
                print(f"| {n:>9,} | {label:<30} | {f'stopped: > {run_cap:.0f} CPU s or failed (exit code {p.exitcode})':<69} |")
                continue
            seconds, cpu, peak, k, noise, ari, ari_cohorts, p1 = q.get()
            if cpu > run_cap:
                stopped.add(method)
            print(f"| {n:>9,} | {label:<30} | {cpu:>8.1f} | {seconds:>8.1f} | {peak:>8.0f} | {k:>7} | {noise:>6.1%} | "
                  f"{ari:>5.3f} | {ari_cohorts:>11.3f} | {p1:>6.3f} |", flush=True)


def run_index(x: np.ndarray, queries: np.ndarray, k: int, what: str) -> None:
    """Cluster index (default K, B = 1, 2, 4) vs exact flat inner product over the same docs, one query at a
    time as a server sees them; recall@k of the exact top-k."""
    import faiss

    from persrag_lightning.retrieval.cluster_index import ClusterIndex, ClusterIndexSettings

    faiss.omp_set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    n_docs, dim = x.shape
    n_queries = len(queries)
    t0 = time.perf_counter()
    index = ClusterIndex.build(x, ClusterIndexSettings())
    build = time.perf_counter() - t0
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    qn = np.ascontiguousarray(queries / np.linalg.norm(queries, axis=1, keepdims=True), dtype=np.float32)
    flat = faiss.IndexFlatIP(dim)
    flat.add(np.ascontiguousarray(xn, dtype=np.float32))

    def timed(fn) -> tuple[float, np.ndarray]:
        """Best of 3 passes (the machine is shared), one query at a time as a server sees them."""
        best = np.inf
        for _ in range(3):
            t = time.perf_counter()
            rows = np.vstack([fn(qn[i:i + 1]) for i in range(n_queries)])
            best = min(best, time.perf_counter() - t)
        return best / n_queries * 1e3, rows

    flat_ms, truth = timed(lambda q: flat.search(q, k)[1])
    print(f"\n## Cluster index vs flat search ({what}: {n_docs:,} docs, dim {dim}, K = {index.n_clusters} "
          f"clusters (built in {build:.1f} s), {n_queries} single queries, recall@{k} of the exact top-{k})\n")
    print(f"| {'search':<16} | {'ms / query':>10} | {f'recall@{k}':>9} | {'speed-up':>8} |")
    print(f"|{'-' * 18}|{'-' * 12}|{'-' * 11}|{'-' * 10}|")
    print(f"| {'flat (exact)':<16} | {flat_ms:>10.3f} | {1.0:>9.3f} | {1.0:>7.1f}x |")
    for b in (1, 2, 4):
        ms, rows = timed(lambda q, b=b: index.search(q, k, top_b=b).rows)
        recall = np.mean([len(set(r) & set(t)) / k for r, t in zip(rows, truth)])
        print(f"| {f'cluster, B = {b}':<16} | {ms:>10.3f} | {recall:>9.3f} | {flat_ms / ms:>7.1f}x |", flush=True)


def real_synthlamp(users: int, cache_dir: str, encoder: str):
    """The real SynthLaMP as the framework reads it: store, MiniLM doc vectors (shared cache), MEAN user vectors
    over each user's pool (ClusterRAG.fit_cohorts / `persrag cluster`), the communities, test-question vectors."""
    from persrag_lightning.data.source import LampSource
    from persrag_lightning.data.synth import SynthConfig, load_communities
    from persrag_lightning.retrieval.base import DocStore
    from persrag_lightning.retrieval.clusterrag import CorpusEmbedder
    from persrag_lightning.retrieval.user_clustering import mean_user_vectors

    source = LampSource("LaMP-2", None, SynthConfig(num_users=users), cache_dir)
    source.prepare()
    store = DocStore(source.load())
    embedder = CorpusEmbedder(encoder, cache_dir)
    docs = embedder.doc_vectors(store)
    ids, means, _ = mean_user_vectors(docs, {u: store.rows(u) for u in store.corpus.user_ids})
    communities = load_communities(source.data_dir)
    tests = [e.query for e in store.dataset.examples.get("test", [])]
    return store, docs, ids, means, communities, embedder.query_vectors(tests)


def run_real_cohorts(ids: list[str], vectors: np.ndarray, communities: dict[str, int], what: str, k_true: int,
                     sample_share: float) -> None:
    """Every clustering path on the real users (small: no child process, no cap)."""
    import warnings

    from persrag_lightning.retrieval.cohorts import CohortModel

    truth = np.array([communities[u] for u in ids])
    n = len(ids)
    for method in METHODS:
        settings = settings_for(method, n, 0, k_true)
        label = method_label(method, n, 0, k_true)
        if method == "hdbscan-sample":
            from dataclasses import replace

            settings = replace(settings, fit_sample=max(2, int(sample_share * n)))
            label = f"hdbscan on {settings.fit_sample} + assign"
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = CohortModel(settings).fit(ids, vectors)
        seconds = time.perf_counter() - t0
        print(f"| {what:<24} | {label:<30} | {seconds:>6.2f} | {model.n_cohorts:>7} | "
              f"{model.noise_count / n:>6.1%} | {model.adjusted_rand(truth.tolist()):>5.3f} | "
              f"{model.adjusted_rand(truth.tolist(), after_policy=True):>11.3f} | "
              f"{neighbour_precision(model, truth):>6.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k users (and 100k synthetic docs) only")
    ap.add_argument("--cap", type=float, default=300.0, help="CPU seconds per clustering run before it is stopped")
    ap.add_argument("--hdbscan-cap", type=float, default=120.0,
                    help="CPU seconds for full HDBSCAN (its O(n²) growth needs no more to show where it stops)")
    ap.add_argument("--wall-cap", type=float, default=3600.0, help="wall seconds per run (a last resort)")
    ap.add_argument("--sample", type=int, default=10_000,
                    help="most users HDBSCAN sees in the sample path (a tenth of them, at least 1,000)")
    ap.add_argument("--vectors", choices=["realistic", "gaussian"], default="realistic")
    ap.add_argument("--fit-users", type=int, default=300, help="real SynthLaMP users the realistic mixture fits")
    ap.add_argument("--cache-dir", default=".cache/persrag")
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--user-encoder", default=None, help="a stage-1 export: also cluster its contrastive users")
    ap.add_argument("--real-sample-share", type=float, default=0.5,
                    help="share of the real users HDBSCAN sees in the sample path of part 3")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--communities", type=int, default=100)
    ap.add_argument("--anisotropy", type=float, default=1.0)
    ap.add_argument("--docs-per-user", type=int, default=10)
    ap.add_argument("--max-docs", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--sizes", type=int, nargs="+", help="user counts to cluster (overrides --quick's and the default)")
    ap.add_argument("--skip-index", action="store_true")
    ap.add_argument("--skip-scale", action="store_true", help="only the real SynthLaMP parts (index and cohorts)")
    args = ap.parse_args()
    print(f"command: `python {' '.join(sys.argv)}`; load average at start {os.getloadavg()[0]:.1f} "
          "(other jobs share this machine: timings are noisy)")
    sizes = args.sizes or ([10_000] if args.quick else [10_000, 100_000, 1_000_000])
    mix = Mixture(args.dim, args.communities, anisotropy=args.anisotropy)
    real = None
    if args.vectors == "realistic" or not args.skip_index or args.skip_scale:
        real = real_synthlamp(args.fit_users, args.cache_dir, args.encoder)
    if not args.skip_scale:
        if args.vectors == "realistic":
            from bench_retrieval import UserMixture

            _, _, ids, means, communities, _ = real
            mixture = UserMixture(means, np.array([communities[u] for u in ids]))
            k_true = len(mixture.share)
            draw = lambda n: mixture.sample(n, seed=0)
            what = (f"realistic: per-community Gaussians fitted to {len(ids)} real SynthLaMP users' MEAN MiniLM "
                    f"vectors, d = {means.shape[1]}, {k_true} communities")
        else:
            k_true = mix.communities
            draw = lambda n: user_vectors(n, mix)
            what = f"synthetic Gaussian mixture, dim {mix.dim}, {mix.communities} communities"
        run_clustering(sizes, draw, k_true, what, args.cap, args.sample, args.wall_cap, args.hdbscan_cap)
    if real is not None:
        _, docs, ids, means, communities, queries = real
        print(f"\n## Cohorts of the real SynthLaMP users ({len(ids)} users, LaMP-2)\n")
        print(f"| {'user vectors':<24} | {'method':<30} | {'time s':>6} | {'cohorts':>7} | {'noise':>6} | "
              f"{'ARI':>5} | {'ARI cohorts':>11} | {'nb p@1':>6} |")
        print(f"|{'-' * 26}|{'-' * 32}|{'-' * 8}|{'-' * 9}|{'-' * 8}|{'-' * 7}|{'-' * 13}|{'-' * 8}|")
        k_true = len(set(communities.values()))
        run_real_cohorts(ids, means, communities, "MEAN (MiniLM)", k_true, args.real_sample_share)
        if args.user_encoder:
            from persrag_lightning.retrieval.clusterrag import encoder_user_vectors

            enc_ids, enc_vectors = encoder_user_vectors(args.user_encoder)
            run_real_cohorts(enc_ids, enc_vectors, communities, "contrastive (stage 1)", k_true,
                             args.real_sample_share)
        if not args.skip_index:
            run_index(np.asarray(docs, np.float32), np.asarray(queries, np.float32), 5,
                      "real SynthLaMP corpus, MiniLM, its test questions as queries")
    if not args.skip_index and not args.skip_scale:
        n_docs = min(sizes[-1] * args.docs_per_user, args.max_docs)
        x = doc_vectors(n_docs, mix)
        rng = np.random.default_rng(mix.seed + 2)
        queries = doc_vectors(args.queries, Mixture(**{**mix.__dict__, "seed": mix.seed})) \
            + 0.02 * rng.standard_normal((args.queries, mix.dim)).astype(np.float32)
        run_index(x, queries, args.k, f"synthetic docs, {mix.communities} communities × {mix.topics} topics")


if __name__ == "__main__":
    main()
