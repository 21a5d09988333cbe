"""Results tables and plots that carry their uncertainty: 95 % intervals and paired tests against a
reference.

A reader of `results.md` must be able to tell which differences are real; every cell therefore shows
the bootstrap interval next to the point estimate, each strategy has the p-value of a paired test
against the reference (CFRAG by default), and the header says which split, how many examples and
which answer mode produced it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.stats import (
    Comparison,
    Interval,
    LampMetricFn,
    bootstrap_ci,
    compare,
    metric_names,
)
from persrag_lightning.utils import atomic_replace

__all__ = ["Summary", "plot_results", "summarise"]

ALPHA = 0.05
MARKER = "*"


@dataclass
class Summary:
    """Everything a results table needs: point metrics, intervals and paired comparisons per
    strategy."""

    task: str
    results: dict[str, dict[str, float]]
    intervals: dict[str, dict[str, Interval]]
    comparisons: dict[str, dict[str, Comparison]]
    n_examples: int
    reference: str | None
    n_resamples: int
    confidence: float
    metrics: tuple[str, ...]
    # further tests, one {metric: test} per pair
    pairs: list[dict[str, Comparison]] = field(default_factory=list)

    def table(self, answer_mode: str, split: str) -> str:
        """`results_table` of this summary, then its further paired tests (`pairs`), one line each.

        Args:
            answer_mode: how the answers were read (`generate` or `choose`), named in the table's heading.
            split: the split the rows ran on, named there too.
        """
        table = results_table(self.task, self.results, self.intervals, self.comparisons, self.reference or "CFRAG",
                              answer_mode, split=split, n_examples=self.n_examples, confidence=self.confidence,
                              n_resamples=self.n_resamples)
        return table + "".join(f"\n{_pair_sentence(by_metric)}\n" for by_metric in self.pairs)


def summarise(task: str, predictions: Mapping[str, Sequence[str]], golds: Sequence[str], reference: str = "CFRAG",
              n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
              pairs: Sequence[Sequence[str]] = ()) -> Summary:
    """Intervals for every strategy and metric, and paired tests against `reference` when it is
    present; `pairs` ([a, b], ...) adds a paired test of a against b for each pair whose two
    strategies both ran.

    All strategies use the same seed, so they share bootstrap resamples and swap patterns (common
    random numbers).
    """
    metrics = metric_names(task)
    fns = {m: LampMetricFn(task, m) for m in metrics}
    results: dict[str, dict[str, float]] = {}
    intervals: dict[str, dict[str, Interval]] = {}
    comparisons: dict[str, dict[str, Comparison]] = {}
    for name, preds in predictions.items():
        intervals[name] = {m: bootstrap_ci(fn, preds, golds, n_resamples, confidence, seed) for m, fn in fns.items()}
        results[name] = {m: ci.point for m, ci in intervals[name].items()}
        if reference in predictions and name != reference:
            comparisons[name] = {m: compare(fn, name, preds, reference, predictions[reference], golds, m,
                                            n_resamples, seed) for m, fn in fns.items()}
    further = [{m: compare(fn, a, predictions[a], b, predictions[b], golds, m, n_resamples, seed)
                for m, fn in fns.items()} for a, b in pairs if a in predictions and b in predictions]
    return Summary(get_task(task).name, results, intervals, comparisons, len(golds),
                   reference if reference in predictions else None, n_resamples, confidence, metrics, further)


def _p_cell(comparison: Comparison | None, is_reference: bool) -> str:
    if is_reference:
        return "(reference)"
    if comparison is None or math.isnan(comparison.p_value):
        return "-"
    mark = f" {MARKER}" if comparison.significant(ALPHA) else ""
    return f"{comparison.p_value:.3f}{mark}"


def _interval_cell(interval: Interval | None, point: float | None) -> str:
    if interval is not None and not math.isnan(interval.point):
        return str(interval)
    if point is not None and not math.isnan(point):
        return f"{point:.3f}"
    return "-"


def results_table(task: str, results: Mapping[str, Mapping[str, float]],
                  intervals: Mapping[str, Mapping[str, Interval]],
                  comparisons: Mapping[str, Mapping[str, Comparison]], reference: str = "CFRAG",
                  answer_mode: str = "generate", *, split: str, n_examples: int, confidence: float = 0.95,
                  n_resamples: int | None = None) -> str:
    """Markdown: per strategy and metric `0.412 [0.356, 0.468]` and the paired p-value against
    `reference`.

    Metrics are the task's official pair; any other numeric entry of `results` (retrieval
    diagnostics) follows as a plain column. A closing line names the differences from the reference
    that are significant.
    """
    spec = get_task(task)
    metrics = metric_names(spec.name)
    extra = sorted({k for r in results.values() for k in r} - set(metrics) - {"neg_mae"})
    has_ref = reference in results
    resamples = f", {n_resamples} resamples" if n_resamples else ""
    lines = [
        f"**{spec.name}** · split **{split}** · {n_examples} examples · answer mode **{answer_mode}**",
        "",
        f"Cells: metric on all examples [{confidence:.0%} bootstrap interval over examples{resamples}]. "
        + (f"p: two-sided paired approximate-randomisation test against {reference}; {MARKER} p < {ALPHA}."
           if has_ref else f"No paired tests: the reference {reference!r} is not in this table."),
        "",
    ]
    header = ["method"]
    for m in metrics:
        header += [f"{spec.name} {m}"] + ([f"p vs {reference} ({m})"] if has_ref else [])
    header += extra
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in results.items():
        cells = [name]
        for m in metrics:
            cells.append(_interval_cell(intervals.get(name, {}).get(m), row.get(m)))
            if has_ref:
                cells.append(_p_cell(comparisons.get(name, {}).get(m), name == reference))
        cells += [f"{row[k]:.4f}" if k in row and not math.isnan(row[k]) else "-" for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    if has_ref:
        lines += ["", _significance_sentence(metrics, comparisons, reference)]
    return "\n".join(lines) + "\n"


def _significance_sentence(
    metrics: Sequence[str], comparisons: Mapping[str, Mapping[str, Comparison]], reference: str
) -> str:
    found = []
    for name, by_metric in comparisons.items():
        for m in metrics:
            c = by_metric.get(m)
            if c is not None and c.significant(ALPHA):
                found.append(
                    f"{name} {m} ({'better' if c.better else 'worse'}, p = {c.p_value:.3f})"
                )
    if not found:
        return f"No difference from {reference} is significant at p < {ALPHA}."
    return f"Significantly different from {reference} at p < {ALPHA}: " + "; ".join(found) + "."


def _pair_sentence(by_metric: Mapping[str, Comparison]) -> str:
    """`a` vs `b`: the difference and paired p per metric, in one line."""
    first = next(iter(by_metric.values()))
    cells = [f"{m} {c.difference:+.3f} (p = {c.p_value:.3f}{' ' + MARKER if c.significant(ALPHA) else ''})"
             for m, c in by_metric.items()]
    return f"Paired test, {first.strategy} vs {first.reference}: " + ", ".join(cells) + "."


def plot_results(task: str, results: Mapping[str, Mapping[str, float]],
                 intervals: Mapping[str, Mapping[str, Interval]], path: str | Path, answer_mode: str = "generate",
                 *, split: str, n_examples: int, confidence: float = 0.95) -> Path:
    """Bars per strategy and metric with the intervals as error bars (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = get_task(task)
    metrics = metric_names(spec.name)
    names = list(results)
    width = 0.8 / len(metrics)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names)), 4.0))
    x = np.arange(len(names))
    for i, m in enumerate(metrics):
        points = np.array([results[n].get(m, np.nan) for n in names], dtype=float)
        cis = [intervals.get(n, {}).get(m) for n in names]
        low = np.array([p - c.low if c is not None else 0.0 for p, c in zip(points, cis)])
        high = np.array([c.high - p if c is not None else 0.0 for p, c in zip(points, cis)])
        ax.bar(x + i * width, points, width, yerr=np.vstack([np.maximum(low, 0), np.maximum(high, 0)]),
               capsize=3, label=m)
    ax.set_xticks(x + width * (len(metrics) - 1) / 2)
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_title(f"{spec.name} · {split} · {n_examples} examples · {answer_mode} "
                 f"(error bars: {confidence:.0%} bootstrap intervals)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_replace(path) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
    finally:
        plt.close(fig)
    return path
