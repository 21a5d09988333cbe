"""Bootstrap intervals and paired tests: degenerate, shrinking, calibrated, and equal to the official metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.evaluation.stats import (
    Comparison,
    Interval,
    LampMetricFn,
    bootstrap_ci,
    compare,
    metric_names,
    paired_test,
)

ACC1 = LampMetricFn("LaMP-1", "accuracy")


def bernoulli_lamp1(rng: np.random.Generator, n: int, p: float) -> tuple[list[str], list[str]]:
    """LaMP-1 predictions that are right with probability p (gold always [1])."""
    right = rng.random(n) < p
    return ["[1]" if r else "[2]" for r in right], ["[1]"] * n


def random_case(task: str, n: int, seed: int) -> tuple[list[str], list[str]]:
    """Predictions with the awkward cases: whitespace, unlisted strings, unparsable ratings, free text."""
    rng = np.random.default_rng(seed)
    if task == "LaMP-2":
        pool = [*LAMP2_LABELS, " comedy\n", "not a tag", "Comedy", ""]
        return [str(rng.choice(pool)) for _ in range(n)], [str(rng.choice(LAMP2_LABELS[:6])) for _ in range(n)]
    if task == "LaMP-3":
        pool = ["1", "2", "3", "4", "5", " 4 ", "3.5", "five", "", "0"]
        return [str(rng.choice(pool)) for _ in range(n)], [str(rng.integers(1, 6)) for _ in range(n)]
    words = ["stock", "market", "falls", "rises", "today", "the", "a", "new", "study"]
    make = lambda: " ".join(rng.choice(words, size=int(rng.integers(1, 6))))
    return [make() for _ in range(n)], [make() for _ in range(n)]


@pytest.mark.parametrize(("task", "metric"), [
    ("LaMP-1", "accuracy"), ("LaMP-1", "f1"), ("LaMP-2", "accuracy"), ("LaMP-2", "f1"),
    ("LaMP-3", "mae"), ("LaMP-3", "rmse"), ("LaMP-3", "neg_mae"), ("LaMP-5", "rouge-1"), ("LaMP-5", "rouge-L"),
])
def test_fast_path_equals_torchmetrics_on_resamples(task: str, metric: str) -> None:
    """The numpy path must give the official torchmetrics number for any selection of examples."""
    preds, golds = random_case(task, 40, seed=1)
    fn = LampMetricFn(task, metric)
    values, gold = fn.encode(preds, golds)
    rng = np.random.default_rng(2)
    idx = np.vstack([np.arange(40), rng.integers(0, 40, size=(5, 40))])
    fast = fn.aggregate(values[idx], gold[idx])
    for row, got in zip(idx, fast):
        want = fn([preds[i] for i in row], [golds[i] for i in row])
        assert got == pytest.approx(want, abs=1e-12)


def test_fast_and_generic_paths_give_the_same_interval_and_p() -> None:
    """Same seed, same resamples: the vectorised path is an optimisation, not a different estimator."""
    preds, golds = random_case("LaMP-2", 30, seed=3)
    other, _ = random_case("LaMP-2", 30, seed=4)
    fn = LampMetricFn("LaMP-2", "f1")
    generic = lambda p, g: fn(p, g)  # no encode/aggregate: one call per resample
    fast_ci = bootstrap_ci(fn, preds, golds, n_resamples=60, seed=5)
    slow_ci = bootstrap_ci(generic, preds, golds, n_resamples=60, seed=5)
    assert fast_ci == pytest.approx(slow_ci, abs=1e-12)
    assert paired_test(fn, preds, other, golds, n_resamples=60, seed=5) == pytest.approx(
        paired_test(generic, preds, other, golds, n_resamples=60, seed=5))


def test_constant_metric_gives_a_degenerate_interval() -> None:
    golds = ["[1]", "[2]"] * 25
    assert bootstrap_ci(ACC1, golds, golds) == Interval(1.0, 1.0, 1.0)
    assert bootstrap_ci(lambda p, g: 0.25, ["a"] * 5, ["b"] * 5, n_resamples=20) == Interval(0.25, 0.25, 0.25)


def test_interval_contains_point_and_shrinks_with_more_examples() -> None:
    rng = np.random.default_rng(0)
    widths = []
    for n in (50, 800):
        preds, golds = bernoulli_lamp1(rng, n, 0.4)
        point, low, high = bootstrap_ci(ACC1, preds, golds, n_resamples=1000, seed=1)
        assert low <= point <= high
        widths.append(high - low)
    # Width scales as 1/sqrt(n): 16x the examples, about a quarter of the width.
    assert widths[1] < 0.4 * widths[0]
    assert 0.2 < widths[0] < 0.35  # 2 * 1.96 * sqrt(0.24 / 50) ~ 0.27


def test_bootstrap_coverage_on_bernoulli_samples() -> None:
    """Of 200 seeded samples (n = 120, p = 0.3), about 95 % of the intervals hold the true p."""
    rng = np.random.default_rng(123)
    covered = 0
    for trial in range(200):
        preds, golds = bernoulli_lamp1(rng, 120, 0.3)
        _, low, high = bootstrap_ci(ACC1, preds, golds, n_resamples=400, seed=trial)
        covered += low <= 0.3 <= high
    assert 0.88 <= covered / 200 <= 0.99
    # A 50 % "interval" must cover far less often: the test can tell a too-narrow interval.
    covered50 = 0
    for trial in range(100):
        _, low, high = bootstrap_ci(ACC1, *bernoulli_lamp1(rng, 120, 0.3), n_resamples=400, confidence=0.5,
                                    seed=trial)
        covered50 += low <= 0.3 <= high
    assert covered50 < 70


def test_bootstrap_works_for_macro_f1_and_rmse() -> None:
    for task, metric in (("LaMP-2", "f1"), ("LaMP-3", "rmse")):
        preds, golds = random_case(task, 60, seed=7)
        fn = LampMetricFn(task, metric)
        point, low, high = bootstrap_ci(fn, preds, golds, n_resamples=300)
        assert point == fn(preds, golds) and low < point < high and math.isfinite(low)


def test_paired_test_identical_systems_is_one() -> None:
    preds, golds = random_case("LaMP-2", 100, seed=8)
    assert paired_test(LampMetricFn("LaMP-2", "accuracy"), preds, list(preds), golds) == 1.0
    assert paired_test(LampMetricFn("LaMP-2", "f1"), preds, list(preds), golds) == 1.0


def test_paired_test_finds_a_clearly_better_system_and_is_two_sided() -> None:
    rng = np.random.default_rng(9)
    better, golds = bernoulli_lamp1(rng, 200, 0.8)
    worse, _ = bernoulli_lamp1(rng, 200, 0.4)
    p = paired_test(ACC1, better, worse, golds, n_resamples=1000)
    assert p == pytest.approx(1 / 1001)  # no resample reaches 0.4 apart; the +1 correction keeps p > 0
    assert paired_test(ACC1, worse, better, golds, n_resamples=1000) == p  # two-sided: order does not matter
    assert paired_test(ACC1, better, worse, golds, n_resamples=9) == pytest.approx(0.1)


def test_paired_test_of_similar_systems_is_not_significant() -> None:
    rng = np.random.default_rng(10)
    a, golds = bernoulli_lamp1(rng, 200, 0.5)
    b = [x if rng.random() < 0.9 else ("[2]" if x == "[1]" else "[1]") for x in a]  # flips 10 %, no bias
    assert paired_test(ACC1, a, b, golds) > 0.05


def test_compare_records_direction() -> None:
    rng = np.random.default_rng(11)
    gold = [str(x) for x in rng.integers(1, 6, size=150)]
    good = list(gold)
    bad = ["1" if g != "1" else "5" for g in gold]
    c = compare(LampMetricFn("LaMP-3", "mae"), "Good", good, "CFRAG", bad, gold, n_resamples=200)
    assert isinstance(c, Comparison) and c.metric == "mae" and not c.higher_is_better
    assert c.difference < 0 and c.better and c.significant() and c.reference == "CFRAG"


def test_errors_and_names() -> None:
    assert metric_names("lamp2") == ("accuracy", "f1") and metric_names("3") == ("mae", "rmse")
    with pytest.raises(ValueError, match="no metric"):
        LampMetricFn("LaMP-2", "rmse")
    with pytest.raises(ValueError, match="zero"):
        bootstrap_ci(ACC1, [], [])
    with pytest.raises(ValueError, match="length"):
        paired_test(ACC1, ["[1]"], ["[1]", "[2]"], ["[1]"])
    assert math.isnan(paired_test(LampMetricFn("LaMP-3", "mae"), ["nan"], ["3"], ["3"]))
    assert str(Interval(0.4123, 0.3561, 0.4679)) == "0.412 [0.356, 0.468]"


def test_mean_of_values_uses_the_same_draws_as_a_mean_metric() -> None:
    """PersonaBench's and the memory evaluation's intervals are `bootstrap_ci`'s for a mean: one resampling core."""
    from persrag_lightning.evaluation.stats import bootstrap_interval, sign_flip_test

    rng = np.random.default_rng(4)
    values = rng.random(120)
    by_index = [str(i) for i in range(len(values))]

    def mean_of(preds, golds):  # the generic (one call per resample) path over the values' indices
        return float(np.mean([values[int(p)] for p in preds]))

    assert bootstrap_interval(values, 200, seed=3) == bootstrap_ci(mean_of, by_index, by_index, 200, seed=3)[1:]
    assert sign_flip_test(np.zeros(5)) == 1.0 and sign_flip_test(values - 0.5, 200) > 0
    with pytest.raises(ValueError, match="zero examples"):
        bootstrap_interval([])
