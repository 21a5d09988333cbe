"""A chat turn's answer: its prompt (the caller's memories and CFRAG docs, marked as data, and the
conversation) and the LLM's reply, with the tokens of each. Concurrent chats' replies share the
model's steps instead of queueing for them: by default each joins the replies in flight between two
tokens (continuous batching, serving/continuous.py); `--llm_batching batches` generates the replies
of chats that arrive together in one call (`MicroBatcher` over the LLM's left-padded generation).
"""

from __future__ import annotations

from persrag_lightning.retrieval.base import RetrievedDoc
from persrag_lightning.serving.batcher import REPLY_BATCHING, Batching, MicroBatcher
from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline
from persrag_lightning.serving.continuous import ContinuousReplies
from persrag_lightning.serving.model_lock import ModelLock
from persrag_lightning.serving.prompt import build_serving_prompt

__all__ = ["Answer", "ChatAnswerer"]

NO_LLM_BUDGET = 512  # the prompt's words without an LLM (it is shown, never generated from)
Answer = tuple[str, str, tuple[int, int]]  # (prompt, reply, (the prompt's tokens, the reply's))


def _words(text: str) -> int:
    return len(text.split())


class ChatAnswerer:
    """Prompts and replies for the chat service.

    Args:
        pipeline: the served pipeline (its LLM and LLM settings).
        use_llm: False: a canned reply naming what was found (`persrag serve --no_llm`).
        lock: the service's model lock, held while the LLM or its tokenizer runs.
        batching: how concurrent chats' replies are batched (default REPLY_BATCHING, continuous;
            max_batch 1: each alone, in the request's thread).
    """

    def __init__(self, pipeline: CFRAGPipeline, use_llm: bool, lock: ModelLock,
                 batching: Batching | None = None) -> None:
        self.pipeline, self.use_llm, self._lock = pipeline, use_llm, lock
        batching = batching or REPLY_BATCHING
        self.generation: ContinuousReplies | MicroBatcher
        if use_llm and batching.max_batch > 1 and getattr(batching, "continuous", False):
            self.generation = ContinuousReplies(lambda: pipeline.llm, lock, pipeline.llm_config.chat_budget,
                                                batching.max_batch, self._reply_many)
        else:
            self.generation = MicroBatcher(self._reply_many, batching, name="persrag-generation")

    def __call__(self, message: str, memories: list[RetrievedDoc], docs: list[RetrievedDoc],
                 history: list[tuple[str, str]]) -> Answer:
        """The prompt, the reply and the tokens of each (the LLM's tokenizer; words without an LLM).
        The caller must not hold the model lock: a batched reply is generated in the batcher's thread."""
        texts = ([m.text for m in memories], [d.text for d in docs])
        if not self.use_llm:
            prompt = build_serving_prompt(message, *texts, history, _words, NO_LLM_BUDGET)
            reply = f"(no LLM) I remember {len(memories)} thing(s) about you and found {len(docs)} related item(s)."
            return prompt, reply, (_words(prompt), _words(reply))
        with self._lock:  # the tokenizer is the LLM's: not used while it generates
            llm = self.pipeline.llm
            prompt = build_serving_prompt(message, *texts, history, llm.count_tokens,
                                          self.pipeline.llm_config.max_prompt_tokens)
        reply, usage = self.generation(prompt)
        return prompt, reply, usage

    def _reply_many(self, prompts: list[str]) -> list[tuple[str, tuple[int, int]]]:
        """The LLM's replies to `prompts` in one call, with the tokens of each prompt (before the chat
        template) and reply (the micro-batcher's function)."""
        with self._lock:
            llm = self.pipeline.llm
            replies = self.pipeline.llm_config.chat(llm, prompts)
            return [(r, (llm.count_tokens(p), llm.count_tokens(r))) for p, r in zip(prompts, replies)]

    def close(self) -> None:
        """Stop the batcher (replies queued are generated first)."""
        self.generation.close()
