"""The one door for reading: a question and the docs retrieved for it become label scores, then an
answer.

Evaluation, feedback labels, the generator's validation and serving all read through a `Reader`: the
LLM reader (`reading/llm.py`: the Table 4 prompt, every label scored by the LLM, calibrated) or a
trained reader (`reading/trained.py`: a classifier over the question and the docs with their
labels). A reader of a generation task (LaMP-4/5/7) answers with text; only the LLM reader can.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.reading.label_reading import LabelReading

__all__ = ["Docs", "Reader"]

Docs = Sequence[Sequence[HistoryDoc]]  # the docs of each question, in rank order


class Reader(ABC):
    """Reads questions with their retrieved docs: `read` gives every label's score (label tasks),
    `answer` the answers the evaluation scores, `score_targets` log p(target) (what a feedback label
    of metric `loglik` is)."""

    kind: str = "abstract"

    @abstractmethod
    def identity(self) -> dict:
        """What changes this reader's scores and answers, for cache keys (model digests, reading
        settings)."""

    @abstractmethod
    def read(self, task: str, inputs: Sequence[str], docs: Docs, *, prompt_gamma: float | None = None,
             phase: str | None = None, every_calibration: bool = False) -> LabelReading:
        """Every allowed label's log-score for each question (`inputs[i]` read with `docs[i]`), and
        the answers under the reader's calibration and decision; `every_calibration` also computes
        the terms of the calibrations it knows, so the reading can be re-read under each
        (`LabelReading.under`). A named `phase` prints progress."""

    def answer(self, task: str, inputs: Sequence[str], docs: Docs, *, prompt_gamma: float | None = None,
               phase: str | None = None) -> list[str]:
        """The answers the task's metric scores: the decided label of `read` (label tasks)."""
        return self.read(task, inputs, docs, prompt_gamma=prompt_gamma, phase=phase).answers

    @abstractmethod
    def score_targets(self, task: str, inputs: Sequence[str], docs: Docs, targets: Sequence[str], *,
                      phase: str | None = None) -> list[float]:
        """log p(target | question, docs) per question."""

    @abstractmethod
    def prompts(self, task: str, inputs: Sequence[str], docs: Docs, *,
                prompt_gamma: float | None = None) -> list[str]:
        """What the reader reads of each question, as text (serving shows it as the answer's
        provenance)."""

    def reading(self, task: str) -> dict:
        """How label scores become answers for `task` (calibration, decision); empty for a reader
        that generates. Part of the evaluation's cache key beside `identity`."""
        return {}

    @property
    def reads_labels(self) -> bool:
        """Whether `read` applies (answers are decided labels, not generated text)."""
        return True

    def describe(self, task: str) -> str:
        """How this reader answers, as a table's header names it."""
        return self.kind

    def use_text_runtime(self, runtime: str, cache_dir: str | None = None) -> None:
        """Embed the texts this reader embeds itself in `runtime` (fp32, or an exported runtime:
        serving's for its query encoder), the export cached under `cache_dir`; no-op for a reader
        that embeds none (the LLM reads tokens)."""

    def prepare_docs(self, task: str, docs: Sequence[HistoryDoc], cache_dir: str | None = None) -> int:
        """Do now what reading `docs` will need, so no question waits for it (a trained reader:
        their text vectors, cached under `cache_dir`); returns how many doc texts were prepared.
        Nothing for a reader that prepares nothing (the LLM reads tokens)."""
        return 0

    def forget_docs(self, task: str, docs: Sequence[HistoryDoc]) -> None:
        """Drop what this reader keeps of `docs` and of the questions it read (a deleted user's);
        nothing for a reader that keeps nothing."""

    def close(self) -> None:
        """Release what the reader holds (a loaded model)."""
