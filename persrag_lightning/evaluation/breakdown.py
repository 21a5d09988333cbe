"""Where the reference wins and where it loses: its metric against chosen rows, by how much of their
own history the asking users have.

Collaborative retrieval rests on a premise that a whole-table difference cannot check: neighbours'
docs should help most where the asker's own history says least. The questions are cut into equal
thirds (`groups`) by the size of the asker's visible history (the profile the history rules let the
question see); in each, the reference and each compared row get the task's primary metric, and the
reference's difference from the row its paired approximate-randomisation test (the table's test, on
that third's questions). A third holds a third of the table's questions, so its intervals are about
1.7 times as wide: the breakdown names where a difference lives, it does not make one significant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.report import ALPHA, MARKER
from persrag_lightning.evaluation.stats import Comparison, LampMetricFn, compare, metric_names

__all__ = ["Stratum", "breakdown", "breakdown_table"]


@dataclass(frozen=True)
class Stratum:
    """One group of questions by the asker's visible history size: its range of sizes, its
    questions, each row's metric on them and the reference's paired tests against each row."""

    low: int
    high: int
    n: int
    scores: dict[str, float]
    tests: dict[str, Comparison]  # row → the reference against it (difference: reference − row)

    def to_json(self) -> dict:
        return {"history": [self.low, self.high], "questions": self.n, "scores": self.scores,
                "difference": {r: c.difference for r, c in self.tests.items()},
                "p_values": {r: c.p_value for r, c in self.tests.items()}}


def history_groups(sizes: Sequence[int], groups: int) -> list[np.ndarray]:
    """The questions' indices in `groups` equal parts by history size, smallest first (ties keep the
    questions' order, so a size can straddle two parts)."""
    order = np.argsort(np.asarray(sizes), kind="stable")
    return [part for part in np.array_split(order, groups) if len(part)]


def breakdown(task: str, predictions: Mapping[str, Sequence[str]], golds: Sequence[str], sizes: Sequence[int],
               reference: str, rows: Sequence[str], groups: int = 3, n_resamples: int = 1000,
               seed: int = 0) -> list[Stratum]:
    """The reference and `rows` on each part of the questions by the asker's history size.

    Args:
        task: the LaMP task (its primary metric is compared).
        predictions: each row's answers, in the questions' order.
        golds: the questions' golds.
        sizes: each question's visible history size (its profile's docs).
        reference: the row every other is tested against.
        rows: the rows compared with it (those absent from `predictions` are left out).
        groups: how many parts.
        n_resamples: the paired test's swaps.
        seed: the test's seed (shared: common random numbers across parts and rows).
    """
    compared = [r for r in dict.fromkeys(rows) if r in predictions and r != reference]
    if reference not in predictions or not compared:
        return []
    metric = metric_names(task)[0]
    fn = LampMetricFn(task, metric)
    out = []
    for part in history_groups(sizes, groups):
        gold = [golds[i] for i in part]
        answers = {r: [predictions[r][i] for i in part] for r in [reference, *compared]}
        scores = {r: float(fn(a, gold)) for r, a in answers.items()}
        tests = {r: compare(fn, reference, answers[reference], r, answers[r], gold, metric, n_resamples, seed)
                 for r in compared}
        out.append(Stratum(int(sizes[part[0]]), int(sizes[part[-1]]), len(part), scores, tests))
    return out


def breakdown_table(task: str, strata: Sequence[Stratum], reference: str) -> str:
    """The breakdown as Markdown: a row per part, the reference's metric, then per compared row its
    metric and the reference's difference with the paired p."""
    if not strata:
        return ""
    metric = metric_names(task)[0]
    rows = list(strata[0].tests)
    header = ["asker's visible history (docs)", "questions", reference]
    for r in rows:
        header += [r, f"Δ vs {r} (p)"]
    sign = "" if LampMetricFn(task, metric).higher_is_better else f", so with {metric} Δ > 0 is the reference's loss"
    title = (f"By the asker's visible history ({get_task(task).name} {metric}, the questions in {len(strata)} equal "
             f"parts by their profile's size; Δ = {reference} − row{sign}; paired test per part, {MARKER} p < {ALPHA}):")
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in strata:
        cells = [f"{s.low}–{s.high}", str(s.n), f"{s.scores[reference]:.3f}"]
        for r in rows:
            c = s.tests[r]
            mark = f" {MARKER}" if c.significant(ALPHA) else ""
            cells += [f"{s.scores[r]:.3f}", f"{c.difference:+.3f} ({c.p_value:.3f}{mark})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
