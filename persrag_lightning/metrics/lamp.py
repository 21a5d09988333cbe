"""The LaMP task metrics, reproducing the official LaMP evaluation: accuracy and macro-F1 (LaMP-1/2),
MAE and RMSE (LaMP-3), ROUGE-1 and ROUGE-L (LaMP-4/5/7), and the per-sample score of LLM feedback.

All states are sums and counts with `dist_reduce_fx="sum"`, so every metric is exact after a DDP
sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torchmetrics import Metric

from persrag_lightning.data.tasks import get_task

if TYPE_CHECKING:
    from rouge_score.rouge_scorer import RougeScorer

__all__ = ["LampClassificationMetric", "LampGenerationMetric", "LampRegressionMetric", "lamp_metric", "parse_rating",
           "rouge_scorer", "score_prediction"]

_ROUGE_SCORER: RougeScorer | None = None


def rouge_scorer() -> RougeScorer:
    """The one shared Google RougeScorer (rouge1, rougeL, no stemmer), built on first use: it is
    called per sample."""
    global _ROUGE_SCORER
    if _ROUGE_SCORER is None:
        from rouge_score.rouge_scorer import RougeScorer

        _ROUGE_SCORER = RougeScorer(["rouge1", "rougeL"], use_stemmer=False)
    return _ROUGE_SCORER


def _check_lengths(preds: Sequence[str], targets: Sequence[str]) -> None:
    if len(preds) != len(targets):
        raise ValueError(f"got {len(preds)} predictions for {len(targets)} targets")


def _parse_gold(target: str) -> float:
    """LaMP-3 gold as float; a bad gold is a data error, not a model error, so it raises."""
    try:
        return float(str(target).strip())
    except ValueError:
        raise ValueError(f"LaMP-3 target {target!r} is not a number") from None


def parse_rating(pred: str, gold: float) -> float:
    """Official LaMP-3 rule: float(pred), else 1.0 or 5.0, whichever is farther from the gold (5.0
    on a tie)."""
    try:
        return float(str(pred).strip())
    except ValueError:
        return 1.0 if abs(1.0 - gold) > abs(5.0 - gold) else 5.0


class LampClassificationMetric(Metric):
    """LaMP-1/2 accuracy and macro-F1 over the label list, as the official sklearn call computes
    them.

    Strings are stripped and mapped to their index in `labels`; anything else maps to -1. Accuracy
    compares indices (so two different out-of-list strings count as equal, as in the official code).
    F1 per label is 2tp / (2tp + fp + fn), 0 when the label is neither present nor predicted
    (sklearn's zero_division default), and the macro average runs over every label of the list,
    never over -1.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, labels: Sequence[str], **kwargs) -> None:
        super().__init__(**kwargs)
        if not labels:
            raise ValueError("LampClassificationMetric needs a non-empty label list")
        self.labels = tuple(labels)
        self._index: dict[str, int] = {}
        for i, label in enumerate(self.labels):
            self._index.setdefault(label, i)  # list.index semantics: first occurrence wins
        n = len(self.labels)
        self.add_state("tp", default=torch.zeros(n, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("fp", default=torch.zeros(n, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("fn", default=torch.zeros(n, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def label_index(self, text: str) -> int:
        """Index of the stripped string in the label list, -1 when absent (always wrong)."""
        return self._index.get(str(text).strip(), -1)

    def update(self, preds: Sequence[str], targets: Sequence[str]) -> None:
        _check_lengths(preds, targets)
        n = len(self.labels)
        p = torch.tensor([self.label_index(x) for x in preds], dtype=torch.long, device=self.device)
        g = torch.tensor(
            [self.label_index(x) for x in targets], dtype=torch.long, device=self.device
        )
        same = p == g
        self.correct += same.sum()
        self.total += p.numel()
        self.tp += torch.bincount(p[same & (p >= 0)], minlength=n)
        self.fp += torch.bincount(p[~same & (p >= 0)], minlength=n)
        self.fn += torch.bincount(g[~same & (g >= 0)], minlength=n)

    def compute(self) -> dict[str, Tensor]:
        tp2 = 2 * self.tp.double()
        denom = tp2 + self.fp + self.fn
        f1 = torch.where(denom > 0, tp2 / denom.clamp_min(1), torch.zeros_like(denom))
        accuracy = self.correct.double() / self.total.clamp_min(1)
        return {"accuracy": accuracy, "f1": f1.mean()}


class LampRegressionMetric(Metric):
    """LaMP-3 MAE and RMSE with the official rule for unparsable ratings; `neg_mae` is there for
    model selection."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state(
            "abs_error", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "sq_error", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Sequence[str], targets: Sequence[str]) -> None:
        _check_lengths(preds, targets)
        golds = [_parse_gold(t) for t in targets]
        values = [parse_rating(p, g) for p, g in zip(preds, golds)]
        err = torch.tensor(values, dtype=torch.float64) - torch.tensor(golds, dtype=torch.float64)
        err = err.to(self.device)
        self.abs_error += err.abs().sum()
        self.sq_error += (err * err).sum()
        self.total += err.numel()

    def compute(self) -> dict[str, Tensor]:
        n = self.total.clamp_min(1)
        mae = self.abs_error / n
        return {"mae": mae, "rmse": torch.sqrt(self.sq_error / n), "neg_mae": -mae}


class LampGenerationMetric(Metric):
    """LaMP-4/5/7 ROUGE-1 and ROUGE-L F-measure: arithmetic mean of exact per-example scores.

    The official code reports the `mid` of evaluate's bootstrap aggregate, which equals this mean up
    to bootstrap noise; the plain mean is exact, deterministic and sums across DDP ranks.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state(
            "rouge1_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "rougeL_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Sequence[str], targets: Sequence[str]) -> None:
        _check_lengths(preds, targets)
        scorer = rouge_scorer()
        r1 = rl = 0.0
        for pred, target in zip(preds, targets):
            s = scorer.score(str(target).strip(), str(pred).strip())
            r1 += s["rouge1"].fmeasure
            rl += s["rougeL"].fmeasure
        self.rouge1_sum += r1
        self.rougeL_sum += rl
        self.total += len(preds)

    def compute(self) -> dict[str, Tensor]:
        n = self.total.clamp_min(1)
        return {"rouge-1": self.rouge1_sum / n, "rouge-L": self.rougeL_sum / n}


def lamp_metric(task_name: str) -> Metric:
    """The official metric of a LaMP task (`LaMP-2`, `LaMP_2`, `2`, ...)."""
    spec = get_task(task_name)
    if spec.kind == "classification":
        assert spec.labels is not None
        return LampClassificationMetric(spec.labels)
    if spec.kind == "regression":
        return LampRegressionMetric()
    return LampGenerationMetric()


def score_prediction(task_name: str, pred: str, target: str) -> float:
    """Per-sample eval(y, O) of paper Eq. 6, higher is better: the LLM-feedback label of one
    candidate.

    Classification: 1.0 on exact match after strip, else 0.0. Regression: -|rating - gold| with the
    official unparsable rule, where non-finite ratings ("nan", "inf") also count as unparsable so a
    label is never NaN. Generation: ROUGE-1 F-measure.
    """
    kind = get_task(task_name).kind
    if kind == "classification":
        return 1.0 if str(pred).strip() == str(target).strip() else 0.0
    if kind == "regression":
        gold = _parse_gold(target)
        value = parse_rating(pred, gold)
        if not math.isfinite(value):
            value = parse_rating("", gold)
        return -abs(value - gold)
    return float(rouge_scorer().score(str(target).strip(), str(pred).strip())["rouge1"].fmeasure)
