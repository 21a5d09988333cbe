"""benchmarks/subset_power.py: which tests a run claims, significance counted only in the claimed direction, and on
the whole of a stored run the same p-values as the evaluation that wrote it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("subset_power", ROOT / "benchmarks" / "subset_power.py")
subset_power = importlib.util.module_from_spec(spec)
spec.loader.exec_module(subset_power)
STORED = ROOT / "benchmarks" / "results" / "cpu-2026-11-27i-mainjob"


def test_the_goal_tests_are_the_reference_against_bm25_and_its_chain_without_user_retrieval_then_the_pairs():
    metrics = {"reference": "chosen", "results": dict.fromkeys(["zero_shot", "bm25", "chosen", "w/o user retrieval (x)"]),
               "pairs": [{"strategy": "chosen + g", "against": "bm25 + g"}]}
    assert subset_power.goal_tests(metrics) == [("chosen", "bm25"), ("chosen", "w/o user retrieval (x)"),
                                                ("chosen + g", "bm25 + g")]


def test_only_a_significant_difference_in_the_claimed_direction_counts():
    from persrag_lightning.evaluation.stats import LampMetricFn

    metric = LampMetricFn("LaMP-2", "accuracy")
    golds = ["comedy"] * 40
    answers = {"right": ["comedy"] * 40, "wrong": ["horror"] * 40}
    everything = list(range(40))
    (ok, p), = subset_power.tested(metric, answers, golds, [("right", "wrong")], everything, 200)
    assert ok and p < 0.05
    (ok, p), = subset_power.tested(metric, answers, golds, [("wrong", "right")], everything, 200)
    assert not ok and p < 0.05  # significant, but the other way round
    (ok, p), = subset_power.tested(metric, answers, golds, [("right", "right")], everything, 200)
    assert not ok and p == 1.0


@pytest.mark.skipif(not (STORED / "predictions").is_dir(), reason="the stored main-job answers are not here")
def test_on_the_whole_stored_run_the_p_values_are_the_evaluations(tmp_path):
    metrics, golds, answers = subset_power.load_run(STORED, str(tmp_path))
    assert len(golds) == metrics["examples"] == 300
    metric = subset_power.LampMetricFn(metrics["task"], "accuracy")
    tests = subset_power.goal_tests(metrics)
    results = subset_power.tested(metric, answers, golds, tests, list(range(len(golds))), 1000)
    for (a, b), (ok, p) in zip(tests, results):
        stored = (metrics["p_values"][b]["accuracy"] if a == metrics["reference"]
                  else next(x["p_values"]["accuracy"] for x in metrics["pairs"] if x["strategy"] == a))
        assert p == pytest.approx(stored), (a, b)
        assert ok  # the run's three differences, all significant in bfloat16 on seed 0
    assert json.loads((STORED / "evaluate_metrics.json").read_text())["results"][metrics["reference"]]["accuracy"] == \
        pytest.approx(metric(answers[metrics["reference"]], golds))
