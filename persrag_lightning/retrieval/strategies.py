"""The strategies of an evaluate config, built by name, bound and run in a reranker runtime, and
their content-addressed retrieval cache: what evaluation, the generator stage's training prompts and
the pipeline share.

In `retrieval/` (below `evaluation/` and `generator/` in the layers) so the generator stage reads a
strategy's retrievals without importing the evaluation."""

from __future__ import annotations

import json
import re
import time
from functools import lru_cache
from pathlib import Path

from persrag_lightning.data.records import Example
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy, cache_value
from persrag_lightning.stages import RUN_DIR, fill_run_dir
from persrag_lightning.utils import (
    ConfigError,
    atomic_write_json,
    fingerprint,
    resolve_config_path,
)

__all__ = ["bind_strategies", "cached_retrieval", "docs_from_store", "file_name", "resolve_reranker_runtime",
           "set_reranker_runtime", "stored_docs", "strategy_by_name", "strategy_config", "strategy_names"]


def file_name(name: str) -> str:
    """A strategy name as a file name ("w/o user retrieval" → "w_o_user_retrieval")."""
    return re.sub(r"[^\w.-]+", "_", name).strip("_")


def strategy_config(strategy: Strategy) -> dict:
    """What identifies a strategy's retrievals: its class and its `cache_config`, or else its
    constructor's settings (its public attributes), every setting that names an exported bundle
    replaced by the digest of its files (`cache_value`)."""
    out: dict = {"class": type(strategy).__qualname__}
    # only when set: the keys of strategies without it stay as they were
    if strategy.prompt_gamma is not None:
        out["prompt_gamma"] = strategy.prompt_gamma
    # a strategy that says what identifies its retrievals
    if (own := strategy.cache_config()) is not None:
        return {**out, **own}
    for key, value in vars(strategy).items():
        # labels, where caches live and
        if key in ("name", "cache_dir", "batch_size") or key.startswith("_"):
            # runtime state (`_x`, e.g. a model `prepare` loaded) do not change what is retrieved
            continue
        # a wrapped strategy (a tuned generator over a retrieval method)
        if isinstance(value, Strategy):
            out[key] = strategy_config(value)
        elif (held := cache_value(value)) is not None or value is None:
            out[key] = held
    return out


# folder under a cache_dir: retrieved rows by strategy content, shared by every reader
RETRIEVALS = "retrievals"


# v2: each doc's user similarity and stage scores are kept with its row; v1 kept the rows alone, so a
# retrieval read back from the cache handed the trained reader every neighbour at similarity 1.0
RETRIEVAL_CACHE = "retrieve/v2"


def stored_docs(retrieved: list[list[RetrievedDoc]]) -> dict:
    """Each question's docs as a cache keeps them: the rows, and per doc its user similarity and its
    retriever's and reranker's scores (NaN: a stage that did not score it)."""
    return {"rows": [[d.row for d in ds] for ds in retrieved],
            "scores": [[[d.user_sim, d.retriever_score, d.reranker_score] for d in ds] for ds in retrieved]}


def docs_from_store(store: DocStore, stored: dict) -> list[list[RetrievedDoc]]:
    """`stored_docs` read back: the docs as they were retrieved, provenance and scores included."""
    return [[store.doc(r, user_sim=sim, retriever_score=first, reranker_score=second)
             for r, (sim, first, second) in zip(rows, scores)]
            for rows, scores in zip(stored["rows"], stored["scores"])]


