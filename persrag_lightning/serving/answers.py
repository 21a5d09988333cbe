"""POST /v1/answers: a question of the run's task answered as the run's table answers it: the caller's
CFRAG docs (privacy-checked as a chat turn's), then the pipeline's reader (the trained reader or the
LLM, by the decision rule and calibration `pipeline.serves` names: the run's record by default), with
the docs' provenance. Questions that arrive together are retrieved in one call and read in one call
(serving/answer_batch.py, under `persrag serve --answers_max_batch`). Nothing is stored: no memory,
no session."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from persrag_lightning.reading import LLM_READER
from persrag_lightning.serving.accounts import Caller
from persrag_lightning.serving.requests import Question
from persrag_lightning.serving.validation import ServiceError, parse

if TYPE_CHECKING:
    from persrag_lightning.serving.service import ChatService

__all__ = ["answer_question"]


def answer_question(service: ChatService, caller: Caller, body: Mapping | Question) -> dict:
    """The pipeline reader's answer to the caller's question (the body: requests.Question), what it
    read, the docs with their owners and scores, and what the pipeline serves.

    Args:
        service: the chat service (its pipeline, model lock, per-user gate and privacy guard).
        caller: who asks; a user's token (the admin has no docs to read).
        body: the request body.
    """
    if caller.user_id is None:
        raise ServiceError(403, "answers need a user's token (the admin token has no user)")
    question = parse(Question, body).input
    pipe = service.pipeline
    if pipe.reader_spec == LLM_READER and not service.use_llm:
        raise ServiceError(409, "this server runs without an LLM (--no_llm) and its reader is the LLM; serve "
                                "the run's trained reader (--reader reader) to answer without one")
    user_id = caller.user_id
    with service._acting_on(caller, user_id):
        # batched with the questions that arrive with it (`persrag serve --answers_max_batch`)
        docs, answer = service.answering((user_id, question))
    return {"answer": answer.answer, "read": answer.prompt, "serves": pipe.serves,
            "docs": [{"doc_id": d.doc_id, "owner": d.owner, "text": d.text, "user_similarity": d.user_sim,
                      "retriever_score": _num(d.retriever_score), "reranker_score": _num(d.reranker_score)}
                     for d in docs]}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)  # NaN (a stage not run) → null in JSON
