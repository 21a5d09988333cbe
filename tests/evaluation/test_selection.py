"""Dev choices in the evaluation room: options from a report (each calibration re-read from the rows' readings),
twins set aside, the best score in the metric's direction, ties to the earlier option."""

from __future__ import annotations

import math

import pytest

from persrag_lightning.evaluation.base import EvaluationReport
from persrag_lightning.evaluation.selection import Option, row_options, select
from persrag_lightning.reading.label_reading import LabelReading


def test_the_best_score_wins_in_the_metrics_direction_and_a_tie_keeps_the_earlier():
    options = [Option("a", "a", 0.5), Option("b", "b", 0.7), Option("c", "c", 0.7)]
    assert select(options, greater_is_better=True).chosen.key == "b"  # b and c tie: the earlier
    assert select(options, greater_is_better=False).chosen.key == "a"  # an MAE: lower is better
    assert select(options, True).scores == {"a": 0.5, "b": 0.7, "c": 0.7}
    with pytest.raises(ValueError, match="at least one option"):
        select([], True)


def test_identical_answers_are_no_choice_even_where_they_score_better():
    """A twin repeats an earlier option's answers: it is set aside (the earlier stands), and never wins."""
    options = [Option("a", "a", 0.5, ("1", "2")), Option("b", "b", 0.9, ("1", "2")), Option("c", "c", 0.6, None)]
    chosen = select(options, True)
    assert chosen.chosen.key == "c" and [(o.key, t.key) for o, t in chosen.twins] == [("b", "a")]
    assert chosen.scores["b"] == 0.9  # recorded all the same


def test_row_options_reread_each_calibration_from_the_report():
    golds = ("4", "2")
    prior = {"none": None, "contextual": [math.log(0.8)] + [math.log(0.05)] * 4, "pmi": [0.0] * 5}
    reading = LabelReading("LaMP-3", ("1", "2", "3", "4", "5"),
                           [[-0.3, -5, -4, -1.0, -3], [-0.3, -1.0, -4, -5, -5]], "none", "median", prior)
    report = EvaluationReport("mae", False, "", {"CFRAG (x)": {"mae": 2.0}, "bm25": {"mae": 1.5}}, None,
                              {"CFRAG (x)": reading}, golds)
    rows = {"CFRAG": "CFRAG (x)", "bm25": "bm25", "not trained": "not trained"}
    options = row_options(report, rows, ["none", "contextual"])
    assert [(o.key, o.label) for o in options] == [
        (("CFRAG", "none"), "CFRAG (x) [calibration none]"),
        (("CFRAG", "contextual"), "CFRAG (x) [calibration contextual]"), (("bm25", None), "bm25")]
    assert [o.score for o in options] == [2.0, 0.0, 1.5]  # "1", "1" uncalibrated; "4", "2" calibrated
    assert select(options, report.greater_is_better).chosen.key == ("CFRAG", "contextual")
    assert [o.key for o in row_options(report, rows)] == [("CFRAG", None), ("bm25", None)]  # the table's numbers
