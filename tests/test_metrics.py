"""Hand-computed checks of the LaMP metrics (official semantics) and the IR metrics."""

from __future__ import annotations

import math

import pytest
import torch

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.metrics import (
    LampClassificationMetric,
    LampGenerationMetric,
    LampRegressionMetric,
    RankingNDCG,
    RankingRecall,
    lamp_metric,
    ndcg_at_k,
    parse_rating,
    primary_metric,
    recall_at_k,
    score_prediction,
)


def _values(out: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v) for k, v in out.items()}


# ------------------------------------------------------------------ classification


LAMP2_GOLDS = ["comedy", "comedy", "action", "sci-fi", "classic"]
LAMP2_PREDS = [" comedy\n", "action", "action", "not a tag", "sci-fi"]
# Pairs (gold -> pred): comedy->comedy ok, comedy->action, action->action ok, sci-fi->-1 (out of list), classic->sci-fi
# accuracy = 2/5
#   sci-fi : tp 0, fp 1 (classic predicted sci-fi), fn 1 (predicted -1)  P 0,   R 0,   F1 0
#   comedy : tp 1, fp 0, fn 1                                            P 1,   R 1/2, F1 2/3
#   action : tp 1, fp 1, fn 0                                            P 1/2, R 1,   F1 2/3
#   classic: tp 0, fp 0, fn 1                                            P 0/0->0, R 0, F1 0
#   the other 11 labels: never present nor predicted                    F1 0 (sklearn zero_division default)
# macro-F1 = (2/3 + 2/3) / 15 = 4/45
LAMP2_F1 = 4 / 45


def test_lamp2_accuracy_and_macro_f1_over_full_label_list():
    metric = LampClassificationMetric(LAMP2_LABELS)
    metric.update(LAMP2_PREDS, LAMP2_GOLDS)
    out = _values(metric.compute())
    assert out["accuracy"] == pytest.approx(2 / 5)
    assert out["f1"] == pytest.approx(LAMP2_F1)


def test_lamp1_out_of_list_counts_against_gold_label():
    # mapped golds 0,1,1,0 ; preds 0,0,1,-1 ("1" is not "[1]")
    # label [1]: tp 1, fp 1, fn 1 -> F1 2/4 ; label [2]: tp 1, fp 0, fn 1 -> F1 2/3 ; macro (1/2 + 2/3)/2 = 7/12
    metric = lamp_metric("LaMP-1")
    metric.update(["[1]", "[1]", "[2]", "1"], ["[1]", "[2]", "[2]", "[1]"])
    out = _values(metric.compute())
    assert out["accuracy"] == pytest.approx(0.5)
    assert out["f1"] == pytest.approx(7 / 12)


def test_classification_accuracy_compares_indices_like_official_code():
    # Gold and prediction both outside the list map to -1 and -1: the official accuracy counts that as a hit,
    # while F1 sees nothing for any label.
    metric = LampClassificationMetric(["a", "b"])
    metric.update(["x"], ["y"])
    out = _values(metric.compute())
    assert out["accuracy"] == 1.0
    assert out["f1"] == 0.0


def test_classification_two_updates_equal_one_and_merge_like_ddp():
    whole = LampClassificationMetric(LAMP2_LABELS)
    whole.update(LAMP2_PREDS, LAMP2_GOLDS)
    split = LampClassificationMetric(LAMP2_LABELS)
    split.update(LAMP2_PREDS[:2], LAMP2_GOLDS[:2])
    split.update(LAMP2_PREDS[2:], LAMP2_GOLDS[2:])
    assert _values(split.compute()) == pytest.approx(_values(whole.compute()))
    # Two "ranks" summed as DDP does: macro-F1 stays exact (a mean of per-rank F1s would not be 4/45).
    rank0, rank1 = LampClassificationMetric(LAMP2_LABELS), LampClassificationMetric(LAMP2_LABELS)
    rank0.update(LAMP2_PREDS[:3], LAMP2_GOLDS[:3])
    rank1.update(LAMP2_PREDS[3:], LAMP2_GOLDS[3:])
    rank0.merge_state(rank1)
    assert _values(rank0.compute())["f1"] == pytest.approx(LAMP2_F1)


def test_classification_rejects_length_mismatch():
    with pytest.raises(ValueError):
        LampClassificationMetric(["a"]).update(["a", "a"], ["a"])


# ------------------------------------------------------------------ regression


def test_lamp3_unparsable_goes_to_the_farther_end():
    # gold 2, "two" -> 5.0 (|5-2| = 3 > |1-2|), error 3 ; gold 4, "n/a" -> 1.0, error 3
    # gold 3, "3.5" -> error 0.5 ; gold 5, " 5 " -> error 0
    # MAE = 6.5 / 4 ; MSE = (9 + 9 + 0.25 + 0) / 4 = 73/16 ; RMSE = sqrt(73) / 4
    metric = LampRegressionMetric()
    metric.update(["two", "n/a"], ["2", "4"])
    metric.update(["3.5", " 5 "], ["3", "5"])
    out = _values(metric.compute())
    assert out["mae"] == pytest.approx(1.625)
    assert out["rmse"] == pytest.approx(math.sqrt(73) / 4)
    assert out["neg_mae"] == pytest.approx(-1.625)


