"""Answers that need no LLM, as rows of every label-task table, and the alarm for a reader that does
not read.

Retrieval, user similarity and reranking reach a score only through the reader's answer; these rows
say what the same questions score without it, so a table shows whether a method's number comes from
what it retrieved or from the reader's label prior:

- `majority label (train)`: the train split's most frequent gold label, for every question;
- `user's own majority` / `user's own median`: the most frequent / the median label of the
  question's visible profile (the history rules' own docs; the train majority when the profile has
  no label);
- `<row> docs' vote`: the majority (median, on an ordered task) of the labels of the docs a row put
  in the prompt.

Every row also reports the share of its most frequent answer; a row that answers one label far more
often than the golds do is named under the table (`collapse_warnings`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from persrag_lightning.data.records import Example
from persrag_lightning.data.tasks import TaskSpec, get_task
from persrag_lightning.reading.label_reading import LabelReading
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc

__all__ = ["collapse_warnings", "doc_labels", "reader_free_rows", "reading_diagnostics",
           "top_answer", "vote"]

MAJORITY = "majority label (train)"
OWN_MAJORITY = "user's own majority"
OWN_MEDIAN = "user's own median"
VOTE_SUFFIX = " docs' vote"
# a row "collapses" when one label is more than this share of its answers and more than the golds'
# own most frequent share plus COLLAPSE_MARGIN: a reader answering by prior, not by prompt
COLLAPSE_SHARE = 0.8
COLLAPSE_MARGIN = 0.2


def majority(labels: Sequence[str], order: Sequence[str]) -> str:
    """The most frequent label (ties: the earlier in `order`, the task's label list); "" for no
    labels.

    Args:
        labels: the labels to vote with.
        order: the task's label list, which breaks ties.
    """
    counts = Counter(label for label in labels if label)
    if not counts:
        return ""
    return max(counts, key=lambda label: (counts[label], -_index(order, label)))


def median_label(labels: Sequence[str], order: Sequence[str]) -> str:
    """The lower median of ordered labels (LaMP-3's scores): the label an MAE-minimising reader
    would answer.

    Args:
        labels: the labels.
        order: the task's ordered label list.
    """
    ranked = sorted((label for label in labels if label), key=lambda label: _index(order, label))
    return ranked[(len(ranked) - 1) // 2] if ranked else ""


def _index(order: Sequence[str], label: str) -> int:
    return order.index(label) if label in order else len(order)


def doc_labels(spec: TaskSpec, store: DocStore, rows: Sequence[int]) -> list[str]:
    """The labels (the task's label field, normalised to the label list) of corpus rows; unlabelled
    docs drop.

    Args:
        spec: the task's spec (label field, label list).
        store: the corpus.
        rows: the corpus rows.
    """
    labels = spec.labels or ()
    return [
        labels[i - 1] for i in (spec.doc_label(store.history_doc(int(r))) for r in rows) if i > 0
    ]


def vote(spec: TaskSpec, labels: Sequence[str]) -> str:
    """What retrieved docs say, their labels in rank order: the median on an ordered task, else the
    majority (ties: the better-ranked doc's label).

    Args:
        spec: the task's spec; an ordered task votes by median.
        labels: the retrieved docs' labels, best-ranked first.
    """
    if spec.kind == "regression":
        return median_label(labels, spec.labels or ())
    return majority(labels, labels)


def reader_free_rows(task: str, store: DocStore, examples: list[Example], train_golds: Sequence[str],
                     retrieved: dict[str, list[list[RetrievedDoc]]]) -> dict[str, list[str]]:
    """Answers of every reader-free row for `examples` (in order); `retrieved`: the docs of each row
    to vote for by name. Empty for a generation task."""
    spec = get_task(task)
    if spec.labels is None:
        return {}
    fallback = majority(train_golds, spec.labels) or spec.labels[0]
    rows = {MAJORITY: [fallback] * len(examples)}
    if spec.label_field is not None:  # LaMP-1's profile holds papers, not labels
        own = [doc_labels(spec, store, store.rows(e.user_id, query=Query(e.user_id, e.query, e.input,
                                                                          e.example_id))) for e in examples]
        rows[OWN_MAJORITY] = [majority(ls, spec.labels) or fallback for ls in own]
        if spec.kind == "regression":
            rows[OWN_MEDIAN] = [median_label(ls, spec.labels) or fallback for ls in own]
        for name, docs in retrieved.items():
            rows[name + VOTE_SUFFIX] = [
                vote(spec, doc_labels(spec, store, [d.row for d in ds if d.row >= 0])) or fallback
                for ds in docs
            ]
    return rows


def top_answer(answers: Sequence[str]) -> tuple[str, float]:
    """The most frequent answer of a row and its share of the row's answers."""
    if not answers:
        return "", 0.0
    label, count = Counter(answers).most_common(1)[0]
    return label, count / len(answers)


def collapse_warnings(predictions: dict[str, Sequence[str]], golds: Sequence[str]) -> list[str]:
    """One line per row (pass the LLM's rows) that answers one label for more than COLLAPSE_SHARE of
    its questions and more than the golds' own most frequent share + COLLAPSE_MARGIN: what a
    constant reader looks like."""
    gold_label, gold_share = top_answer(golds)
    lines = []
    for name, answers in predictions.items():
        label, share = top_answer(answers)
        if share > COLLAPSE_SHARE and share > gold_share + COLLAPSE_MARGIN:
            lines.append(f"Warning: {name} answers {label!r} to {share:.0%} of the questions (the golds' most "
                         f"frequent label, {gold_label!r}, is {gold_share:.0%}): its score reflects the reader's "
                         "label prior, not what it read.")
    return lines


def reading_diagnostics(reading: LabelReading, golds: Sequence[str | None]) -> dict[str, float]:
    """What a reader's label distributions say of the golds beyond its answers: on ordered labels
    (LaMP-3), the Spearman correlation of the expected label value (under the reading's calibration)
    with the gold, which is 0 for a reader that ignores its prompt however its answers are decided;
    nothing on unordered labels."""
    spec = get_task(reading.task)
    pairs = [(sum(float(label) * p for label, p in zip(reading.labels, probs)), float(gold))
             for probs, gold in zip(reading.probabilities, golds) if gold is not None
             and spec.label_index(gold) is not None] if spec.kind == "regression" else []
    if len(pairs) < 3 or len({e for e, _ in pairs}) < 2 or len({g for _, g in pairs}) < 2:
        return {}
    from scipy.stats import spearmanr

    return {"expected_label_spearman": float(spearmanr(*zip(*pairs)).statistic)}
