"""Label answers as decisions: calibrated label scores and the decision rule of the task's metric.

`choose` scores every allowed label by the reader's log-probability. A small LLM's prior for one
label string can outweigh everything the prompt says (SmolLM2-135M answers "1" to every LaMP-3
review), so the scores are calibrated before a label is chosen:

- `contextual`: contextual calibration (Zhao et al., 2021, "Calibrate Before Use", Eq. 1 with W =
  diag(p_cf)^-1, b = 0): divide the label distribution by its average under content-free inputs
  ("N/A", "", "[MASK]") of the same template;
- `pmi`: domain-conditional PMI (Holtzman et al., 2021, "Surface Form Competition", Eq. 3): log p(y
  | prompt) minus log p(y | domain premise), the task's instruction alone.

Both terms depend on the template only, so they cost a few LLM calls per task, not one per prompt.
The answer is then the decision the metric rewards from the calibrated distribution: the arg max for
accuracy and F1, the median for MAE, the mean rounded to a label for RMSE.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from persrag_lightning.data.tasks import get_task
from persrag_lightning.llm.prompts import content_free_prompt, domain_premise

__all__ = ["CALIBRATIONS", "CONTENT_FREE_INPUTS", "DECISIONS", "Calibration", "Decision",
           "LabelReading", "calibration_prompts", "calibration_terms", "check_reading", "decide",
           "resolve_decision"]

Calibration = Literal["none", "contextual", "pmi"]
Decision = Literal["auto", "argmax", "median", "mean"]
CALIBRATIONS: tuple[str, ...] = get_args(Calibration)
DECISIONS: tuple[str, ...] = get_args(Decision)
# Zhao et al. (2021), section 5: averaged over these three
CONTENT_FREE_INPUTS = ("N/A", "", "[MASK]")


def check_reading(calibration: str, decision: str) -> None:
    """A misspelt calibration or decision fails before any LLM call, naming the known ones."""
    if calibration not in CALIBRATIONS:
        raise ValueError(
            f"unknown calibration {calibration!r}; use one of {', '.join(CALIBRATIONS)}"
        )
    if decision not in DECISIONS:
        raise ValueError(f"unknown decision {decision!r}; use one of {', '.join(DECISIONS)}")


def resolve_decision(task: str, decision: str = "auto") -> str:
    """`auto` is the rule the task's first metric rewards: arg max for accuracy (LaMP-1, LaMP-2),
    median for MAE (LaMP-3); `median` and `mean` need ordered labels (a regression task)."""
    spec = get_task(task)
    if decision == "auto":
        return "median" if spec.kind == "regression" else "argmax"
    if decision in ("median", "mean") and spec.kind != "regression":
        raise ValueError(
            f"decision {decision!r} needs ordered labels (LaMP-3); {spec.name}'s labels are not: "
            "use argmax"
        )
    check_reading("none", decision)
    return decision


def calibration_prompts(task: str, calibration: str) -> list[str]:
    """The prompts whose label scores make the calibration terms (none for `none`)."""
    if calibration == "contextual":
        return [content_free_prompt(task, filler) for filler in CONTENT_FREE_INPUTS]
    if calibration == "pmi":
        return [domain_premise(task)]
    check_reading(calibration, "auto")
    return []


def log_softmax(row: Sequence[float]) -> list[float]:
    """Log-probabilities over the labels; a NaN score counts as impossible (it never wins)."""
    clean = [-math.inf if math.isnan(v) else v for v in row]
    top = max(clean)
    if top == -math.inf:
        return [-math.log(len(clean))] * len(clean)
    total = top + math.log(sum(math.exp(v - top) for v in clean))
    return [v - total for v in clean]


def calibration_terms(calibration: str, rows: list[list[float]]) -> list[float] | None:
    """What is subtracted from every prompt's label log-scores: log of the mean content-free
    distribution (`contextual`), the premise's log p per label (`pmi`), nothing (`none`)."""
    if calibration == "none" or not rows:
        return None
    if calibration == "contextual":
        mean = [sum(math.exp(v) for v in col) / len(rows) for col in zip(*(log_softmax(r) for r in rows))]
        return [math.log(max(p, 1e-300)) for p in mean]
    return list(rows[0])


def calibrated(row: Sequence[float], terms: Sequence[float] | None) -> list[float]:
    """The label distribution of one prompt after calibration (probabilities summing to 1)."""
    shifted = [v - t for v, t in zip(row, terms)] if terms is not None else list(row)
    return [math.exp(v) for v in log_softmax(shifted)]


def decide(labels: Sequence[str], probs: Sequence[float], decision: str) -> str:
    """One label from a distribution: the most likely (ties: the earliest), the median (the first
    label whose cumulative probability reaches 1/2), or the mean of the labels' values rounded to
    the nearest label."""
    if decision == "argmax":
        return labels[max(range(len(probs)), key=lambda i: (probs[i], -i))]
    if decision == "median":
        total = 0.0
        for label, p in zip(labels, probs):
            total += p
            if total >= 0.5 - 1e-12:
                return label
        return labels[-1]
    if decision == "mean":
        values = [float(label) for label in labels]
        mean = sum(v * p for v, p in zip(values, probs)) / max(sum(probs), 1e-300)
        # .5 rounds up
        return labels[min(range(len(values)), key=lambda i: (abs(values[i] - mean), -values[i]))]
    raise ValueError(f"unknown decision {decision!r}; use argmax, median or mean")


@dataclass(frozen=True)
class LabelReading:
    """Every label's score for every prompt, the calibration terms, and the answers the decision
    rule gives: what an answer file stores beside the labels, so a table can be recomputed under
    another rule without the LLM."""

    task: str
    labels: tuple[str, ...]
    log_scores: list[list[float]]  # log p(label | prompt), one row per prompt
    calibration: str  # the one applied
    decision: str  # resolved: argmax | median | mean
    terms_by: dict[str, list[float] | None]  # calibration -> its terms (at least the one applied)

    @property
    def terms(self) -> list[float] | None:
        return self.terms_by.get(self.calibration)

    @property
    def probabilities(self) -> list[list[float]]:
        return [calibrated(row, self.terms) for row in self.log_scores]

    @property
    def answers(self) -> list[str]:
        return [decide(self.labels, probs, self.decision) for probs in self.probabilities]

    def under(self, calibration: str, decision: str = "auto") -> LabelReading:
        """The same scores read under another rule, without an LLM call (its terms must have been
        computed)."""
        check_reading(calibration, decision)
        if calibration not in self.terms_by:
            raise ValueError(f"no {calibration!r} terms were computed for these scores (have: {sorted(self.terms_by)})")
        return LabelReading(self.task, self.labels, self.log_scores, calibration,
                            resolve_decision(self.task, decision), self.terms_by)

    def to_json(self, ids: Sequence[str], golds: Sequence[str | None] | None = None) -> dict:
        golds = golds if golds is not None else [None] * len(ids)
        return {"task": self.task, "labels": list(self.labels), "calibration": self.calibration,
                "decision": self.decision, "terms": self.terms_by,
                "rows": [{"id": i, "gold": g, "answer": a, "log_p": row, "p": [round(v, 6) for v in probs]}
                         for i, g, a, row, probs in zip(ids, golds, self.answers, self.log_scores,
                                                         self.probabilities)]}

    @classmethod
    def from_json(cls, obj: dict) -> LabelReading:
        """A stored reading (predictions/<row>.labels.json), rows in their stored order."""
        return cls(obj["task"], tuple(obj["labels"]), [r["log_p"] for r in obj["rows"]], obj["calibration"],
                   obj["decision"], dict(obj["terms"]))
