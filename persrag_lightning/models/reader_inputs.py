"""What the trained reader reads (plain torch, no Lightning): a question and its docs as the reader
takes them (each doc's text without its label, the label, whose doc it is, its author's label habit,
and the asker's habit), and the same questions as tensors (`ReaderBatch`) for models/reader.py's
`LabelReader`. The evaluation, the feedback labels, serving and the reader's own training data all
build them here, so no field is dropped on the way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from persrag_lightning.data.records import HistoryDoc, ReadDoc
from persrag_lightning.data.tasks import TaskSpec, get_task

__all__ = ["ReaderBatch", "ReaderDoc", "ReaderQuestion", "batch_from_vectors", "doc_text", "habit_features",
           "question_text", "reader_doc", "reader_inputs"]

MAX_HABIT = 100  # a habit's size is read on a log scale up to the 100 docs a history keeps


class ReadingSettings(Protocol):
    """What `reader_inputs` reads of a reader's configuration (models/reader.ReaderConfig has it):
    named here, so this module needs nothing from the model's."""

    task: str
    max_docs: int


def question_text(spec: TaskSpec, text: str) -> str:
    """What the reader reads of a question: the query the task extracts (the review, the
    description), or the whole input where the labels name parts of it (LaMP-1's two references)."""
    return spec.extract_query(text) if spec.label_field is not None else text.strip()


def doc_text(spec: TaskSpec, doc: HistoryDoc) -> str:
    """A doc's text without its label (the label is read as a label, not as words)."""
    return " ".join(str(doc.fields[f]) for f in spec.profile_fields if f != spec.label_field and doc.fields.get(f))


@dataclass(frozen=True)
class ReaderDoc:
    """What the reader reads of one doc: its text, its label (index + 1; 0: none) and its
    provenance (data/records.ReadDoc): the asker's own or not, the user similarity and its
    author's label counts."""

    text: str
    label: int
    own: bool = True
    user_sim: float = 1.0
    habit: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReaderQuestion:
    """What the reader reads of one question: its text, its docs in rank order and the asking
    user's label counts over their visible history (its prior)."""

    text: str
    docs: tuple[ReaderDoc, ...]
    habit: tuple[int, ...] = ()


def reader_doc(spec: TaskSpec, doc: HistoryDoc) -> ReaderDoc:
    """A doc as the reader reads it; a doc without provenance (a plain `HistoryDoc`) reads as
    the asker's own, of an unknown habit."""
    if isinstance(doc, ReadDoc):
        return ReaderDoc(doc_text(spec, doc), spec.doc_label(doc), doc.own, doc.user_sim, doc.owner_labels)
    return ReaderDoc(doc_text(spec, doc), spec.doc_label(doc))


def reader_inputs(config: ReadingSettings, inputs: Sequence[str],
                  docs: Sequence[Sequence[HistoryDoc]]) -> list[ReaderQuestion]:
    """Each question as the reader reads it: its text, its first `max_docs` docs with their labels
    and provenance, and the asker's label habit (where the docs come as `ReadDocs`)."""
    spec = get_task(config.task)
    return [ReaderQuestion(question_text(spec, text), tuple(reader_doc(spec, d) for d in list(ds)[:config.max_docs]),
                           tuple(getattr(ds, "asker_labels", ())))
            for text, ds in zip(inputs, docs)]


def habit_features(counts: Sequence[int], n: int) -> list[float]:
    """A label habit as the reader reads it: the share of each label (Jeffreys-smoothed, so an
    empty history reads as uniform) and the history's size, log-scaled to about [0, 1]."""
    total = float(sum(counts)) if counts else 0.0
    shares = [(float(c) + 0.5) / (total + 0.5 * n) for c in counts] if counts else [1.0 / n] * n
    return [*shares, math.log1p(total) / math.log1p(MAX_HABIT)]


def doc_habit_features(doc: ReaderDoc, n_labels: int) -> list[float]:
    """A doc's author's habit (`habit_features`) and how surprising the doc's label is under it
    (0 for a doc without a label)."""
    habit = habit_features(doc.habit, n_labels)
    return [*habit, -math.log(habit[doc.label - 1]) if doc.label > 0 else 0.0]


@dataclass
class ReaderBatch:
    """A batch of questions as tensors: the question's vector and the asker's habit, the docs'
    vectors, labels (0: none), provenance and mask."""

    question: torch.Tensor  # [B, E]
    docs: torch.Tensor      # [B, K, E]
    labels: torch.Tensor    # [B, K] label index + 1, 0 = none
    mask: torch.Tensor      # [B, K] True where a doc is present
    prior: torch.Tensor | None = None        # [B, L + 1] the asker's habit_features
    own: torch.Tensor | None = None          # [B, K] 1 where the doc is the asker's own
    user_sim: torch.Tensor | None = None     # [B, K] the owner's similarity to the asker
    doc_habit: torch.Tensor | None = None    # [B, K, L + 2] the author's habit_features, the label's surprise
    question_states: torch.Tensor | None = None  # [B, T, E] the question's lower-layer token states (tuning)
    question_mask: torch.Tensor | None = None    # [B, T]

    def __len__(self) -> int:
        return len(self.question)


def batch_from_vectors(read: Sequence[ReaderQuestion], embed: Callable[[list[str]], torch.Tensor],
                       max_docs: int, dim: int, n_labels: int,
                       embed_questions: Callable[[list[str]], torch.Tensor] | None = None) -> ReaderBatch:
    """`reader_inputs` rows as a `ReaderBatch`, texts turned into vectors by `embed` (the reader's
    cache, or a training set's precomputed table).

    Args:
        read: the questions as the reader reads them.
        embed: texts → [N, dim] vectors.
        max_docs: docs read per question.
        dim: the vectors' width.
        n_labels: the task's labels (the width of a habit).
        embed_questions: question texts → vectors where they are not `embed`'s (a tuned tower).
    """
    n = len(read)
    k = max(1, min(max_docs, max((len(q.docs) for q in read), default=1)))
    questions = [q.text for q in read]
    texts = ([] if embed_questions else questions) + [d.text for q in read for d in q.docs[:k]]
    vectors = embed(texts)
    if embed_questions is not None:
        vectors = torch.cat([embed_questions(questions).reshape(n, dim), vectors.reshape(-1, dim)])
    docs, labels = torch.zeros(n, k, dim), torch.zeros(n, k, dtype=torch.long)
    mask, own = torch.zeros(n, k, dtype=torch.bool), torch.ones(n, k, dtype=torch.long)
    user_sim = torch.ones(n, k)
    doc_habit = torch.tensor([*habit_features((), n_labels), 0.0]).repeat(n, k, 1)
    prior = torch.tensor([habit_features(q.habit, n_labels) for q in read]) if n else torch.zeros(0, n_labels + 1)
    present = [(i, j, d) for i, q in enumerate(read) for j, d in enumerate(q.docs[:k])]
    if present:  # one scatter per field: a Python loop over single elements cost most of a training batch
        at = (torch.tensor([i for i, _, _ in present]), torch.tensor([j for _, j, _ in present]))
        docs[at], mask[at] = vectors[n:n + len(present)].to(docs.dtype), True
        labels[at] = torch.tensor([d.label for _, _, d in present])
        own[at] = torch.tensor([int(d.own) for _, _, d in present])
        user_sim[at] = torch.tensor([float(d.user_sim) for _, _, d in present])
        doc_habit[at] = torch.tensor([doc_habit_features(d, n_labels) for _, _, d in present])
    return ReaderBatch(vectors[:n], docs, labels, mask, prior, own, user_sim, doc_habit)
