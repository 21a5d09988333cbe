"""A chat turn shaped as OpenAI's chat.completion object, plus `provenance` (moved out of
serving/service.py: the shape of an answer, not the service's logic)."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from persrag_lightning.retrieval.base import RetrievedDoc

__all__ = ["ChatTurn", "chat_completion"]


@dataclass
class ChatTurn:
    """One answered chat turn, before it is shaped as OpenAI's chat.completion.

    Args:
        answer: the LLM's answer (a canned line without an LLM).
        prompt: the prompt it answered.
        docs: the CFRAG docs in the prompt (the caller's and shared ones of similar users).
        memories: the caller's memories in the prompt.
        stored_memory_id: the memory this turn stored, if any.
        session_id: the session the turn is logged under.
        model: the model name the request asked for (None: the server's).
        usage: the prompt's and the answer's tokens, counted by the LLM's tokenizer (the prompt before
            the chat template; words without an LLM); None: counted as words here.
    """

    answer: str
    prompt: str
    docs: list[RetrievedDoc]
    memories: list[RetrievedDoc]
    stored_memory_id: str | None
    session_id: str
    model: str | None = None
    usage: tuple[int, int] | None = None


def chat_completion(turn: ChatTurn, model: str, user_id: str) -> dict:
    """The OpenAI chat.completion object, plus `provenance`: the user's own docs, other users' (with
    their owner and similarity), the memories used and the memory stored.

    Args:
        turn: the answered turn.
        model: the model name written in the object.
        user_id: the caller, whose docs are `own_docs`.
    """
    own = [d for d in turn.docs if d.owner == user_id]
    others = [d for d in turn.docs if d.owner != user_id]
    prompt_tokens, completion_tokens = turn.usage or (len(turn.prompt.split()), len(turn.answer.split()))
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": turn.answer},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "session_id": turn.session_id,
        "provenance": {
            "own_docs": [_doc(d) for d in own],
            "other_users_docs": [{**_doc(d), "owner": d.owner, "user_similarity": d.user_sim} for d in others],
            "memories_used": [{"id": m.doc_id, "text": m.text, "score": m.retriever_score} for m in turn.memories],
            "memory_stored": turn.stored_memory_id,
        },
    }


def _doc(d: RetrievedDoc) -> dict:
    return {"doc_id": d.doc_id, "text": d.text, "retriever_score": _num(d.retriever_score),
            "reranker_score": _num(d.reranker_score)}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)  # NaN (a stage not run) → null in JSON
