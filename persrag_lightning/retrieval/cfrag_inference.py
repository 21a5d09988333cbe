"""CFRAG's inference-time settings (serving latency: how many candidates are reranked, in which runtime;
the candidates and training never change) and the first-stage order that a rerank's first cut and the
ablation w/o reranker tuning rank by. The settings are documented in retrieval/cfrag.py's module
docstring."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import numpy as np

from persrag_lightning.models.reranker import RUNTIMES, Runtime
from persrag_lightning.retrieval.base import RetrievedDoc
from persrag_lightning.retrieval.corpus_retriever import QUERY_RUNTIMES

__all__ = ["InferenceSettings", "QueryRuntime", "first_stage_order"]

QueryRuntime = Literal["fp32", "bf16", "onnx", "openvino"]


@dataclass
class InferenceSettings:
    """How CFRAG runs at inference, for serving latency (the candidates and training never change);
    the defaults are the paper's: every candidate reranked, in fp32. Fields as `CFRAG`'s arguments
    of the same names."""

    rerank_top: int | None = None
    first_cut: str | None = None
    reranker_runtime: Runtime = "fp32"
    query_runtime: QueryRuntime = "fp32"
    cache_doc_tokens: bool = False

    def __post_init__(self) -> None:
        if self.rerank_top is not None and self.rerank_top < 1:
            raise ValueError(
                f"rerank_top must be a positive number of candidates or None (all), got "
                f"{self.rerank_top}"
            )
        if self.reranker_runtime not in RUNTIMES:
            raise ValueError(f"reranker_runtime must be one of {', '.join(RUNTIMES)}, got {self.reranker_runtime!r}")
        if self.query_runtime not in QUERY_RUNTIMES:
            raise ValueError(f"query_runtime must be one of {', '.join(QUERY_RUNTIMES)}, got {self.query_runtime!r}")

    def cache_key(self) -> dict:
        """The settings that change what is retrieved and differ from the paper's defaults. Only
        those: a row that uses none keeps the key it had before these settings existed.
        `cache_doc_tokens` is never in it: the same pairs, token for token."""
        paper = InferenceSettings()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "cache_doc_tokens" and getattr(self, f.name) != getattr(paper, f.name)}


def first_stage_order(docs: list[RetrievedDoc]) -> list[int]:
    """Candidate positions by first-stage score, best first (ties in candidate order)."""
    return np.argsort([-d.retriever_score for d in docs], kind="stable").tolist()
