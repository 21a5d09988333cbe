"""`CFRAGPipeline.retrieve` latency, one query at a time, without the LLM: p50 / p95 per stage (similar users,
first-stage docs, rerank, total), CPU time per query and load time, for the paper's settings (baseline: all m·k
candidates reranked by the fp32 cross-encoder), for each inference-time option of CFRAG (retrieval/cfrag.py) and
for the distilled and the split rerankers (when the run has them), with the agreement of each option's final top-k with the
baseline's (overlap@k, and the share of queries with the same docs in the same order). The fp32 rows' encoders run
their Linear layers on the runtime policy's float32 GEMM path (persrag_lightning/runtime.py, named in the first
lines; PERSRAG_GEMM=torch: torch's own). Wall-clock timings; on a machine shared with other jobs say so ("shared
CPU"). Asserts nothing.

    python benchmarks/bench_serving.py --run checkpoints/synthlamp-quick-b4 --queries 40
    python benchmarks/bench_serving.py --run checkpoints/magazines-quick --task LaMP-3 --data_dir data/magazines
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from persrag_lightning.data.source import LampSource
from persrag_lightning.hardware import cpu_has_native_bf16
from persrag_lightning.runtime import announce, gemm_choice
from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline

# name → (from_pretrained settings, torch threads or None for the default). The baseline is the paper's CFRAG.
# the reranker named: it is what the options time, whichever order the run's pipeline.json chose on dev
BASELINE = {"rerank_top": None, "reranker_runtime": "fp32", "cache_doc_tokens": False, "query_runtime": "fp32",
            "reranker": "reranker"}
OPTIONS: dict[str, dict] = {
    "baseline (fp32, all m·k)": {},
    "(a) cached doc tokens": {"cache_doc_tokens": True},
    "(b) int8": {"reranker_runtime": "int8"},
    "(c) onnx": {"reranker_runtime": "onnx"},
    "(d) rerank top 10": {"rerank_top": 10},
    "(d) rerank top 5": {"rerank_top": 5},
    "(e) bf16 autocast": {"reranker_runtime": "bf16"},
    "(e) 1 thread": {"threads": 1},
    "(a+e) bf16 + cached (serving default until 2026-11-23)": {"reranker_runtime": "bf16", "cache_doc_tokens": True},
    "(a+e) bf16 + cached + 1 thread": {"reranker_runtime": "bf16", "cache_doc_tokens": True, "threads": 1},
    "(a+c+e) onnx + cached + 1 thread": {"reranker_runtime": "onnx", "cache_doc_tokens": True, "threads": 1},
    "(b+d) int8 + top 10 + cached": {"reranker_runtime": "int8", "rerank_top": 10, "cache_doc_tokens": True},
    "(c+d) onnx + top 10 + cached": {"reranker_runtime": "onnx", "rerank_top": 10, "cache_doc_tokens": True},
    "(c+d) onnx + top 5 + cached": {"reranker_runtime": "onnx", "rerank_top": 5, "cache_doc_tokens": True},
    "(i) openvino": {"reranker_runtime": "openvino"},
    "(a+i) openvino + cached": {"reranker_runtime": "openvino", "cache_doc_tokens": True},
    "(f) bf16 query + (a+e)": {"query_runtime": "bf16", "reranker_runtime": "bf16", "cache_doc_tokens": True},
    "(j) openvino query + (a+i) (serving default where installed)": {"query_runtime": "openvino",
                                                                     "reranker_runtime": "openvino",
                                                                     "cache_doc_tokens": True},
    # torch at the process's threads while retrieving, as before the pipeline's 1-thread rule for all-exported
    # encoders (CFRAGPipeline's `threads`; the runtimes load under the same count either way)
    "(j) with torch on 2 threads while retrieving": {"query_runtime": "openvino", "reranker_runtime": "openvino",
                                                     "cache_doc_tokens": True, "pipeline_threads": 2},
    # the reranker distilled into its first layer (configs/cfrag_reranker_distilled.yaml): another model, so its
    # agreement with the baseline is the student's fidelity, not a runtime's rounding
    "(g) distilled 1-layer reranker + (a+e)": {"reranker": "reranker_distilled", "reranker_runtime": "bf16",
                                               "cache_doc_tokens": True},
    "(f+g) distilled + bf16 query + (a+e)": {"reranker": "reranker_distilled", "query_runtime": "bf16",
                                             "reranker_runtime": "bf16", "cache_doc_tokens": True},
    "(g) distilled 2-layer reranker + (a+e)": {"reranker": "reranker_distilled_l2", "reranker_runtime": "bf16",
                                               "cache_doc_tokens": True},
    "(h) no reranker: first-stage order": {"reranker": None},
    "(h+f) first-stage order, bf16 query": {"reranker": None, "query_runtime": "bf16"},
    "(h+j) first-stage order, openvino query (serving default where installed)": {"reranker": None,
                                                                                 "query_runtime": "openvino"},
    # the reranker whose layers below its split read query and doc apart (models/reranker_split.py), distilled from
    # stage 3's (configs/overlays/reranker_split.yaml): a doc's states computed the first time it is a candidate
    # ("as they come": what a doc's first query pays), or for every stored doc at load ("precomputed":
    # `precompute_doc_states`, its minutes in the load column)
    **{f"(l) split reranker, {runtime}, doc states {when}": {
        "reranker": "reranker_split", "reranker_runtime": runtime, "cache_doc_tokens": True,
        "precompute_doc_states": when == "precomputed"}
       for runtime in ("bf16", "fp32") for when in ("as they come", "precomputed")},
    # split one layer higher (`--stage_name reranker_split_l5 --model.init_args.config.split_layer=5`): the last layer
    # alone reads query and doc together, at [CLS]
    "(l) split reranker at layer 5, bf16, doc states precomputed": {
        "reranker": "reranker_split_l5", "reranker_runtime": "bf16", "cache_doc_tokens": True,
        "precompute_doc_states": True},
    # what `from_pretrained` serves where dev chose the split reranker's order (`--preset quick-split`): the query
    # encoder in its serving runtime, the split reranker in torch
    "(l+j) split reranker at layer 5, bf16, doc states precomputed, openvino query (served)": {
        "reranker": "reranker_split_l5", "reranker_runtime": "bf16", "query_runtime": "openvino",
        "cache_doc_tokens": True, "precompute_doc_states": True},
    "(l+j) split reranker, bf16, doc states precomputed, openvino query": {
        "reranker": "reranker_split", "reranker_runtime": "bf16", "query_runtime": "openvino", "cache_doc_tokens": True,
        "precompute_doc_states": True},
    # a cascade: the distilled reranker scores all m·k, the trained reranker only its top N ("fewer pairs through a
    # cheaper first cut"); N is chosen on dev (--split dev), reported on test
    **{f"(k) distilled first cut, top {n} + (j)": {"first_cut": "reranker_distilled", "rerank_top": n,
                                                   "query_runtime": "openvino", "reranker_runtime": "openvino",
                                                   "cache_doc_tokens": True} for n in (10, 12, 13, 14, 15, 20)},
}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


class Timer:
    """Wraps a callable and sums its wall time (per query: reset between queries)."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


