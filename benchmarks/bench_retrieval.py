"""Retrieval benchmark: top-m user retrieval (faiss flat / IVF / IVF-SQ8 + re-rank / HNSW vs a brute-force
torch scan) at 1k-1M users, and end-to-end queries/s of the non-collaborative baselines (no LLM).

    python benchmarks/bench_retrieval.py                      # 1k, 100k and 1M users, d = 384, m = 6
    python benchmarks/bench_retrieval.py --quick              # 1k and 100k only

Two sets of user vectors, both SAMPLED (1M real SynthLaMP users would mean embedding ~40M docs):

- `encoded` (realistic, needs the quick pipeline's export, docs/getting-started.md): users drawn as SynthLaMP's
  generator draws them (community, history length, kinds by the community's taste, each item's style; the same
  world as the export's data), each history item played by a real doc of the same kind and style from the export's
  corpus, embedded by the export's trained user encoder (data/synth_scale.py). The encoder runs in bfloat16 here
  (3x faster; cosine to fp32 vectors 0.99998, top-6 neighbours 99.75 % the same); vectors are cached.
- `gaussian` (pessimistic): a Gaussian mixture with one component per latent community and a DIAGONAL std,
  fitted to --fit-users real users' MEAN-pooled MiniLM vectors. Within a community it has no low-rank structure,
  so neighbours are nearly uniformly far: the worst case for an ANN index.

Queries are fresh users drawn the same way; recall is against the exact torch scan. Prints Markdown tables;
asserts nothing about time.
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
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import psutil
import torch
import torch.nn.functional as F

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig, load_communities
from persrag_lightning.data.synth_scale import ScaledSynthUsers
from persrag_lightning.index import (
    BLAS_MIN_QUERIES,
    FAISS_DEFAULT_BLAS_THRESHOLD,
    TorchFlatIndex,
    build_index,
    faiss_has_gpus,
    normalized,
)
from persrag_lightning.logs import configure_logs
from persrag_lightning.metrics import community_precision_at_m
from persrag_lightning.models.corpus_embeddings import build_corpus_embeddings, load_corpus_embeddings
from persrag_lightning.models.user_encoder import UserEncoder
from persrag_lightning.progress import Progress
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.baselines import BM25, Dense, RandomDocs, Recency, ZeroShot
from persrag_lightning.retrieval.user_index import UserIndex, torch_topk_users
from persrag_lightning.utils import atomic_replace, bundle_digest

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
    if isinstance(index, TorchFlatIndex):
        index = index.to_faiss()
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


@dataclass
class VectorSet:
    """User vectors to index (a prefix of `table` per size), fresh query users, and real users to compare with."""

    name: str
    table: np.ndarray
    queries: np.ndarray
    real: torch.Tensor
    real_comm: np.ndarray
    sampled_comm: np.ndarray
    note: str


def gaussian_set(mixture: UserMixture, users: torch.Tensor, communities: np.ndarray, n: int, n_queries: int,
                 seed: int) -> VectorSet:
    table, comm = mixture.sample(n, seed=seed)
    queries, _ = mixture.sample(n_queries, seed=seed + 1)
    return VectorSet("gaussian", table, queries, users, communities, comm,
                     "diagonal Gaussian mixture fitted to MEAN-pooled MiniLM vectors (pessimistic)")


def encoded_set(args: argparse.Namespace, n: int, n_queries: int) -> VectorSet:
    """Users drawn as SynthLaMP draws them and embedded by the export's trained user encoder (cached)."""
    if not (Path(args.export) / "config.json").is_file():
        sys.exit(f"{args.export}: no user-encoder export; run the quick pipeline first "
                 f"(`persrag pipeline --preset quick`), or pass --vectors gaussian")
    encoder = UserEncoder.from_pretrained(args.export)
    config = SynthConfig()  # the quick preset's data; checked below by reproducing the export's user table
    source = LampSource("LaMP-2", None, config, args.cache_dir)
    source.prepare()
    users = ScaledSynthUsers(encoder, source.load(), config)
    real = users.real_embeddings()
    if not torch.allclose(real, encoder.user_embeddings, atol=1e-4):
        sys.exit(f"{args.export}: its users' embeddings are not reproduced from {config}: not the data it was "
                 "trained on")
    communities = load_communities(source.data_dir)
    real_comm = np.array([communities[u] for u in users.pool_users])
    path = Path(args.cache_dir) / "bench" / f"users-{bundle_digest(args.export)}-{n}-{args.seed}-bf16.npz"
    if path.is_file():
        cached = np.load(path)
        table, comm = cached["table"], cached["comm"]
    else:
        t0 = time.perf_counter()
        table, comm = users.encode(n, args.seed, dtype=torch.bfloat16,
                                   progress=Progress("encode sampled users", n, "users", every=30))
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_replace(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, table=table, comm=comm)
        print(f"(encoded {n:,} users in {time.perf_counter() - t0:.0f} s, {users.fallbacks:,} history items "
              f"played by a doc of their kind in another style (no real doc had theirs); cached in {path})\n")
    queries, _ = users.encode(n_queries, args.seed + 1, dtype=torch.bfloat16)
    # what bfloat16 changed: the first users again in float32 (the export's precision)
    check = min(n, 2000)
    exact = F.normalize(torch.from_numpy(users.encode(check, args.seed)[0]), dim=-1)
    fast = F.normalize(torch.from_numpy(table[:check]), dim=-1)
    top = [torch.topk(x[:200] @ x.T, args.m).indices for x in (exact, fast)]
    same = np.mean([len(set(a.tolist()) & set(b.tolist())) / args.m for a, b in zip(*top)])
    return VectorSet("encoded", table, queries, real, real_comm, comm,
                     f"drawn as SynthLaMP draws users, embedded by {args.export} (realistic); bfloat16 vs float32 "
                     f"on the first {check:,} users: cosine min {float((exact * fast).sum(1).min()):.5f}, top-{args.m} "
                     f"neighbours of 200 of them {100 * same:.2f} % the same")


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