def test_parse_rating_rule():
    assert parse_rating("two", 2.0) == 5.0
    assert parse_rating("n/a", 4.0) == 1.0
    assert parse_rating("?", 3.0) == 5.0  # tie: the official `>` picks 5
    assert parse_rating(" 4 ", 1.0) == 4.0


def test_regression_bad_gold_raises():
    with pytest.raises(ValueError, match="not a number"):
        LampRegressionMetric().update(["3"], ["three"])


# ------------------------------------------------------------------ generation

# target "The cat sat on the mat." -> the cat sat on the mat (6 tokens; case and punctuation dropped)
# pred   "on the mat the cat"     -> on the mat the cat       (5 tokens)
# ROUGE-1: overlap the 2, cat 1, on 1, mat 1 = 5 ; P 5/5, R 5/6 ; F = 2*(5/6)/(11/6) = 10/11
# ROUGE-L: LCS "on the mat" = 3 ; P 3/5, R 3/6 ; F = 2*(3/10)/(11/10) = 6/11
GEN_TARGET, GEN_PRED = "The cat sat on the mat.", "on the mat the cat"


def test_generation_rouge_mean_over_examples():
    metric = LampGenerationMetric()
    metric.update([GEN_PRED], [GEN_TARGET])
    metric.update(["hello world"], ["goodbye"])  # no overlap: 0 and 0
    out = _values(metric.compute())
    assert out["rouge-1"] == pytest.approx((10 / 11 + 0) / 2)
    assert out["rouge-L"] == pytest.approx((6 / 11 + 0) / 2)


def test_generation_two_updates_equal_one():
    preds, targets = [GEN_PRED, "a b c", "x"], [GEN_TARGET, "a c", "y x"]
    whole, split = LampGenerationMetric(), LampGenerationMetric()
    whole.update(preds, targets)
    split.update(preds[:1], targets[:1])
    split.update(preds[1:], targets[1:])
    assert _values(split.compute()) == pytest.approx(_values(whole.compute()))


# ------------------------------------------------------------------ per-sample score and factories


def test_score_prediction_per_task_kind():
    assert score_prediction("LaMP-2", " comedy\n", "comedy") == 1.0
    assert score_prediction("LaMP-2", "Comedy", "comedy") == 0.0
    assert score_prediction("LaMP_1", "[2]", "[1]") == 0.0
    assert score_prediction("LaMP-3", "4.5", "3") == pytest.approx(-1.5)
    assert score_prediction("LaMP-3", "bad", "2") == pytest.approx(-3.0)  # -> 5
    assert score_prediction("LaMP-3", "bad", "4") == pytest.approx(-3.0)  # -> 1
    assert score_prediction("LaMP-3", "nan", "4") == pytest.approx(-3.0)  # non-finite: treated as unparsable
    assert score_prediction("LaMP-5", GEN_PRED, GEN_TARGET) == pytest.approx(10 / 11)
    assert score_prediction("7", "", "something") == 0.0


def test_factory_and_primary_names():
    assert isinstance(lamp_metric("LaMP-2"), LampClassificationMetric)
    assert lamp_metric("LaMP_2").labels == LAMP2_LABELS
    assert isinstance(lamp_metric("3"), LampRegressionMetric)
    assert isinstance(lamp_metric("LaMP-4"), LampGenerationMetric)
    # one answer for the tables, the dev choices and the checkpoints: the table's first metric and its direction
    assert [(primary_metric(t).name, primary_metric(t).greater_is_better)
            for t in ("LaMP-1", "LaMP-2", "LaMP-3", "LaMP-4", "LaMP-5", "LaMP-7")] == [
        ("accuracy", True), ("accuracy", True), ("mae", False), ("rouge-1", True), ("rouge-1", True),
        ("rouge-1", True)]
    # the primary key is really among the metric's outputs; what a checkpoint monitors grows as it gets better
    for task, pred, gold in (("LaMP-1", "[1]", "[1]"), ("LaMP-3", "3", "4"), ("LaMP-7", "a", "a")):
        m = lamp_metric(task)
        m.update([pred], [gold])
        assert primary_metric(task).name in m.compute()
    assert primary_metric("LaMP-3").ascending(1.5) == -1.5  # the MAE as neg_mae
    assert primary_metric("LaMP-2").ascending(0.5) == 0.5
    with pytest.raises(ValueError):
        lamp_metric("LaMP-6")


# ------------------------------------------------------------------ IR metrics


