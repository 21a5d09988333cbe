"""The reading door's words: how label scores become an answer, whoever scored them.

A reader gives every allowed label a log-score. The scores may be calibrated against the reader's
label prior (`Calibration`: `none`, or the LLM's `contextual` and `pmi`, whose terms llm/calibration.py
computes from content-free prompts), and the answer is then the decision the task's metric rewards
(`Decision`): the arg max for accuracy and F1, the median for MAE, the mean rounded to a label for
RMSE. A trained reader may carry a decision fitted on train users it did not train on
(`fit_quantile`, `fit_prior_power`): a quantile level other than the median (`quantile:<level>`),
or the arg max of its distribution divided by its train label prior to a power.

This module imports only the task table, so the LLM's settings (llm/registry.py) can check these
words below the readers that use them (docs/architecture.md, the layers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

from persrag_lightning.data.tasks import get_task

__all__ = ["CALIBRATIONS", "DECISIONS", "Calibration", "Decision", "calibrated", "check_reading", "decide",
           "fit_prior_power", "fit_quantile", "log_softmax", "prior_corrected", "prior_terms", "quantile_decision",
           "resolve_decision"]

Calibration = Literal["none", "contextual", "pmi"]
Decision = Literal["auto", "argmax", "median", "mean"]
CALIBRATIONS: tuple[str, ...] = get_args(Calibration)
DECISIONS: tuple[str, ...] = get_args(Decision)
QUANTILE = "quantile:"  # `quantile:<level>`: the first label whose cumulative probability reaches the level
LEVELS = tuple(round(0.05 * i, 2) for i in range(2, 19))  # the quantile levels a fit tries, 0.10 … 0.90
POWERS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the prior-correction powers a fit tries (0: the plain arg max)


def quantile_decision(level: float) -> str:
    """The decision that answers the label at the cumulative probability `level` (0.5: the median)."""
    return "median" if abs(level - 0.5) < 1e-9 else f"{QUANTILE}{level:g}"


def _level(decision: str) -> float | None:
    """The level of a `quantile:<level>` decision, None for any other; a level outside (0, 1)
    fails."""
    if not decision.startswith(QUANTILE):
        return None
    try:
        level = float(decision[len(QUANTILE):])
    except ValueError:
        level = math.nan
    if not 0.0 < level < 1.0:
        raise ValueError(f"decision {decision!r}: a quantile level is a number strictly between 0 and 1")
    return level


def check_reading(calibration: str, decision: str) -> None:
    """A misspelt calibration or decision fails before any LLM call, naming the known ones."""
    if calibration not in CALIBRATIONS:
        raise ValueError(
            f"unknown calibration {calibration!r}; use one of {', '.join(CALIBRATIONS)}"
        )
    if decision not in DECISIONS and _level(decision) is None:
        raise ValueError(f"unknown decision {decision!r}; use one of {', '.join(DECISIONS)}")


def resolve_decision(task: str, decision: str = "auto") -> str:
    """`auto` is the rule the task's first metric rewards: arg max for accuracy (LaMP-1, LaMP-2),
    median for MAE (LaMP-3); `median` and `mean` need ordered labels (a regression task)."""
    spec = get_task(task)
    if decision == "auto":
        return "median" if spec.kind == "regression" else "argmax"
    if (decision in ("median", "mean") or _level(decision) is not None) and spec.kind != "regression":
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
    if decision == "median" or (level := _level(decision)) is not None:
        level = 0.5 if decision == "median" else level
        total = 0.0
        for label, p in zip(labels, probs):
            total += p
            if total >= level - 1e-12:
                return label
        return labels[-1]
    if decision == "mean":
        values = [float(label) for label in labels]
        mean = sum(v * p for v, p in zip(values, probs)) / max(sum(probs), 1e-300)
        # .5 rounds up
        return labels[min(range(len(values)), key=lambda i: (abs(values[i] - mean), -values[i]))]
    raise ValueError(f"unknown decision {decision!r}; use argmax, median or mean")


def fit_quantile(labels: Sequence[str], rows: Sequence[Sequence[float]], golds: Sequence[str]) -> float:
    """The quantile level of LEVELS whose answers have the least mean absolute error on these
    distributions (ordered, numeric labels); a tie goes to the level nearest the median's 0.5.

    Args:
        labels: the ordered labels.
        rows: one distribution over `labels` per question (probabilities).
        golds: each question's gold label (of held-out train users: never dev or test).
    """
    values = {label: float(label) for label in labels}

    def error(level: float) -> float:
        decision = quantile_decision(level)
        return sum(abs(values[decide(labels, row, decision)] - values[g]) for row, g in zip(rows, golds))

    return min(LEVELS, key=lambda level: (round(error(level), 9), abs(level - 0.5)))


def prior_terms(prior: Sequence[float], power: float) -> list[float]:
    """The log-terms that divide a distribution by the label prior to `power` (as `calibrated` takes
    terms)."""
    return [power * math.log(q) for q in prior]


def prior_corrected(row: Sequence[float], prior: Sequence[float], power: float) -> list[float]:
    """A distribution divided by the label prior to `power`, renormalised (power 0: unchanged)."""
    if power == 0.0:
        return list(row)
    return calibrated([math.log(max(p, 1e-300)) for p in row], prior_terms(prior, power))


def fit_prior_power(labels: Sequence[str], rows: Sequence[Sequence[float]], golds: Sequence[str],
                    prior: Sequence[float]) -> float:
    """The power of POWERS whose prior-corrected arg max is right most often on these distributions
    (unordered labels); a tie goes to the smaller power, 0 (the plain arg max) first.

    Args:
        labels: the labels.
        rows: one distribution over `labels` per question (probabilities).
        golds: each question's gold label (of held-out train users: never dev or test).
        prior: each label's share of the trained-on targets.
    """
    def right(power: float) -> int:
        return sum(decide(labels, prior_corrected(row, prior, power), "argmax") == g for row, g in zip(rows, golds))

    return min(POWERS, key=lambda power: (-right(power), power))
