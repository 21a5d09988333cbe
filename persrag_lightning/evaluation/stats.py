"""Uncertainty of LaMP results: bootstrap confidence intervals and paired tests over examples.

A table of point estimates on a few hundred examples cannot say whether CFRAG beats a baseline:
accuracy on 300 examples has a 95 % interval about ±0.05 wide. Both tools here resample *examples*
and recompute the whole metric, so they hold for metrics that are not means of per-example scores
(macro-F1, RMSE) as well as for those that are.

The one home of every interval and paired test of the evaluators: `bootstrap_ci` / `paired_test`
resample a whole metric over strings (LaMP tables); `bootstrap_interval` / `sign_flip_test` do the
same for the mean of per-question values (PersonaBench's R@5, the memory evaluation's answer hits),
on the same resampling core.

`metric_fn` is any `(predictions, golds) -> float` over strings. `LampMetricFn` wraps the official
torchmetrics (`persrag_lightning.metrics.lamp_metric`) and adds a vectorised numpy path (per-example
encoding once, then every resample in one array operation) that gives the same numbers; a plain
callable falls back to one call per resample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from persrag_lightning.data.tasks import get_task
from persrag_lightning.metrics import HIGHER_IS_BETTER, METRIC_NAMES

__all__ = ["Comparison", "Interval", "LampMetricFn", "bootstrap_ci", "bootstrap_interval",
           "compare", "metric_names", "paired_test", "sign_flip_test"]

MetricFn = Callable[[Sequence[str], Sequence[str]], float]

# Resample chunks hold at most this many (resample, example) cells, so 10^4 examples do not need GBs
# of indices.
_CELLS_PER_CHUNK = 2_000_000


def metric_names(task: str) -> tuple[str, ...]:
    """The metrics reported for a task: accuracy/f1, mae/rmse or rouge-1/rouge-L."""
    return METRIC_NAMES[get_task(task).kind]


@dataclass(frozen=True)
class LampMetricFn:
    """One number of a task's official LaMP metric as a function of (predictions, golds).

    Calling it runs the official torchmetrics object, so the point estimate is exactly the table's
    number. `encode` + `aggregate` are the fast path used for resampling: each example is reduced
    once to a number (classification: label index, regression: signed error after the official
    unparsable rule, generation: its ROUGE F-measure), and any resample or swap of examples is then
    an array operation on those numbers.
    """

    task: str
    name: str

    def __post_init__(self) -> None:
        spec = get_task(self.task)
        allowed = (*METRIC_NAMES[spec.kind], "neg_mae") if spec.kind == "regression" else METRIC_NAMES[spec.kind]
        if self.name not in allowed:
            raise ValueError(
                f"{spec.name} has no metric {self.name!r}; use one of {', '.join(allowed)}"
            )
        object.__setattr__(self, "task", spec.name)

    @property
    def higher_is_better(self) -> bool:
        return HIGHER_IS_BETTER[self.name]

    def __call__(self, predictions: Sequence[str], golds: Sequence[str]) -> float:
        from persrag_lightning.metrics import lamp_metric

        metric = lamp_metric(self.task)
        metric.update(list(predictions), list(golds))
        return float(metric.compute()[self.name])

    def encode(
        self, predictions: Sequence[str], golds: Sequence[str]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-example (value, gold) arrays that `aggregate` turns into the metric for any selection
        of rows."""
        if len(predictions) != len(golds):
            raise ValueError(f"got {len(predictions)} predictions for {len(golds)} golds")
        spec = get_task(self.task)
        if spec.kind == "classification":
            assert spec.labels is not None
            index: dict[str, int] = {}
            for i, label in enumerate(spec.labels):
                index.setdefault(label, i)
            p = np.array([index.get(str(x).strip(), -1) for x in predictions], dtype=np.int64)
            g = np.array([index.get(str(x).strip(), -1) for x in golds], dtype=np.int64)
            return p, g
        if spec.kind == "regression":
            from persrag_lightning.metrics.lamp import _parse_gold, parse_rating

            gold = np.array([_parse_gold(t) for t in golds], dtype=np.float64)
            value = np.array(
                [parse_rating(p, g) for p, g in zip(predictions, gold)], dtype=np.float64
            )
            return value - gold, np.zeros_like(gold)
        from persrag_lightning.metrics import rouge_scorer

        key = {"rouge-1": "rouge1", "rouge-L": "rougeL"}[self.name]
        scorer = rouge_scorer()
        values = [scorer.score(str(t).strip(), str(p).strip())[key].fmeasure for p, t in zip(predictions, golds)]
        return np.array(values, dtype=np.float64), np.zeros(len(values), dtype=np.float64)

    def aggregate(self, values: np.ndarray, golds: np.ndarray) -> np.ndarray:
        """The metric of every row of [R, n] encoded arrays (one resample per row): shape [R]."""
        kind = get_task(self.task).kind
        if kind == "generation":
            return values.mean(axis=1)
        if kind == "regression":
            mae = np.abs(values).mean(axis=1)
            if self.name == "rmse":
                return np.sqrt((values * values).mean(axis=1))
            return -mae if self.name == "neg_mae" else mae
        # the official code compares indices: two unlisted strings count as equal
        same = values == golds
        if self.name == "accuracy":
            return same.mean(axis=1)
        labels = get_task(self.task).labels
        assert labels is not None
        return _macro_f1(values, golds, same, len(labels))