def ivf_nlist(n: int, args: argparse.Namespace) -> int:
    return max(1, min(n // 39, int(4 * np.sqrt(n)), args.ivf_nlist_max))


def ivf_sq8_refined(table: np.ndarray, nlist: int, k_factor: int) -> faiss.Index:
    """IVF over 8-bit scalar-quantised vectors, its top m·k_factor re-ranked exactly (faiss IndexRefineFlat)."""
    x = normalized(table)
    base = faiss.index_factory(x.shape[1], f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
    base.train(x)
    index = faiss.IndexRefineFlat(base)
    index.k_factor = k_factor
    index.add(x)
    return index


@dataclass
class Method:
    """An index to measure: how to build it, the search knob swept on the built index, and its settings."""

    label: str
    build: Callable[[np.ndarray], object]  # table -> a UserIndex or a raw faiss index
    knob: str
    settings: list
    set_knob: Callable[[object, object], None]


def methods(n: int, args: argparse.Namespace) -> list[Method]:
    nlist = ivf_nlist(n, args)
    probes = [p for p in dict.fromkeys([args.nprobe, 64, 256]) if p <= nlist]
    ids = [str(i) for i in range(n)]
    out: list[Method] = []
    for kind in args.kinds:
        if kind == "flat":
            def blas(index: UserIndex, setting) -> None:
                faiss.cvar.distance_compute_blas_threshold = (FAISS_DEFAULT_BLAS_THRESHOLD if setting
                                                              else BLAS_MIN_QUERIES * index.dim)
            out.append(Method("faiss flat (exact)", lambda t: UserIndex.build(ids, t, "flat", gpu=False),
                              "BLAS threshold", [None, "faiss default"], blas))
        elif kind == "flat-gpu":  # UserIndex's GPU path (torch on CUDA), and faiss-gpu's flat index where it loads
            if not torch.cuda.is_available():
                sys.exit("--kinds flat-gpu needs a CUDA device")
            gpu = torch.cuda.get_device_name()
            out.append(Method(f"flat (exact) on {gpu}, torch matmul + top-k",
                              lambda t: UserIndex(TorchFlatIndex(build_index(t, "flat")), ids), "index",
                              ["TorchFlatIndex"], lambda i, _: None))
            if faiss_has_gpus():  # faiss-gpu's own flat index beside it (UserIndex keeps the torch one: faster)
                out.append(Method(f"flat (exact) on {gpu}, faiss-gpu",
                                  lambda t: UserIndex(faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0,
                                                                             build_index(t, "flat")), ids),
                                  "index", ["GpuIndexFlatIP"], lambda i, _: None))
        elif kind == "ivf-gpu":  # faiss-gpu only: UserIndex's IVF (trained on the CPU) moved to GPU 0
            if not faiss_has_gpus():
                print("# --kinds ivf-gpu skipped: this faiss build sees no GPU (faiss-gpu: docs/training/gpu.md)")
                continue
            out.append(Method(f"faiss IVF nlist={nlist} on {torch.cuda.get_device_name()}, faiss-gpu",
                              lambda t: UserIndex.build(ids, t, "ivf", nlist=nlist), "nprobe", probes,
                              lambda i, p: faiss.GpuParameterSpace().set_index_parameter(i.index, "nprobe", p)))
        elif kind == "ivf":
            out.append(Method(f"faiss IVF nlist={nlist}",
                              lambda t: UserIndex.build(ids, t, "ivf", nlist=nlist, gpu=False),
                              "nprobe", probes, lambda i, p: setattr(i.index, "nprobe", p)))
        elif kind == "ivf-sq8":
            out.append(Method(f"faiss IVF nlist={nlist} SQ8 + exact re-rank of {args.refine}·m",
                              lambda t: ivf_sq8_refined(t, nlist, args.refine), "nprobe", probes,
                              lambda i, p: setattr(faiss.downcast_index(i.base_index), "nprobe", p)))
        elif kind == "hnsw":
            for spec in args.hnsw:
                M, efc = (int(v) for v in spec.split(":"))
                out.append(Method(f"faiss HNSW M={M} efConstruction={efc}",
                                  lambda t, M=M, efc=efc: UserIndex.build(ids, t, "hnsw", hnsw_m=M,
                                                                          ef_construction=efc),
                                  "efSearch", args.ef_search,
                                  lambda i, e: setattr(i.index.hnsw, "efSearch", e)))
    return out


def bench_size(n: int, vectors: VectorSet, args: argparse.Namespace) -> list[list]:
    """One table row per method and search setting at n users (the first n of the vector set)."""
    table_np, queries, m = vectors.table[:n], vectors.queries, args.m
    torch_row, truth = bench_torch(table_np, queries, args)
    out = [torch_row + ["1 (reference)"]]
    for method in methods(n, args):
        base = rss()
        t0 = time.perf_counter()
        index = method.build(table_np)
        build_s = time.perf_counter() - t0
        delta = rss() - base
        if isinstance(index, UserIndex):
            search, raw = (lambda q, index=index: index.search_rows(q, m)[1]), index.index
        else:
            search, raw = (lambda q, index=index: index.search(normalized(q), m)[1]), index
        ours = faiss.cvar.distance_compute_blas_threshold
        for setting in method.settings:
            method.set_knob(index, setting)
            with search_threads():
                # the torch scan is the exact reference; flat is checked on fewer queries (slow at 1M)
                nq = args.check_queries if method.knob == "BLAS threshold" else args.recall_queries
                rows = batched(search, queries[:nq])
                lat = time_single(search, queries, args.single_queries, args.budget_s)
                qps = time_batches(search, queries, 64, args.max_batches, args.budget_s)
            faiss.cvar.distance_compute_blas_threshold = ours
            first = setting == method.settings[0]
            shown = "ours (4 queries)" if method.knob == "BLAS threshold" and setting is None else setting
            name = f"{method.label}, {method.knob}={shown}" if first else f"↳ same index, {method.knob}={shown}"
            out.append([name, f"{build_s:.1f}" if first else "", f"{1e3 * np.percentile(lat, 50):.3f}",
                        f"{1e3 * np.percentile(lat, 95):.3f}", f"{qps:,.0f}",
                        mib(serialized_bytes(raw)) if first else "", mib(delta) if first else "",
                        f"{recall(rows, truth[:nq]):.4f}" + (f" ({nq} q)" if nq != args.recall_queries else "")])
        del index, search, raw
        gc.collect()
    return out


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
    parser.add_argument("--kinds", nargs="+", choices=["flat", "ivf", "ivf-sq8", "hnsw", "flat-gpu", "ivf-gpu"],
                        default=["flat", "ivf", "ivf-sq8", "hnsw"],
                        help="indexes to measure next to the torch scan (flat-gpu, ivf-gpu: UserIndex on a CUDA device)")
    parser.add_argument("--refine", type=int, default=4, help="ivf-sq8: re-rank the top refine·m exactly")
    parser.add_argument("--hnsw", nargs="+", default=["32:100", "64:200"],
                        help="HNSW builds as M:efConstruction (built with all --threads)")
    parser.add_argument("--ef-search", type=int, nargs="+", default=[16, 32, 64, 128, 256],
                        help="HNSW efSearch settings measured on each build")
    parser.add_argument("--vectors", nargs="+", choices=["encoded", "gaussian"], default=["encoded", "gaussian"],
                        help="user-vector sets (module docstring); each runs every size")
    parser.add_argument("--export", default="checkpoints/synthlamp-quick/user_encoder",
                        help="the trained user encoder of the `encoded` set (the quick pipeline's export)")
    parser.add_argument("--threads", type=int, default=0, help="torch and faiss threads (0: all cores)")
    parser.add_argument("--search-threads", type=int, default=1, help="threads of the search timings")
    args = parser.parse_args()
    configure_logs(verbose=False)  # no "Loading weights" bars in the tables
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
    n_queries = max(args.recall_queries, args.single_queries, 64 * 4)
    for name in args.vectors:
        if name == "gaussian":
            mixture = UserMixture(users.numpy(), communities)
            print(f"## User-embedding mixture (fitted to {len(users)} real SynthLaMP LaMP-2 users, MEAN-pooled "
                  f"{args.encoder} doc vectors, d = {users.shape[1]})\n")
            print(table(["community", "real users", "‖mean‖", "mean per-dim std"],
                        [[c, s, f"{np.linalg.norm(mu):.3f}", f"{sd.mean():.4f}"]
                         for c, (s, mu, sd) in enumerate(zip(mixture.sizes, mixture.means, mixture.stds))]))
            vectors = gaussian_set(mixture, users, communities, max(sizes), n_queries, args.seed)
        else:
            vectors = encoded_set(args, max(sizes), n_queries)
        sampled_t = torch.from_numpy(vectors.table[:len(vectors.real)])
        print(f"\nReal vs sampled users ({len(vectors.real)} each), set `{name}`: {vectors.note}.\n")
        print(table(["set", "mean cos to nearest other user", f"same-community precision@{args.m}"],
                    [["real", f"{nearest_other_cos(vectors.real):.3f}",
                      f"{community_precision_at_m(vectors.real, torch.as_tensor(vectors.real_comm), args.m):.3f}"],
                     ["sampled", f"{nearest_other_cos(sampled_t):.3f}",
                      f"{community_precision_at_m(sampled_t, torch.as_tensor(vectors.sampled_comm[:len(vectors.real)]), args.m):.3f}"]]))
        for n in sizes:
            print(f"\n## Top-{args.m} users among {n:,} sampled users, set `{name}` (d = {vectors.table.shape[1]}, "
                  f"{args.recall_queries} held-out queries for recall vs the exact torch scan)\n")
            t0 = time.perf_counter()
            rows = bench_size(n, vectors, args)
            print(table(["method", "build s", "p50 ms (1 query)", "p95 ms (1 query)", "queries/s (batch 64)",
                         "index MiB (serialized / table)", "RSS Δ MiB (incl. id map)",
                         f"recall@{args.m} vs exact"], rows))
            print(f"\n({time.perf_counter() - t0:.0f} s for this size; load average {os.getloadavg()[0]:.1f})")
            sys.stdout.flush()
        del vectors
        gc.collect()

    print(f"\n## End-to-end retrieve without the LLM ({len(store.corpus.user_ids)}-user SynthLaMP LaMP-2, "
          f"{len(store.dataset.examples['dev'])} dev queries, k = {args.k}, CPU)\n")
    print(table(["strategy", "prepare s", "queries/s (1st batched call)", "queries/s (2nd batched call)",
                 "queries/s (one query per call)"],
                end_to_end(store, args)))
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
