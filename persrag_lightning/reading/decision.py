"""The reading door's words: how label scores become an answer, whoever scored them.

A reader gives every allowed label a log-score. The scores may be calibrated against the reader's
label prior (`Calibration`: `none`, or the LLM's `contextual` and `pmi`, whose terms llm/calibration.py
computes from content-free prompts), and the answer is then the decision the task's metric rewards
(`Decision`): the arg max for accuracy and F1, the median for MAE, the mean rounded to a label for
RMSE.

This module imports only the task table, so the LLM's settings (llm/registry.py) can check these
words below the readers that use them (docs/architecture.md, the layers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

from persrag_lightning.data.tasks import get_task

__all__ = ["CALIBRATIONS", "DECISIONS", "Calibration", "Decision", "calibrated", "check_reading", "decide",
           "log_softmax", "resolve_decision"]

Calibration = Literal["none", "contextual", "pmi"]
Decision = Literal["auto", "argmax", "median", "mean"]
CALIBRATIONS: tuple[str, ...] = get_args(Calibration)
DECISIONS: tuple[str, ...] = get_args(Decision)


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


def log_softmax(row: Sequence[float]) -> list[float]:
    """Log-probabilities over the labels; a NaN score counts as impossible (it never wins)."""
    clean = [-math.inf if math.isnan(v) else v for v in row]
    top = max(clean)
    if top == -math.inf:
        return [-math.log(len(clean))] * len(clean)
    total = top + math.log(sum(math.exp(v - top) for v in clean))
    return [v - total for v in clean]


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