def cached_retrieval(strategy: Strategy, store: DocStore, examples: list[Example], k: int,
                     cache_dir: str | Path, data_name: str) -> tuple[list[list[RetrievedDoc]], float]:
    """Top-k docs of `strategy` for `examples` and the milliseconds per query it took, cached under
    a fingerprint of the strategy's content (bundles by digest), the examples and k: evaluation, the
    generator stage's training prompts and every "+ tuned generator" row read one strategy's
    retrievals once."""
    strategy = strategy.wrapped or strategy  # a wrapper retrieves as the strategy it wraps
    key = fingerprint(RETRIEVAL_CACHE, strategy_config(strategy), k,
                      [(e.example_id, e.user_id, e.input, e.profile) for e in examples], data_name)
    path = Path(cache_dir) / RETRIEVALS / f"{file_name(strategy.name)}-{key}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        return docs_from_store(store, cached), cached["ms_per_query"]
    t0 = time.perf_counter()
    strategy.prepare(store)
    retrieved = strategy.retrieve(
        [Query(e.user_id, e.query, e.input, e.example_id) for e in examples], k
    )
    ms = 1000 * (time.perf_counter() - t0) / max(1, len(examples))
    atomic_write_json(path, {"strategy": strategy.name, "k": k, "ms_per_query": ms,
                             "example_ids": [e.example_id for e in examples], **stored_docs(retrieved)}, indent=None)
    return retrieved, ms


def _strategies_parser():
    """The parser of an evaluate config's `strategies` list alone (the rest of the file is the
    evaluator's)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--strategies", type=list[Strategy], required=True)
    return parser


def _config_strategies(config: str | Path, run_dir: str) -> list[Strategy]:
    """The strategies of an evaluate config, the run folder filled in, built but not prepared
    (nothing is loaded)."""
    import yaml

    path = Path(config)
    rows = (yaml.safe_load(path.read_text()) or {}).get("strategies")
    if rows is None:
        raise ConfigError(f"{path}: no `strategies` list")
    parser = _strategies_parser()
    cfg = fill_run_dir(parser.parse_object({"strategies": rows}), run_dir)
    return parser.instantiate_classes(cfg).strategies


def bind_strategies(strategies: list[Strategy]) -> None:
    """Wrappers that name another strategy of the config (`TunedGenerator(retrieval=...)`) get that
    object."""
    by_name = {s.name: s for s in strategies}
    for s in strategies:
        s.bind(by_name)


def resolve_reranker_runtime(runtime: str) -> str:
    """A reranker runtime of models/reranker.py; `bf16_if_native` is bf16 where this CPU computes
    bfloat16 natively, else fp32."""
    from persrag_lightning.hardware import native_runtime
    from persrag_lightning.models.reranker import RUNTIMES

    runtime = native_runtime(runtime)
    if runtime not in RUNTIMES:
        raise ValueError(f"reranker_runtime must be bf16_if_native or one of {', '.join(RUNTIMES)}, got {runtime!r}")
    return runtime


def set_reranker_runtime(strategies: list[Strategy], runtime: str) -> None:
    """Run the cross-encoder of every reranking row that keeps the default fp32 in `runtime`
    (models/reranker.py's RUNTIMES, or `bf16_if_native`: bf16 autocast where this CPU computes
    bfloat16 natively, else fp32); a row that names its own runtime keeps it. Call before the
    strategies retrieve: the runtime is part of a row's cache key."""
    runtime = resolve_reranker_runtime(runtime)
    if runtime == "fp32":
        return
    for s in strategies:
        s.use_reranker_runtime(runtime)


@lru_cache(maxsize=8)
def strategy_names(config: str | Path) -> list[str]:
    """The row names of an evaluate config's strategies (built, not prepared: nothing is loaded)."""
    return [s.name for s in _config_strategies(resolve_config_path(str(config)), RUN_DIR)]


def strategy_by_name(
    config: str | Path, name: str, run_dir: str, reranker_runtime: str = "fp32"
) -> Strategy:
    """One strategy of an evaluate config, by its name, with the run folder filled in (not
    prepared yet)."""
    strategies = _config_strategies(config, run_dir)
    set_reranker_runtime(strategies, reranker_runtime)
    bind_strategies(strategies)
    for s in strategies:
        if s.name == name:
            return s
    raise ConfigError(
        f"{config}: strategies: no strategy named {name!r}; it has {[s.name for s in strategies]}"
    )