class Option:
    """One option's pipeline, its stage timers and what it measured."""

    def __init__(self, run: str, cache_dir: str, settings: dict, k: int) -> None:
        settings = dict(settings)
        self.threads = settings.pop("threads", None) or torch.get_num_threads()
        pipeline_threads = settings.pop("pipeline_threads", None)  # the pipeline's own `threads` argument
        with threads(self.threads):
            t0 = time.perf_counter()
            self.pipe = CFRAGPipeline.from_pretrained(run, cache_dir=cache_dir, k=k, threads=pipeline_threads,
                                                      **{**BASELINE, **settings})
            self.load_s = time.perf_counter() - t0
        s = self.pipe.strategy
        self.users = s.source.similar_users = Timer(s.source.similar_users)
        self.cands = s.candidates = Timer(s.candidates)
        self.rerank = s.rerank = Timer(s.rerank)
        self.rows: list[list[int]] = []
        self.stages: dict[str, list[float]] = {"users": [], "docs": [], "rerank": [], "total": [], "cpu": []}

    def query(self, user_id: str, text: str, record: bool = True) -> None:
        self.users.seconds = self.cands.seconds = self.rerank.seconds = 0.0
        with threads(self.threads):
            c0, t0 = time.process_time(), time.perf_counter()
            docs = self.pipe.retrieve(user_id, text)
            total, cpu = time.perf_counter() - t0, time.process_time() - c0
        if not record:
            return
        self.rows.append([d.row for d in docs])
        for key, value in (("users", self.users.seconds), ("docs", self.cands.seconds - self.users.seconds),
                           ("rerank", self.rerank.seconds), ("total", total), ("cpu", cpu)):
            self.stages[key].append(1000 * value)


@contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def agreement(rows: list[list[int]], base: list[list[int]], k: int) -> tuple[float, float]:
    overlap = sum(len(set(a) & set(b)) / max(1, min(k, len(b))) for a, b in zip(rows, base)) / max(1, len(base))
    exact = sum(a == b for a, b in zip(rows, base)) / max(1, len(base))
    return overlap, exact


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="checkpoints/synthlamp-quick", help="an exported run (user_encoder, retriever, "
                   "reranker, docstore)")
    p.add_argument("--queries", type=int, default=50, help="questions of --split, one at a time")
    p.add_argument("--split", default="test", choices=("test", "dev"),
                   help="test for reporting; dev to choose a setting (e.g. the cascade's N)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--task", default="LaMP-2", help="the run's task (a converted folder's own: its convert.json)")
    p.add_argument("--data_dir", default=None, help="the run's LaMP folder (default: the embedded SynthLaMP)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--cache-dir", default=".cache/persrag")
    p.add_argument("--only", nargs="*", help="option names (substrings) to run besides the baseline")
    p.add_argument("--blocks", action="store_true",
                   help="each option's queries in one block, as a server of one configuration sees them (the default "
                        "interleaves the options per query: other jobs' load falls on every option alike, but each "
                        "option's pass evicts the others' caches)")
    args = p.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no "Loading weights" bar per model load (lightning stays out, as in serving)
    hf_logging.disable_progress_bar()

    source = LampSource(args.task, args.data_dir, cache_dir=args.cache_dir)
    source.prepare()
    data = source.load()
    examples = data.examples.get(args.split, [])
    if len(examples) < args.queries:
        raise SystemExit(f"{args.split} has {len(examples)} questions, fewer than --queries {args.queries}")
    queries = [(e.user_id, e.input) for e in examples][:args.queries]
    options = {n: o for i, (n, o) in enumerate(OPTIONS.items())
               if i == 0 or not args.only or any(s in n for s in args.only)}
    for runtime, modules in (("onnx", ("onnxruntime", "onnx")), ("openvino", ("openvino", "onnx"))):
        if any(importlib.util.find_spec(m) is None for m in modules):
            print(f'{runtime} rows skipped: {" or ".join(modules)} is not installed (pip install -e ".[{runtime}]")')
            options = {n: o for n, o in options.items() if runtime not in (o.get("reranker_runtime"),
                                                                            o.get("query_runtime"))}
    for bundle in sorted({o[key] for o in options.values() for key in ("reranker", "first_cut") if o.get(key)}):
        if not (Path(args.run) / bundle / "config.json").is_file():
            print(f"rows of {bundle} skipped: {args.run}/{bundle} is not trained (configs/evaluate_distilled.yaml "
                  "names the commands)")
            options = {n: o for n, o in options.items() if bundle not in (o.get("reranker"), o.get("first_cut"))}
    if not cpu_has_native_bf16():
        print("this CPU has no native bf16: the bf16 row runs emulated")
    announce(gemm_choice())  # the path the fp32 rows' encoders take
    print(f"{len(queries)} {args.split} queries one at a time, k = {args.k}, m·k = 30 candidates, {torch.get_num_threads()} torch "
          f"threads; {'each option in its own block' if args.blocks else 'the options interleaved per query'}; "
          f"wall-clock ms (shared CPU: other jobs may run on these cores)")
    results: dict[str, Option] = {}
    for name, settings in options.items():  # every pipeline loaded first (load time each), then queried in turns
        results[name] = Option(args.run, args.cache_dir, settings, args.k)
        print(f"  loaded {name} in {results[name].load_s:.1f} s", flush=True)
    names = list(results)
    for user_id, text in queries[:args.warmup]:  # first calls pay one-time costs (allocator, oneDNN kernels)
        for name in names:
            results[name].query(user_id, text, record=False)
    # Each query goes through every option in turn, the order rotated per query: a burst of load from other jobs
    # on the shared cores then falls on every option alike instead of on whichever ran at that moment.
    if args.blocks:
        for name in names:
            for user_id, text in queries:
                results[name].query(user_id, text)
            print(f"  {name}: {len(queries)} queries", flush=True)
    else:
        for i, (user_id, text) in enumerate(queries):
            for name in names[i % len(names):] + names[:i % len(names)]:
                results[name].query(user_id, text)
            if (i + 1) % 10 == 0:
                print(f"  {i + 1}/{len(queries)} queries", flush=True)
    base = results[names[0]].rows
    head = (f"| option | load s | users p50/p95 | docs p50/p95 | rerank p50/p95 | total p50/p95 | CPU ms/query | "
            f"overlap@{args.k} | same order |")
    print("\n" + head + "\n|" + "---|" * 9)
    for name, r in results.items():
        st = r.stages
        overlap, exact = agreement(r.rows, base, args.k)
        cells = " | ".join(f"{pct(st[s], .5):.1f} / {pct(st[s], .95):.1f}" for s in ("users", "docs", "rerank", "total"))
        print(f"| {name} | {r.load_s:.1f} | {cells} | {sum(st['cpu']) / len(st['cpu']):.0f} | {overlap:.3f} | "
              f"{exact:.2f} |")


if __name__ == "__main__":
    main()
