"""Retrieval benchmark: top-m user retrieval (faiss flat / IVF / HNSW vs a brute-force torch scan) at
1k-1M users, and end-to-end queries/s of the non-collaborative baselines (no LLM).

    python benchmarks/bench_retrieval.py                      # 1k, 100k and 1M users, d = 384, m = 6
    python benchmarks/bench_retrieval.py --quick              # 1k and 100k only

User embeddings at scale are SAMPLED, not real: SynthLaMP with 1M users would mean embedding ~40M docs, which
this machine cannot do. Instead a small real SynthLaMP (--fit-users, default 300) is embedded with MiniLM
through the shared corpus-embedding cache, each user is the MEAN of their (up to 100 most recent) doc vectors,
and a Gaussian mixture with one component per latent community (communities.json) is fitted: per-community
mean and a DIAGONAL std. N users are drawn from it (community by its real share). A diagonal Gaussian has no
low-rank structure within a community, so neighbours are more uniformly far than real users' are: ANN recall
here is likely pessimistic (the table "real vs sampled" shows how the two differ). Queries are fresh users
drawn from the same mixture. Prints Markdown tables; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

import faiss
import numpy as np
import psutil
import torch
import torch.nn.functional as F

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.embeddings import build_corpus_embeddings, load_corpus_embeddings
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig, load_communities
from persrag_lightning.metrics import community_precision_at_m
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.baselines import BM25, Dense, RandomDocs, Recency, ZeroShot
from persrag_lightning.retrieval.index import FAISS_DEFAULT_BLAS_THRESHOLD
from persrag_lightning.retrieval.user_index import UserIndex, torch_topk_users

PROCESS = psutil.Process(os.getpid())
SEARCH_THREADS = 1  # threads of every search timing (--search-threads); builds use all (--threads)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def rss() -> int:
    gc.collect()
    return PROCESS.memory_info().rss


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def serialized_bytes(index: faiss.Index) -> int:
    """Size faiss.write_index would write, counted through a callback so 1M vectors are never copied."""
    if hasattr(faiss, "GpuIndex") and isinstance(index, faiss.GpuIndex):
        index = faiss.index_gpu_to_cpu(index)
    total = [0]

    def count(chunk: bytes) -> int:
        total[0] += len(chunk)
        return len(chunk)

    faiss.write_index(index, faiss.PyCallbackIOWriter(count))
    return total[0]


# ------------------------------------------------------------------------------------------- user mixture

def real_users(fit_users: int, cache_dir: str,
               encoder: str) -> tuple[DocStore, torch.Tensor, np.ndarray, str]:
    """A real SynthLaMP: its DocStore, MEAN-pooled MiniLM user vectors [U, d] and latent communities [U]."""
    source = LampSource("LaMP-2", None, SynthConfig(num_users=fit_users), cache_dir)
    data_dir = source.prepare()
    store = DocStore(source.load())
    corpus: Corpus = store.corpus
    build_corpus_embeddings(corpus, cache_dir, encoder)
    docs = load_corpus_embeddings(cache_dir, corpus, encoder)
    users = torch.stack([docs[corpus.user_rows(i, 100)].mean(0) for i in range(len(corpus.user_ids))])
    communities = load_communities(data_dir)
    return store, users, np.array([communities[u] for u in corpus.user_ids]), str(data_dir)


class UserMixture:
    """One diagonal Gaussian per community, fitted to real user vectors; samples in float32 chunks."""

    def __init__(self, users: np.ndarray, communities: np.ndarray) -> None:
        ids = np.unique(communities)
        self.share = np.array([(communities == c).mean() for c in ids])
        self.means = np.stack([users[communities == c].mean(0) for c in ids]).astype(np.float32)
        stds = [users[communities == c].std(0) if (communities == c).sum() > 1 else None for c in ids]
        pooled = np.mean([s for s in stds if s is not None], axis=0)
        self.stds = np.stack([pooled if s is None else s for s in stds]).astype(np.float32)
        self.sizes = [int((communities == c).sum()) for c in ids]

    def sample(self, n: int, seed: int, chunk: int = 100_000) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        comm = rng.choice(len(self.share), size=n, p=self.share)
        out = np.empty((n, self.means.shape[1]), dtype=np.float32)
        for s in range(0, n, chunk):
            c = comm[s:s + chunk]
            out[s:s + chunk] = self.means[c] + self.stds[c] * rng.standard_normal((len(c), out.shape[1]),
                                                                                  dtype=np.float32)
        return out, comm


def nearest_other_cos(x: torch.Tensor) -> float:
    z = F.normalize(x.float(), dim=-1)
    sim = z @ z.T
    sim.fill_diagonal_(-2.0)
    return float(sim.max(1).values.mean())


# ---------------------------------------------------------------------------------------------- timings

@contextmanager
def search_threads():
    """Searches run on SEARCH_THREADS threads: a serving worker answers on its own thread, and on a shared box
    OpenMP barriers turn a 1 ms faiss scan into 20 ms of spinning (measured here at load 5 on 2 cores)."""
    threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(SEARCH_THREADS)
    faiss.omp_set_num_threads(SEARCH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads[0])
        faiss.omp_set_num_threads(threads[1])


def time_single(fn: Callable[[np.ndarray], object], queries: np.ndarray, max_n: int,
                budget_s: float) -> list[float]:
    """Per-query latencies (s) of one-query calls, until max_n queries or the time budget (at least 5)."""
    fn(queries[:1])
    lat: list[float] = []
    end = time.perf_counter() + budget_s
    for i in range(min(max_n, len(queries))):
        t = time.perf_counter()
        fn(queries[i:i + 1])
        lat.append(time.perf_counter() - t)
        if time.perf_counter() > end and len(lat) >= 5:
            break
    return lat


def time_batches(fn: Callable[[np.ndarray], object], queries: np.ndarray, batch: int, max_batches: int,
                 budget_s: float) -> float:
    """Queries/s of batch calls, until max_batches or the time budget (at least 2 batches)."""
    fn(queries[:batch])
    done, t0 = 0, time.perf_counter()
    for b in range(max_batches):
        s = (b * batch) % max(1, len(queries) - batch + 1)
        fn(queries[s:s + batch])
        done += batch
        if time.perf_counter() - t0 > budget_s and b >= 1:
            break
    return done / (time.perf_counter() - t0)


def recall(rows: np.ndarray, truth: np.ndarray) -> float:
    m = truth.shape[1]
    return float(np.mean([len(set(a) & set(b)) / m for a, b in zip(rows.tolist(), truth.tolist())]))


def batched(fn: Callable[[np.ndarray], np.ndarray], queries: np.ndarray, batch: int = 256) -> np.ndarray:
    return np.concatenate([fn(queries[s:s + batch]) for s in range(0, len(queries), batch)])


def bench_torch(table_np: np.ndarray, queries: np.ndarray,
                args: argparse.Namespace) -> tuple[list, np.ndarray]:
    """The brute-force baseline: one matmul + topk over a table normalised once (its "build")."""
    base = rss()
    t0 = time.perf_counter()
    table_t = F.normalize(torch.from_numpy(table_np), dim=-1)
    build_s = time.perf_counter() - t0
    delta = rss() - base

    def scan(q: np.ndarray) -> np.ndarray:
        return torch_topk_users(table_t, torch.from_numpy(q), args.m, normalize_table=False)[1].numpy()

    with search_threads():
        truth = batched(scan, queries[:args.recall_queries])
        lat = time_single(scan, queries, args.single_queries, args.budget_s)
        qps = time_batches(scan, queries, 64, args.max_batches, args.budget_s)
    return ["torch scan", f"{build_s:.2f}", f"{1e3 * np.percentile(lat, 50):.3f}",
            f"{1e3 * np.percentile(lat, 95):.3f}", f"{qps:,.0f}", mib(table_t.numel() * 4), mib(delta)], truth


def bench_size(n: int, mixture: UserMixture, args: argparse.Namespace, hnsw: dict) -> tuple[list[list], dict]:
    """One table row per method at n users, and the HNSW build time (to plan the next size)."""
    table_np, _ = mixture.sample(n, seed=args.seed)
    queries, _ = mixture.sample(max(args.recall_queries, args.single_queries, 64 * 4), seed=args.seed + 1)
    ids = [str(i) for i in range(n)]
    m = args.m
    out, info = [], {}

    torch_row, truth = bench_torch(table_np, queries, args)
    torch_row.append("1 (reference)")
    for kind in args.kinds:
        params: dict = {}
        if kind == "ivf":
            nlist = max(1, min(n // 39, int(4 * np.sqrt(n)), args.ivf_nlist_max))
            params = {"nlist": nlist, "nprobe": args.nprobe}
        elif kind == "hnsw":
            params = {"hnsw_m": hnsw["M"], "ef_construction": hnsw["efConstruction"],
                      "ef_search": args.ef_search}
        base = rss()
        t0 = time.perf_counter()
        index = UserIndex.build(ids, table_np, kind, **params)
        build_s = time.perf_counter() - t0
        delta = rss() - base

        def search(q: np.ndarray, index: UserIndex = index) -> np.ndarray:
            return index.search_rows(q, m)[1]

        label = {"flat": "faiss flat (exact)",
                 "ivf": f"faiss IVF nlist={params.get('nlist')} nprobe={args.nprobe}",
                 "hnsw": f"faiss HNSW M={hnsw['M']} efC={hnsw['efConstruction']} efS={args.ef_search}"}[kind]
        # flat: our BLAS threshold (index.py), then faiss's own default — the before/after of batched exact search
        sweep = {"flat": [None, "faiss default"], "ivf": [args.nprobe] + [p for p in (64, 256) if p < params.get("nlist", 0)],
                 "hnsw": [args.ef_search, 4 * args.ef_search]}[kind]
        for setting in sweep:
            ours = faiss.cvar.distance_compute_blas_threshold
            if kind == "flat" and setting:
                faiss.cvar.distance_compute_blas_threshold = FAISS_DEFAULT_BLAS_THRESHOLD
            if kind == "ivf":
                index.index.nprobe = setting
            elif kind == "hnsw":
                index.index.hnsw.efSearch = setting
            with search_threads():
                # the torch scan is the exact reference; flat is checked on fewer queries (it is slow here)
                nq = args.check_queries if kind == "flat" else args.recall_queries
                rows = batched(search, queries[:nq])
                lat = time_single(search, queries, args.single_queries, args.budget_s)
                qps = time_batches(search, queries, 64, args.max_batches, args.budget_s)
            faiss.cvar.distance_compute_blas_threshold = ours
            first = setting == sweep[0]
            knob = {"flat": "BLAS threshold", "ivf": "nprobe", "hnsw": "efSearch"}[kind]
            name = label if first else f"↳ same index, {knob}={setting}"
            out.append([name, f"{build_s:.2f}" if first else "", f"{1e3 * np.percentile(lat, 50):.3f}",
                        f"{1e3 * np.percentile(lat, 95):.3f}", f"{qps:,.0f}",
                        mib(serialized_bytes(index.index)) if first else "", mib(delta) if first else "",
                        f"{recall(rows, truth[:nq]):.4f}" + (f" ({nq} q)" if kind == "flat" else "")])
        if kind == "hnsw":
            info["hnsw_build_s"] = build_s
        del index, search
        gc.collect()
    return [torch_row] + out, info


# ------------------------------------------------------------------------------------------- end to end

def end_to_end(store: DocStore, args: argparse.Namespace) -> list[list]:
    """Queries/s of each baseline over the dev queries (k = 5): a first and a second batched call (BM25 builds
    its per-user indexes in the first, Dense warms up), then one query per call."""
    queries = [Query(e.user_id, e.query, e.input, e.example_id) for e in store.dataset.examples["dev"]]
    rows = []
    for name, strategy in [("zero-shot", ZeroShot()), ("random", RandomDocs()), ("recency", Recency()),
                           ("BM25 (bm25s, per-user LRU)", BM25()),
                           (f"dense {args.encoder} (incl. query encoding)",
                            Dense(args.encoder, args.cache_dir))]:
        t0 = time.perf_counter()
        strategy.prepare(store)
        prep = time.perf_counter() - t0
        qps = []
        for _ in range(2):
            t0 = time.perf_counter()
            strategy.retrieve(queries, args.k)
            qps.append(len(queries) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for q in queries:
            strategy.retrieve([q], args.k)
        qps.append(len(queries) / (time.perf_counter() - t0))
        rows.append([name, f"{prep:.2f}"] + [f"{x:,.0f}" for x in qps])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    parser.add_argument("--quick", action="store_true", help="1k and 100k users only")
    parser.add_argument("--m", type=int, default=6)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--fit-users", type=int, default=300)
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--cache-dir", default=".cache/persrag")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-queries", type=int, default=100)
    parser.add_argument("--max-batches", type=int, default=16)
    parser.add_argument("--recall-queries", type=int, default=500)
    parser.add_argument("--check-queries", type=int, default=100,
                        help="queries checking faiss flat against torch")
    parser.add_argument("--budget-s", type=float, default=5.0,
                        help="time cap per latency/throughput measurement")
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--ivf-nlist-max", type=int, default=1024,
                        help="cap on nlist (4*sqrt(n)): k-means with 4000 lists on 1M users is >10 min here")
    parser.add_argument("--kinds", nargs="+", choices=["flat", "ivf", "hnsw"], default=["flat", "ivf", "hnsw"],
                        help="faiss indexes to measure next to the torch scan")
    parser.add_argument("--hnsw-m", type=int, default=32)
    parser.add_argument("--ef-construction", type=int, default=100)
    parser.add_argument("--ef-search", type=int, default=128)
    parser.add_argument("--hnsw-budget-s", type=float, default=300.0,
                        help="if the projected HNSW build is longer, fall back to M=16, efConstruction=40")
    parser.add_argument("--threads", type=int, default=0, help="torch and faiss threads (0: all cores)")
    parser.add_argument("--search-threads", type=int, default=1, help="threads of the search timings")
    args = parser.parse_args()
    global SEARCH_THREADS
    SEARCH_THREADS = args.search_threads
    if args.threads:
        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    sizes = [1000, 100_000] if args.quick else sorted(args.sizes)

    print(f"command: `python {' '.join(sys.argv)}`\n")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM; faiss {faiss.__version__} "
          f"(omp threads {faiss.omp_get_max_threads()}, GPUs {getattr(faiss, 'get_num_gpus', lambda: 0)()}), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads); load average at start "
          f"{os.getloadavg()[0]:.1f} (other jobs share this machine: timings are noisy). Search timings "
          f"(latency, batch throughput, recall) run on {args.search_threads} thread(s), builds on "
          f"{torch.get_num_threads()}.\n")

    store, users, communities, _ = real_users(args.fit_users, args.cache_dir, args.encoder)
    mixture = UserMixture(users.numpy(), communities)
    print(f"## User-embedding mixture (fitted to {len(users)} real SynthLaMP LaMP-2 users, MEAN-pooled "
          f"{args.encoder} doc vectors, d = {users.shape[1]})\n")
    print(table(["community", "real users", "‖mean‖", "mean per-dim std"],
                [[c, s, f"{np.linalg.norm(mu):.3f}", f"{sd.mean():.4f}"]
                 for c, (s, mu, sd) in enumerate(zip(mixture.sizes, mixture.means, mixture.stds))]))
    sampled, sampled_comm = mixture.sample(len(users), seed=args.seed + 2)
    sampled_t = torch.from_numpy(sampled)
    print("\nReal vs sampled users (same count): how faithful the synthetic table is.\n")
    print(table(["set", "mean cos to nearest other user", f"same-community precision@{args.m}"],
                [["real (MEAN-pooled)", f"{nearest_other_cos(users):.3f}",
                  f"{community_precision_at_m(users, torch.as_tensor(communities), args.m):.3f}"],
                 ["sampled (diag. Gaussian mixture)", f"{nearest_other_cos(sampled_t):.3f}",
                  f"{community_precision_at_m(sampled_t, torch.as_tensor(sampled_comm), args.m):.3f}"]]))

    hnsw = {"M": args.hnsw_m, "efConstruction": args.ef_construction}
    prev: tuple[int, float] | None = None
    for n in sizes:
        note = ""
        if prev is not None:
            projected = prev[1] * n / prev[0] * 1.3  # HNSW insert cost grows ~ n log n
            if projected > args.hnsw_budget_s and hnsw["M"] != 16:
                hnsw = {"M": 16, "efConstruction": 40}
                note = (f"HNSW build projected at {projected:.0f} s (> {args.hnsw_budget_s:.0f} s) with the "
                        f"default parameters, so this size uses M=16, efConstruction=40.")
        print(f"\n## Top-{args.m} users among {n:,} sampled users (d = {users.shape[1]}, "
              f"{args.recall_queries} held-out queries for recall vs the exact torch scan)\n")
        if note:
            print(note.strip() + "\n")
        t0 = time.perf_counter()
        rows, info = bench_size(n, mixture, args, hnsw)
        print(table(["method", "build s", "p50 ms (1 query)", "p95 ms (1 query)", "queries/s (batch 64)",
                     "index MiB (serialized / table)", "RSS Δ MiB (incl. id map)",
                     f"recall@{args.m} vs exact"], rows))
        print(f"\n({time.perf_counter() - t0:.0f} s for this size)")
        if "hnsw_build_s" in info:
            prev = (n, info["hnsw_build_s"]) if hnsw["M"] == args.hnsw_m else prev
        sys.stdout.flush()

    print(f"\n## End-to-end retrieve without the LLM ({len(store.corpus.user_ids)}-user SynthLaMP LaMP-2, "
          f"{len(store.dataset.examples['dev'])} dev queries, k = {args.k}, CPU)\n")
    print(table(["strategy", "prepare s", "queries/s (1st batched call)", "queries/s (2nd batched call)",
                 "queries/s (one query per call)"],
                end_to_end(store, args)))
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