def _macro_f1(pred: np.ndarray, gold: np.ndarray, same: np.ndarray, n_labels: int) -> np.ndarray:
    """Row-wise macro-F1 over the label list, as `LampClassificationMetric` computes it (index -1
    never counts)."""
    rows = pred.shape[0]
    width = n_labels + 1  # bucket 0 takes index -1 and the cells that do not count
    offset = (np.arange(rows) * width)[:, None]

    def count(labels: np.ndarray, keep: np.ndarray) -> np.ndarray:
        cells = np.where(keep, labels + 1, 0) + offset
        return np.bincount(cells.ravel(), minlength=rows * width).reshape(rows, width)[:, 1:]

    tp, fp, fn = count(pred, same), count(pred, ~same), count(gold, ~same)
    denom = 2 * tp + fp + fn
    f1 = np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)
    return f1.mean(axis=1)


class Interval(NamedTuple):
    """A point estimate with its bootstrap confidence interval."""

    point: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.point:.3f} [{self.low:.3f}, {self.high:.3f}]"


@dataclass(frozen=True)
class Comparison:
    """A paired test of one strategy against the reference on one metric (same examples, same
    golds)."""

    strategy: str
    reference: str
    metric: str
    difference: float  # strategy minus reference, in the metric's units
    p_value: float  # two-sided approximate-randomisation p-value, with the +1 correction (never 0)
    n_resamples: int
    higher_is_better: bool = True

    def significant(self, alpha: float = 0.05) -> bool:
        return self.p_value < alpha

    @property
    def better(self) -> bool:
        """Whether the strategy's point estimate beats the reference's (in the metric's
        direction)."""
        return self.difference > 0 if self.higher_is_better else self.difference < 0


