"""Which runtime serving runs each encoder in: the reranker's and the query encoder's when the
caller says `auto`, whether retrieval then runs outside torch, and the runtime a served trained
reader embeds its texts in."""

from __future__ import annotations

import importlib.util

from persrag_lightning.hardware import native_runtime
from persrag_lightning.models.exported import EXPORTED_RUNTIMES
from persrag_lightning.retrieval.base import Strategy
from persrag_lightning.retrieval.cfrag import CFRAG

__all__ = ["all_exported", "reader_text_runtime", "resolve_runtime", "serving_runtime"]


def serving_runtime(part: str = "reranker") -> str:
    """The runtime of the serving reranker or query encoder (`part`) when none is named (`"auto"`):
    OpenVINO where it is installed (the `openvino` extra; bf16 where the CPU computes it natively,
    f32 elsewhere); else, for the reranker, torch's bf16 autocast where the CPU computes bf16
    natively, and fp32 otherwise. On 2 cores of the quick export (benchmarks/bench_serving.py,
    docs/performance/serving.md) OpenVINO reranked faster than bf16 autocast and nearer the fp32
    order, and embedded the query faster than fp32 torch, where bf16 autocast embedded it slower."""
    if importlib.util.find_spec("openvino") is not None and importlib.util.find_spec("onnx") is not None:
        return "openvino"
    return native_runtime("bf16_if_native") if part == "reranker" else "fp32"


def all_exported(strategy: CFRAG) -> bool:
    """Whether every encoder CFRAG's retrieval runs (the query encoder, the reranker and its first
    cut) runs in an exported runtime, outside torch (after `prepare`)."""
    models = [m for m in (strategy._reranker, strategy._first_cut) if m is not None]
    return (strategy.retriever.query_runtime in EXPORTED_RUNTIMES
            and all(m.runtime in EXPORTED_RUNTIMES for m in models))


def resolve_runtime(runtime: str, part: str) -> str:
    """A serving runtime argument as CFRAG runs it: `auto` is `serving_runtime`'s choice for `part`
    (`reranker` or `query`), any other is resolved by what this CPU computes natively."""
    return serving_runtime(part) if runtime == "auto" else native_runtime(runtime)


def reader_text_runtime(strategy: Strategy) -> str:
    """The runtime a served trained reader embeds the question (and its docs) in: the query
    encoder's where that runs exported, as both embed the same question; fp32 (torch) otherwise,
    for a strategy that embeds no query (BM25) too."""
    runtime = getattr(getattr(strategy, "retriever", None), "query_runtime", "fp32")
    return runtime if runtime in EXPORTED_RUNTIMES else "fp32"
