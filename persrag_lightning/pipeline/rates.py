"""The rates a pipeline's estimate divides its work by, measured on this machine at the start of the
run (so a loaded machine's estimate says so): the reader LLM's answers and labels per second, and the
texts per second the trained reader's frozen encoder embeds (the rate of the trained reader, of the
encoder stages and of retrieval). The two rates do not move together from one CPU class to the next,
so neither stands in for the other.
"""

from __future__ import annotations

import random
import time
from functools import lru_cache
from typing import TYPE_CHECKING

from persrag_lightning.data.tasks import get_task
from persrag_lightning.llm.auto import PROBE_VOCABULARY
from persrag_lightning.pipeline.constants import BUDGET_MINUTES

if TYPE_CHECKING:
    from jsonargparse import Namespace

__all__ = ["budget_minutes", "encoder_rate", "evaluation_llm_settings", "reader_dtype", "reader_rates"]

PROBE_PROMPTS = 8   # prompts timed, after one untimed warm-up
PROBE_DOCS = 5      # history docs in a probe prompt: the main job's k
PROBE_DOC_WORDS = 40


def _probe_prompts(labels: tuple[str, ...], docs: int) -> list[str]:
    """PROBE_PROMPTS prompts of a main-job size: `docs` history docs (k for an answer, one for a
    feedback label), the task's labels, the question.

    Args:
        labels: the task's labels, listed in each prompt.
        docs: history docs per prompt.
    """
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(PROBE_VOCABULARY) for _ in range(n))

    history = " ".join(f"[{i + 1}] {words(PROBE_DOC_WORDS)}" for i in range(docs))
    listed = ", ".join(labels)
    return [f"Here are some of the user's past items: {history}. Which label fits among [{listed}]? {words(40)}"
            for _ in range(PROBE_PROMPTS)]


@lru_cache(maxsize=8)
def reader_rates(labels: tuple[str, ...], model: str, dtype: str, batch_size: int) -> dict[str, float]:
    """The reader's answers per second (a prompt with k docs, every label of the task scored) and
    labels per second (one doc, one target) on this machine now: measured at the start of each run,
    so a loaded machine's estimate says so.

    Args:
        labels: the task's labels, every one scored per answer.
        model: the reader's LLM (a name or a local folder).
        dtype: the dtype it reads in (`reader_dtype`).
        batch_size: prompts per forward, as the evaluation's.
    """
    from persrag_lightning.llm.registry import load_llm

    answer_prompts, label_prompts = _probe_prompts(labels, PROBE_DOCS), _probe_prompts(labels, 1)
    labels = list(labels or ("yes", "no"))
    llm = load_llm("hf", model, batch_size=batch_size, dtype=dtype)
    try:
        # warm-up: first-call allocations and kernel choices
        llm.score_options(answer_prompts[:1], labels)
        started = time.perf_counter()
        llm.score_options(answer_prompts, labels)
        answers = len(answer_prompts) / (time.perf_counter() - started)
        started = time.perf_counter()
        llm.score(label_prompts, labels[:1] * len(label_prompts))
        one = len(label_prompts) / (time.perf_counter() - started)
    finally:
        llm.close()
    return {"answers": answers, "labels": one}


@lru_cache(maxsize=4)
def encoder_rate(encoder: str = "minilm") -> float:
    """Texts per second the trained reader's frozen encoder embeds here now (PROBE_PROMPTS
    question-sized texts): the rate of the trained reader, of the encoder stages and of retrieval.

    Args:
        encoder: the trained reader's frozen text encoder (a short name or a folder).
    """
    from persrag_lightning.models.text_encoder import TextEncoder

    texts = [p[-300:] for p in _probe_prompts(get_task("LaMP-2").labels, 1)] * 4
    model = TextEncoder.from_pretrained(encoder)
    model.encode(texts[:2])  # warm-up
    started = time.perf_counter()
    model.encode(texts)
    return len(texts) / (time.perf_counter() - started)


def evaluation_llm_settings(evaluation: Namespace) -> dict:
    """The evaluation's LLM settings, from its resolved configuration (`Runner.evaluation_config`: the
    config file's under the preset's and the command line's overrides).

    Args:
        evaluation: the evaluation's resolved configuration.
    """
    llm = evaluation.evaluation.init_args.get("llm")
    return {} if llm is None else llm.as_dict()


def reader_dtype(llm: dict) -> str:
    """The dtype the evaluation's hf reader runs in here (`bf16_if_native` resolved by
    hardware.uses_bf16).

    Args:
        llm: the evaluation's resolved LLM settings (`evaluation_llm_settings`).
    """
    from persrag_lightning.llm.hf_device import resolve_device_dtype

    options = llm.get("options") or {}
    dtype = resolve_device_dtype(options.get("device", "auto"), options.get("dtype", "auto"))[1]
    return str(dtype).removeprefix("torch.")


def budget_minutes() -> int | None:
    """BUDGET_MINUTES of this machine's CPU class; None on a GPU."""
    import torch

    from persrag_lightning.hardware import cpu_flags, cpu_has_native_bf16

    if torch.cuda.is_available():
        return None
    if "amx_bf16" in (cpu_flags() or ()):
        return BUDGET_MINUTES["amx"]
    return BUDGET_MINUTES["bf16" if cpu_has_native_bf16() else "float32"]
