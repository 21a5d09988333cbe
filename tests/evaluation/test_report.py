"""Results tables and plots with intervals: the cells, the p column, the header and the PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.evaluation.report import plot_results, results_table, summarise
from persrag_lightning.evaluation.stats import Comparison, Interval


def lamp2_case(seed: int = 0, n: int = 300) -> tuple[dict[str, list[str]], list[str]]:
    rng = np.random.default_rng(seed)
    golds = [str(rng.choice(LAMP2_LABELS)) for _ in range(n)]

    def system(p: float) -> list[str]:
        return [g if rng.random() < p else str(rng.choice(LAMP2_LABELS)) for g in golds]

    return {"BM25": system(0.2), "CFRAG": system(0.5), "Contriever": system(0.5)}, golds


def test_table_shows_intervals_p_values_and_header() -> None:
    results = {"CFRAG": {"accuracy": 0.4123, "f1": 0.30, "recall@5": 0.5},
               "BM25": {"accuracy": 0.30, "f1": 0.21, "recall@5": 0.25}}
    intervals = {"CFRAG": {"accuracy": Interval(0.4123, 0.3561, 0.4679), "f1": Interval(0.30, 0.25, 0.35)},
                 "BM25": {"accuracy": Interval(0.30, 0.25, 0.35), "f1": Interval(0.21, 0.17, 0.26)}}
    comparisons = {"BM25": {"accuracy": Comparison("BM25", "CFRAG", "accuracy", -0.1123, 0.004, 1000),
                            "f1": Comparison("BM25", "CFRAG", "f1", -0.09, 0.062, 1000)}}
    text = results_table("LaMP-2", results, intervals, comparisons, answer_mode="choose", split="test",
                         n_examples=300, n_resamples=1000)
    lines = text.splitlines()
    assert "LaMP-2" in lines[0] and "test" in lines[0] and "300 examples" in lines[0] and "choose" in lines[0]
    cfrag = next(ln for ln in lines if ln.startswith("| CFRAG"))
    bm25 = next(ln for ln in lines if ln.startswith("| BM25"))
    assert "0.412 [0.356, 0.468]" in cfrag and "(reference)" in cfrag and "0.5000" in cfrag
    cells = [c.strip() for c in bm25.strip("|").split("|")]
    assert cells == ["BM25", "0.300 [0.250, 0.350]", "0.004 *", "0.210 [0.170, 0.260]", "0.062", "0.2500"]
    assert "p vs CFRAG (accuracy)" in text and "recall@5" in text
    assert "BM25 accuracy (worse, p = 0.004)" in lines[-1] and "f1" not in lines[-1]


def test_table_without_reference_has_no_p_column() -> None:
    results = {"BM25": {"mae": 0.9, "rmse": 1.2}}
    intervals = {"BM25": {"mae": Interval(0.9, 0.8, 1.0), "rmse": Interval(1.2, 1.1, 1.3)}}
    text = results_table("LaMP-3", results, intervals, {}, split="dev", n_examples=24)
    assert "p vs" not in text and "not in this table" in text and "0.900 [0.800, 1.000]" in text
    assert "generate" in text.splitlines()[0] and "dev" in text.splitlines()[0]


def test_summarise_end_to_end() -> None:
    predictions, golds = lamp2_case()
    summary = summarise("LaMP-2", predictions, golds, n_resamples=500)
    assert set(summary.comparisons) == {"BM25", "Contriever"}  # the reference is not compared with itself
    assert summary.comparisons["BM25"]["accuracy"].significant()
    assert not summary.comparisons["BM25"]["accuracy"].better
    ci = summary.intervals["CFRAG"]["accuracy"]
    assert ci.low < summary.results["CFRAG"]["accuracy"] < ci.high
    text = summary.table(answer_mode="choose", split="test")
    assert str(ci) in text and "300 examples" in text and "500 resamples" in text


def test_further_pairs_are_tested_and_reported_under_the_table() -> None:
    """`pairs` tests two non-reference rows against each other (the goal's "+ tuned generator" comparison); a pair
    naming a strategy that did not run is left out, not failed."""
    predictions, golds = lamp2_case()
    summary = summarise("LaMP-2", predictions, golds, n_resamples=500,
                        pairs=[["Contriever", "BM25"], ["Contriever", "not run"]])
    assert len(summary.pairs) == 1
    test = summary.pairs[0]["accuracy"]
    assert (test.strategy, test.reference) == ("Contriever", "BM25")
    assert test.difference == pytest.approx(summary.results["Contriever"]["accuracy"]
                                            - summary.results["BM25"]["accuracy"])
    text = summary.table(answer_mode="choose", split="test")
    assert f"Paired test, Contriever vs BM25: accuracy {test.difference:+.3f} (p = {test.p_value:.3f}" in text


def test_plot_writes_png_atomically(tmp_path: Path) -> None:
    predictions, golds = lamp2_case(n=60)
    s = summarise("LaMP-2", predictions, golds, n_resamples=100)
    out = tmp_path / "results.png"
    assert plot_results("LaMP-2", s.results, s.intervals, out, "choose", split="test", n_examples=60) == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.png"]  # no temp file left behind


def test_plot_failure_keeps_the_previous_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.figure

    out = tmp_path / "results.png"
    out.write_bytes(b"old")

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        plot_results("LaMP-2", {"A": {"accuracy": 0.5, "f1": 0.4}}, {}, out, split="test", n_examples=1)
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["results.png"]
