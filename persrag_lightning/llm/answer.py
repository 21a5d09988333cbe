"""What an LLM reader needs of a task (reading/llm.py is the one path from retrieved docs to an
answer): the Table 4 prompts fitted to a budget, the labels `choose` ranks, and the official
post-processing of generated answers.

`generate` is the paper's setting (greedy answer, then the official LaMP evaluation's strip). A
135M-parameter LLM often answers a label prompt with prose or an unlisted tag, which the official
metric scores as wrong whatever was retrieved; `choose` ranks the task's allowed labels by
likelihood instead, so differences between retrieval strategies show. The lenient extraction (label
mentioned in prose, first 1-5 digit, JSON field) stays available under its own name so that no table
silently mixes the two.
"""

from __future__ import annotations

from typing import Literal, get_args

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import get_task
from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.prompts import build_prompt

__all__ = ["ANSWER_MODES", "POSTPROCESSING", "AnswerMode", "Postprocessing", "allowed_labels",
           "build_prompts", "official_postprocess"]

AnswerMode = Literal["generate", "choose"]
Postprocessing = Literal["official", "lenient"]
ANSWER_MODES: tuple[str, ...] = get_args(AnswerMode)
POSTPROCESSING: tuple[str, ...] = get_args(Postprocessing)


def build_prompts(task: str, llm: LLM, inputs: list[str], docs: list[list[HistoryDoc]],
                  max_prompt_tokens: int, profile_gamma: float | None = None) -> list[str]:
    """One Table 4 prompt per input with its docs, fitted to `max_prompt_tokens` of the LLM's
    tokenizer: the one prompt path of evaluation, serving and the generator stage. `profile_gamma`:
    ClusterRAG's Eq. 3 budget (a strategy's `prompt_gamma`); None: CFRAG's even split."""
    return [build_prompt(task, text, ds, llm.count_tokens, max_prompt_tokens, profile_gamma=profile_gamma)
            for text, ds in zip(inputs, docs)]


def allowed_labels(task: str) -> tuple[str, ...]:
    """The labels `choose` ranks: LaMP-1 `[1]`/`[2]`, LaMP-2's 15 tags, LaMP-3 `1`..`5`; a
    ValueError otherwise."""
    spec = get_task(task)
    if not spec.labels:
        raise ValueError(
            f"answer_mode 'choose' needs a label task (LaMP-1, LaMP-2, LaMP-3); {spec.name} is a "
            "generation task, use answer_mode 'generate'"
        )
    return spec.labels


def official_postprocess(task: str, text: str) -> str:
    """The official LaMP evaluation's treatment of an answer: strip surrounding whitespace, nothing
    else.

    Note that the Table 4 prompts of LaMP-4/5/7 ask for `{"title": ...}`; under `official` such an
    answer is scored as written (the JSON wrapper included), as the official scripts would;
    `lenient` unwraps it.
    """
    get_task(task)  # an unknown task is an error here too, not a silent pass-through
    return (text or "").strip()
