"""The decision a trained reader carries, fitted on train users it did not train on: a quantile level for ordered
labels (the median is the level 0.5), the arg max over the train label prior to a power for the others; the fits
pick what scores best, ties going to the rule LaMP reads with; a trained reader reads with its fitted decision
under `auto` and with any rule named."""

from __future__ import annotations

import json

import pytest
import torch

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.models.reader import LabelReader
from persrag_lightning.reading.decision import (
    check_reading,
    decide,
    fit_prior_power,
    fit_quantile,
    prior_corrected,
    quantile_decision,
    resolve_decision,
)
from persrag_lightning.reading.trained import TrainedReader
from tests.helpers.reader import labelled_docs, tiny_reader_export

STARS = ("1", "2", "3", "4", "5")
SPLIT = [0.35, 0.05, 0.05, 0.15, 0.40]  # cumulative .35 .40 .45 .60 1


@pytest.mark.parametrize(("decision", "answer"), [("quantile:0.3", "1"), ("quantile:0.35", "1"),
                                                  ("quantile:0.42", "3"), ("median", "4"), ("quantile:0.5", "4"),
                                                  ("quantile:0.7", "5")])
def test_a_quantile_decision_answers_the_first_label_whose_cumulative_probability_reaches_it(decision, answer):
    assert decide(STARS, SPLIT, decision) == answer
    check_reading("none", decision)


@pytest.mark.parametrize("bad", ["quantile:1.5", "quantile:0", "quantile:x", "quantile:"])
def test_a_quantile_level_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        check_reading("none", bad)


def test_a_quantile_needs_ordered_labels():
    assert resolve_decision("LaMP-3", "quantile:0.4") == "quantile:0.4"
    with pytest.raises(ValueError, match="ordered labels"):
        resolve_decision("LaMP-2", "quantile:0.4")
    assert quantile_decision(0.5) == "median" and quantile_decision(0.35) == "quantile:0.35"


def test_the_quantile_fit_minimises_the_absolute_error_and_a_tie_goes_to_the_level_nearest_the_median():
    # every gold is 1: every level up to .35 answers it (error 0); of those, .35 is the nearest .5
    assert fit_quantile(STARS, [SPLIT] * 4, ["1"] * 4) == 0.35
    # golds at the median's answer: .5 itself
    assert fit_quantile(STARS, [SPLIT] * 4, ["4"] * 4) == 0.5
    # golds above: any level over .6 answers 5; .65 is the nearest .5
    assert fit_quantile(STARS, [SPLIT] * 3, ["5", "5", "4"]) == 0.65


def test_the_prior_power_fit_takes_the_smallest_power_that_is_right_most_often():
    labels, prior, row = ("a", "b", "c"), [0.8, 0.1, 0.1], [0.5, 0.3, 0.2]
    assert prior_corrected(row, prior, 0.0) == row
    assert decide(labels, prior_corrected(row, prior, 0.25), "argmax") == "b"  # .5/.8^.25 < .3/.1^.25
    assert fit_prior_power(labels, [row] * 3, ["b"] * 3, prior) == 0.25
    assert fit_prior_power(labels, [row] * 3, ["a"] * 3, prior) == 0.0  # the plain arg max first


def _with_decision(export, **fitted) -> None:
    path = export / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fitted}))


def fixed(rows):
    def log_probs(self, inputs, docs):
        return torch.tensor(rows[:len(inputs)]).log()

    return log_probs


def test_a_trained_reader_reads_with_its_fitted_quantile_under_auto_and_with_a_named_rule_otherwise(
        tmp_path, tiny_bert, monkeypatch):
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-3")
    assert TrainedReader(export).resolved_decision("LaMP-3") == ("median", 0.0)  # none fitted: the metric's rule
    _with_decision(export, decision="quantile:0.3", label_prior=[0.2] * 5)
    monkeypatch.setattr(LabelReader, "log_probs", fixed([SPLIT]))
    docs = [labelled_docs("LaMP-3", ["fine"], ["4"])]
    fitted = TrainedReader(export)
    reading = fitted.read("LaMP-3", ["review: ok"], docs)
    assert reading.answers == ["1"] and reading.decision == "quantile:0.3"
    assert fitted.reading("LaMP-3") == {"calibration": "none", "decision": "quantile:0.3"}
    assert "fitted on held-out train users" in fitted.describe("LaMP-3")
    assert TrainedReader(export, decision="median").answer("LaMP-3", ["review: ok"], docs) == ["4"]


def test_a_trained_reader_divides_by_its_train_prior_to_the_fitted_power(tmp_path, tiny_bert, monkeypatch):
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    prior = [0.5] + [0.5 / 14] * 14  # the first label is half the train targets
    _with_decision(export, decision="argmax", prior_power=1.0, label_prior=prior)
    row = [0.4, 0.3] + [0.3 / 13] * 13
    monkeypatch.setattr(LabelReader, "log_probs", fixed([row]))
    docs = [labelled_docs("LaMP-2", ["a"], ["comedy"])]
    reading = TrainedReader(export).read("LaMP-2", ["description: x"], docs)
    assert reading.answers == [LAMP2_LABELS[1]] and reading.decision == "argmax"
    assert reading.probabilities[0] == pytest.approx(prior_corrected(row, prior, 1.0))
    assert TrainedReader(export).reading("LaMP-2")["prior_power"] == 1.0
    assert TrainedReader(export, decision="argmax").answer("LaMP-2", ["description: x"], docs) == [LAMP2_LABELS[0]]
    # feedback scores the reader's own distribution, not the corrected one
    assert TrainedReader(export).score_targets("LaMP-2", ["description: x"], docs, [LAMP2_LABELS[0]]) == \
        pytest.approx([torch.tensor(0.4).log().item()])
