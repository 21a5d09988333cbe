"""The answers batcher's function (`ChatService.answering`, `persrag serve --answers_max_batch`): the
label questions that arrive together (POST /v1/answers) retrieved in one call, each list through the
privacy guard, then read in one call, under the model lock from retrieval to answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from persrag_lightning.retrieval.base import RetrievedDoc
    from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline, Generation
    from persrag_lightning.serving.model_lock import ModelLock

__all__ = ["answer_batch"]

Asks = list[tuple[str, str]]


def answer_batch(pipeline: CFRAGPipeline, model_lock: ModelLock,
                 guarded_docs: Callable[[Asks], list[list[RetrievedDoc]]],
                 asks: Asks) -> list[tuple[list[RetrievedDoc], Generation]]:
    """Each (user, question)'s docs and the reader's answer, the batch's in one retrieval and one
    reading call.

    Args:
        pipeline: the served pipeline (its reader).
        model_lock: the lock every model call takes, held from the batch's retrieval to its answers.
        guarded_docs: the docs of each (user, question), through the privacy guard
            (`ChatService.guarded_docs`; the caller holds the model lock).
        asks: (user, question) of each request of the batch.
    """
    with model_lock:
        found = guarded_docs(asks)  # the privacy guard, before anything is read
        answers = pipeline.read([u for u, _ in asks], [q for _, q in asks], found)
    return list(zip(found, answers, strict=True))