def test_ndcg_hand_computed():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.5]])
    labels = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    # by score: idx0 (g 0), idx1 (g 3), idx3 (g 2) -> DCG@3 = 0/log2(2) + 3/log2(3) + 2/log2(4)
    # ideal   : 3, 2, 1                            -> IDCG@3 = 3/log2(2) + 2/log2(3) + 1/log2(4)
    dcg = 3 / math.log2(3) + 2 / 2
    idcg = 3 + 2 / math.log2(3) + 1 / 2
    ndcg, informative = ndcg_at_k(scores, labels, mask, k=3)
    assert informative.tolist() == [True]
    assert ndcg.item() == pytest.approx(dcg / idcg)  # about 0.6075
    # Gains are labels minus the row minimum: shifting labels (e.g. -MAE feedback) changes nothing.
    shifted, _ = ndcg_at_k(scores, labels - 1.0, mask, k=3)
    assert shifted.item() == pytest.approx(dcg / idcg)
    perfect, _ = ndcg_at_k(labels, labels, mask, k=3)
    assert perfect.item() == pytest.approx(1.0)


def test_padded_candidates_never_enter_top_k():
    # column 2 is padding with the highest score and label of all: it must be ignored
    scores = torch.tensor([[0.2, 0.9, 10.0, 0.5]])
    labels = torch.tensor([[1.0, 0.0, 100.0, 2.0]])
    mask = torch.tensor([[True, True, False, True]])
    # valid gains (min 0): idx0 1, idx1 0, idx3 2 ; top-2 by score: idx1 (0), idx3 (2) -> DCG = 2/log2(3)
    # ideal top-2: idx3 (2), idx0 (1) -> IDCG = 2 + 1/log2(3)
    ndcg, _ = ndcg_at_k(scores, labels, mask, k=2)
    assert ndcg.item() == pytest.approx((2 / math.log2(3)) / (2 + 1 / math.log2(3)))
    # ideal top-2 {3, 0}, scored top-2 {1, 3} -> recall 1/2
    recall, _ = recall_at_k(scores, labels, mask, k=2)
    assert recall.item() == pytest.approx(0.5)
    # k beyond the valid count: padding still never counts, both sets are the 3 valid columns
    recall_big, _ = recall_at_k(scores, labels, mask, k=10)
    assert recall_big.item() == pytest.approx(1.0)
    ndcg_big, _ = ndcg_at_k(scores, labels, mask, k=10)
    dcg = 0 / 1 + 2 / math.log2(3) + 1 / 2  # order idx1, idx3, idx0
    idcg = 2 + 1 / math.log2(3)
    assert ndcg_big.item() == pytest.approx(dcg / idcg)


def test_recall_ideal_ties_broken_by_index():
    scores = torch.tensor([[0.1, 0.9, 0.5]])
    labels = torch.tensor([[1.0, 1.0, 0.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # ideal top-1 = idx0 (tie with idx1, lower index wins); scored top-1 = idx1 -> 0
    recall, _ = recall_at_k(scores, labels, mask, k=1)
    assert recall.item() == 0.0
    # ideal top-2 {0, 1}, scored top-2 {1, 2} -> 1/2
    recall2, _ = recall_at_k(scores, labels, mask, k=2)
    assert recall2.item() == pytest.approx(0.5)


def test_uninformative_rows_are_flagged_and_excluded_from_the_mean():
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.3, 0.2, 0.1], [0.0, 0.0, 0.0]])
    labels = torch.tensor([[0.0, 1.0, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    ndcg, informative = ndcg_at_k(scores, labels, mask, k=2)
    assert informative.tolist() == [True, False, False]
    assert torch.isfinite(ndcg).all()
    # row 0: top-2 by score idx0 (0), idx2 (0) -> DCG 0 ; so NDCG 0
    assert ndcg[0].item() == 0.0
    metric = RankingNDCG(k=2)
    metric.update(scores, labels, mask)
    assert metric.compute().item() == 0.0  # mean over the one informative row, not diluted nor inflated
    # row with the relevant doc ranked first gives 1; the mean of the two informative rows is 1/2
    metric.update(torch.tensor([[0.1, 0.9, 0.5]]), labels[:1], mask[:1])
    assert metric.compute().item() == pytest.approx(0.5)


def test_ranking_metrics_two_updates_equal_one():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(6, 5, generator=gen)
    labels = torch.randint(0, 3, (6, 5), generator=gen).float()
    mask = torch.rand(6, 5, generator=gen) > 0.2
    for cls in (RankingNDCG, RankingRecall):
        whole, split = cls(k=3), cls(k=3)
        whole.update(scores, labels, mask)
        split.update(scores[:2], labels[:2], mask[:2])
        split.update(scores[2:], labels[2:], mask[2:])
        assert split.compute().item() == pytest.approx(whole.compute().item())
        values, informative = (ndcg_at_k if cls is RankingNDCG else recall_at_k)(scores, labels, mask, 3)
        assert whole.compute().item() == pytest.approx(values[informative].mean().item())


def test_ranking_metric_without_informative_rows_is_nan():
    metric = RankingRecall(k=1)
    metric.update(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
    assert math.isnan(metric.compute().item())


def test_ranking_inputs_validated():
    with pytest.raises(ValueError):
        ndcg_at_k(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), k=1)  # mask not bool
    with pytest.raises(ValueError):
        recall_at_k(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), k=1)
