"""The breakdown by the asker's visible history: equal parts by history size, each row's metric and the reference's
paired test on the part's questions alone, in results.md's words and metrics.json's numbers."""

from __future__ import annotations

import pytest

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.evaluation.breakdown import breakdown, breakdown_table, history_groups
from persrag_lightning.evaluation.stats import LampMetricFn


def test_parts_are_equal_and_ordered_by_history_size():
    sizes = [9, 1, 5, 3, 7, 2]
    parts = history_groups(sizes, 3)
    assert [[sizes[i] for i in p] for p in parts] == [[1, 2], [3, 5], [7, 9]]
    assert [len(p) for p in history_groups(list(range(10)), 3)] == [4, 3, 3]


def test_each_part_is_scored_and_tested_on_its_own_questions():
    # 60 questions: the reference is right on the users with long histories, the baseline on the short ones
    right, wrong = LAMP2_LABELS[:2]
    sizes = list(range(60))
    golds = [right] * 60
    reference = [right if s >= 20 else wrong for s in sizes]
    bm25 = [right if s < 20 else wrong for s in sizes]
    strata = breakdown("LaMP-2", {"ref": reference, "bm25": bm25, "other": golds}, golds, sizes, "ref",
                       ["bm25", "missing", "ref"], n_resamples=200)
    assert [(s.low, s.high, s.n) for s in strata] == [(0, 19, 20), (20, 39, 20), (40, 59, 20)]
    assert list(strata[0].tests) == ["bm25"]  # a row that did not run, and the reference itself, are left out
    accuracy = LampMetricFn("LaMP-2", "accuracy")
    assert strata[0].scores == {"ref": accuracy(reference[:20], golds[:20]), "bm25": 1.0}
    assert strata[0].tests["bm25"].difference == pytest.approx(-1.0)  # reference − row
    assert strata[2].tests["bm25"].difference == pytest.approx(1.0)
    assert all(s.tests["bm25"].p_value < 0.05 for s in strata)
    table = breakdown_table("LaMP-2", strata, "ref")
    assert "| 0–19 | 20 | 0.000 | 1.000 | -1.000 (0.005 *) |" in table
    assert strata[1].to_json()["difference"] == {"bm25": pytest.approx(1.0)}


def test_no_breakdown_without_the_reference_or_a_row_to_compare():
    golds = ["1", "2", "3"]
    assert breakdown("LaMP-3", {"bm25": golds}, golds, [1, 2, 3], "ref", ["bm25"]) == []
    assert breakdown("LaMP-3", {"ref": golds}, golds, [1, 2, 3], "ref", ["bm25"]) == []
    assert breakdown_table("LaMP-3", [], "ref") == ""


def test_a_metric_where_lower_is_better_says_which_sign_loses():
    golds, sizes = ["1", "2", "3", "4", "5", "5"], [1, 2, 3, 4, 5, 6]
    strata = breakdown("LaMP-3", {"ref": golds, "bm25": ["5"] * 6}, golds, sizes, "ref", ["bm25"], n_resamples=50)
    table = breakdown_table("LaMP-3", strata, "ref")
    assert "with mae Δ > 0 is the reference's loss" in table
    assert strata[0].tests["bm25"].difference < 0  # the reference's MAE is the lower: it wins
