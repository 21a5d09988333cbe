"""The one path from retrieved docs to an answer: Table 4 prompt → LLM → post-processed answer. Evaluation and
serving both call it, so an answer in a results table is the answer the service would give."""

from __future__ import annotations

from dataclasses import dataclass

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.postprocess import default_max_new_tokens, postprocess
from persrag_lightning.llm.prompts import build_prompt


@dataclass(frozen=True)
class Answer:
    """A post-processed answer, the raw LLM output and the prompt that produced it."""

    answer: str
    raw_output: str
    prompt: str


def build_prompts(task: str, llm: LLM, inputs: list[str], docs: list[list[HistoryDoc]],
                  max_prompt_tokens: int) -> list[str]:
    """One Table 4 prompt per input with its docs, fitted to `max_prompt_tokens` of the LLM's tokenizer."""
    return [build_prompt(task, text, ds, llm.count_tokens, max_prompt_tokens) for text, ds in zip(inputs, docs)]


def answer(llm: LLM, task: str, inputs: list[str], docs: list[list[HistoryDoc]], max_prompt_tokens: int,
           max_new_tokens: int | None = None) -> list[Answer]:
    """Greedy generation (the paper's) with the task's short budget unless one is given, then post-processing."""
    prompts = build_prompts(task, llm, inputs, docs, max_prompt_tokens)
    outputs = llm.generate(prompts, max_new_tokens or default_max_new_tokens(task))
    return [Answer(postprocess(task, o), o, p) for o, p in zip(outputs, prompts)]