@runtime_checkable
class VectorisedMetric(Protocol):
    """A metric_fn with a fast path: per-example encoding once, then the metric of many row
    selections at once."""

    def __call__(self, predictions: Sequence[str], golds: Sequence[str]) -> float: ...

    def encode(
        self, predictions: Sequence[str], golds: Sequence[str]
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def aggregate(self, values: np.ndarray, golds: np.ndarray) -> np.ndarray: ...


def _chunks(n_resamples: int, n: int) -> Iterator[int]:
    size = max(1, _CELLS_PER_CHUNK // max(n, 1))
    for start in range(0, n_resamples, size):
        yield min(size, n_resamples - start)


def _check(n_resamples: int, *lengths: int) -> int:
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    if len(set(lengths)) != 1:
        raise ValueError(f"predictions and golds differ in length: {lengths}")
    if lengths[0] == 0:
        raise ValueError("cannot resample zero examples")
    return lengths[0]


def bootstrap_ci(metric_fn: MetricFn, predictions: Sequence[str], golds: Sequence[str], n_resamples: int = 1000,
                 confidence: float = 0.95, seed: int = 0) -> Interval:
    """Percentile bootstrap over examples: (metric on all examples, lower, upper bound of the
    interval).

    Each resample draws n examples with replacement and recomputes the whole metric. The draws
    depend only on (n, n_resamples, seed), so every strategy evaluated on the same examples sees the
    same resamples.
    """
    n = _check(n_resamples, len(predictions), len(golds))
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    stats: list[np.ndarray] = []
    if isinstance(metric_fn, VectorisedMetric):
        values, gold = metric_fn.encode(predictions, golds)
        for size in _chunks(n_resamples, n):
            idx = rng.integers(0, n, size=(size, n))
            stats.append(np.asarray(metric_fn.aggregate(values[idx], gold[idx]), dtype=np.float64))
    else:
        preds, gl = list(predictions), list(golds)
        for size in _chunks(n_resamples, n):
            for row in rng.integers(0, n, size=(size, n)):
                stats.append(np.array([metric_fn([preds[i] for i in row], [gl[i] for i in row])]))
    low, high = _percentiles(np.concatenate(stats), confidence)
    return Interval(float(metric_fn(predictions, golds)), low, high)


def _percentiles(distribution: np.ndarray, confidence: float) -> tuple[float, float]:
    """The percentile interval of a bootstrap distribution (both tails cut equally)."""
    tail = (1 - confidence) / 2
    low, high = np.quantile(distribution, [tail, 1 - tail])
    return float(low), float(high)


def bootstrap_interval(values: Sequence[float] | np.ndarray, n_resamples: int = 1000, confidence: float = 0.95,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-example values (`bootstrap_ci` for a mean
    metric: the same draws for the same (n, n_resamples, seed)). Callers decide what an empty list
    reports."""
    v = np.asarray(values, dtype=np.float64)
    n = _check(n_resamples, len(v))
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    means = [v[rng.integers(0, n, size=(size, n))].mean(axis=1) for size in _chunks(n_resamples, n)]
    return _percentiles(np.concatenate(means), confidence)


def paired_test(metric_fn: MetricFn, preds_a: Sequence[str], preds_b: Sequence[str], golds: Sequence[str],
                n_resamples: int = 1000, seed: int = 0) -> float:
    """Two-sided approximate randomisation test of "A and B are exchangeable" on the metric's
    difference.

    Each resample swaps A's and B's predictions on a random half of the examples (each with
    probability 1/2) and recomputes |metric(A') - metric(B')|; p = (1 + #{resampled >= observed}) /
    (1 + n_resamples), so p is never 0 and identical systems get p = 1. Pairing by example removes
    the (large) between-example variance. NaN when the observed difference is NaN (an unparsable
    "nan" rating makes the official MAE NaN).
    """
    n = _check(n_resamples, len(preds_a), len(preds_b), len(golds))
    rng = np.random.default_rng(seed)
    hits = 0
    if isinstance(metric_fn, VectorisedMetric):
        xa, gold = metric_fn.encode(preds_a, golds)
        xb, _ = metric_fn.encode(preds_b, golds)
        metric_a, metric_b = metric_fn.aggregate(np.stack([xa, xb]), np.stack([gold, gold]))
        observed = abs(float(metric_a - metric_b))
        if math.isnan(observed):
            return math.nan
        for size in _chunks(n_resamples, n):
            swap = rng.random((size, n)) < 0.5
            g = np.broadcast_to(gold, (size, n))
            diff = metric_fn.aggregate(np.where(swap, xb, xa), g) - metric_fn.aggregate(
                np.where(swap, xa, xb), g
            )
            hits += int(np.count_nonzero(np.abs(diff) >= observed - _tolerance(observed)))
    else:
        a, b, gl = list(preds_a), list(preds_b), list(golds)
        observed = abs(metric_fn(a, gl) - metric_fn(b, gl))
        if math.isnan(observed):
            return math.nan
        for size in _chunks(n_resamples, n):
            for swap in rng.random((size, n)) < 0.5:
                a2 = [y if s else x for x, y, s in zip(a, b, swap)]
                b2 = [x if s else y for x, y, s in zip(a, b, swap)]
                hits += abs(metric_fn(a2, gl) - metric_fn(b2, gl)) >= observed - _tolerance(
                    observed
                )
    return (1 + hits) / (1 + n_resamples)


def sign_flip_test(
    differences: Sequence[float] | np.ndarray, n_resamples: int = 10_000, seed: int = 0
) -> float:
    """`paired_test` for the mean of per-question differences (A - B): flipping a difference's sign
    is swapping A and B on that question. Two-sided, with the +1 correction (never 0); 1.0 when
    every difference is 0. Draws random signs rather than `paired_test`'s swap mask, so
    PersonaBench's published p-values stay as they were."""
    d = np.asarray(differences, dtype=np.float64)
    if len(d) == 0 or not d.any():
        return 1.0
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(n_resamples, len(d)))
    hits = (np.abs((signs * d).sum(axis=1)) >= abs(d.sum()) - 1e-12).sum()
    return float((hits + 1) / (n_resamples + 1))


def _tolerance(observed: float) -> float:
    """Float slack so a resample equal to the observed difference (up to summation order) counts as
    >=."""
    return 1e-12 * max(1.0, abs(observed)) if math.isfinite(observed) else 0.0


def compare(metric_fn: MetricFn, strategy: str, preds: Sequence[str], reference: str, ref_preds: Sequence[str],
            golds: Sequence[str], metric: str | None = None, n_resamples: int = 1000, seed: int = 0) -> Comparison:
    """`paired_test` of `strategy` against `reference`, with the point difference and the metric's
    direction."""
    p = paired_test(metric_fn, preds, ref_preds, golds, n_resamples=n_resamples, seed=seed)
    difference = metric_fn(preds, golds) - metric_fn(ref_preds, golds)
    name = metric if metric is not None else getattr(metric_fn, "name", getattr(metric_fn, "__name__", "metric"))
    return Comparison(strategy, reference, name, float(difference), p, n_resamples,
                      bool(getattr(metric_fn, "higher_is_better", True)))
