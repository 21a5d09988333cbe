"""Label answers as decisions: calibration terms and decision rules on hand-computed distributions, the cached
label scores a changed rule re-reads without the LLM, and the terms of a real (tiny, random) model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from persrag_lightning.data.prompt_store import PromptStore
from persrag_lightning.llm.calibration import CONTENT_FREE_INPUTS, calibration_prompts
from persrag_lightning.llm.prompts import content_free_prompt, domain_premise
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading.decision import calibrated, decide, resolve_decision
from persrag_lightning.reading.label_reading import LabelReading
from persrag_lightning.reading.llm import LLMReader
from tests.llm.test_choose import ScriptedLLM, answer


def choose_labels(llm, task: str, prompts: list[str], calibration: str = "none", decision: str = "auto"):
    """The LLM reader's reading of built prompts (no store, no remembered terms)."""
    config = LLMConfig(answer_mode="choose", calibration=calibration, decision=decision)
    return LLMReader(config, llm=llm, remember_terms=False).read_prompts(task, prompts)

SCORES = ("1", "2", "3", "4", "5")


def lamp3_table(prompt_row: dict[str, list[float]]) -> dict[tuple[str, str], float]:
    """A ScriptedLLM table from {prompt: log p of "1".."5"}."""
    return {(p, label): v for p, row in prompt_row.items() for label, v in zip(SCORES, row)}


def test_a_label_prior_that_flips_the_arg_max() -> None:
    """Uncalibrated, the prior for "1" wins; divided by the content-free distribution, "4" does (Zhao et al.)."""
    review = [math.log(0.5), math.log(0.05), math.log(0.05), math.log(0.3), math.log(0.1)]
    prior = [math.log(0.8), math.log(0.05), math.log(0.05), math.log(0.05), math.log(0.05)]
    free = {p: prior for p in calibration_prompts("LaMP-3", "contextual")}
    llm = ScriptedLLM(lamp3_table({"review": review, **free}))
    assert answer(llm, "LaMP-3", ["review"], mode="choose", decision="argmax") == ["1"]
    reading = choose_labels(llm, "LaMP-3", ["review"], calibration="contextual", decision="argmax")
    # by hand: p / p_cf = (0.625, 1, 1, 6, 2), normalised by 10.625
    want = [0.625 / 10.625, 1 / 10.625, 1 / 10.625, 6 / 10.625, 2 / 10.625]
    assert reading.probabilities[0] == pytest.approx(want)
    assert reading.answers == ["4"]
    assert reading.terms == pytest.approx([math.log(p) for p in (0.8, 0.05, 0.05, 0.05, 0.05)])


def test_contextual_terms_average_the_content_free_distributions() -> None:
    """Three content-free inputs with different priors: the term is the log of their mean distribution."""
    rows = [[0.7, 0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.1, 0.1, 0.6], [0.4, 0.1, 0.1, 0.3, 0.1]]
    prompts = calibration_prompts("LaMP-3", "contextual")
    assert prompts == [content_free_prompt("LaMP-3", f) for f in CONTENT_FREE_INPUTS] and len(set(prompts)) == 3
    table = lamp3_table({p: [math.log(v) for v in row] for p, row in zip(prompts, rows)})
    table.update(lamp3_table({"x": [math.log(0.2)] * 5}))
    reading = choose_labels(ScriptedLLM(table), "LaMP-3", ["x"], calibration="contextual", decision="argmax")
    mean = [(a + b + c) / 3 for a, b, c in zip(*rows)]  # (0.4, 0.1, 0.1, 0.15, 0.25)
    assert reading.terms == pytest.approx([math.log(m) for m in mean])
    # a flat prompt read against that prior answers the label the prior likes least
    assert reading.answers == ["2"] and reading.probabilities[0][1] == pytest.approx(reading.probabilities[0][2])


def test_pmi_subtracts_the_domain_premise() -> None:
    """Holtzman et al.'s domain-conditional PMI: log p(y | prompt) - log p(y | the instruction alone)."""
    premise = domain_premise("LaMP-2")
    assert calibration_prompts("LaMP-2", "pmi") == [premise] and "{" not in premise
    table = {("p", "comedy"): -1.0, ("p", "sci-fi"): -0.5, (premise, "comedy"): -4.0, (premise, "sci-fi"): -0.2}
    llm = ScriptedLLM(table)  # every other (prompt, tag) scores -10
    assert answer(llm, "LaMP-2", ["p"], mode="choose") == ["sci-fi"]
    assert answer(llm, "LaMP-2", ["p"], mode="choose", calibration="pmi") == ["comedy"]  # -1 + 4 > -0.5 + 0.2


def test_the_median_differs_from_the_arg_max_and_the_mean_from_both() -> None:
    probs = [0.4, 0.05, 0.05, 0.1, 0.4]  # arg max "1" (tie with "5": the earlier), cumulative 0.5 at "3"
    assert decide(SCORES, probs, "argmax") == "1"
    assert decide(SCORES, probs, "median") == "3"
    assert decide(SCORES, [0.5, 0.0, 0.0, 0.0, 0.5], "median") == "1"  # the first label reaching 1/2
    assert decide(SCORES, [0.5, 0.0, 0.0, 0.0, 0.5], "mean") == "3"
    assert decide(SCORES, [0.0, 0.0, 0.5, 0.5, 0.0], "mean") == "4"  # 3.5 rounds up
    assert decide(SCORES, [0.0, 0.3, 0.0, 0.0, 0.7], "mean") == "4"  # 4.1
    llm = ScriptedLLM(lamp3_table({"p": [math.log(p) for p in probs]}))
    assert answer(llm, "LaMP-3", ["p"], mode="choose") == ["3"]  # LaMP-3's default: the median (MAE)
    assert answer(llm, "LaMP-3", ["p"], mode="choose", decision="argmax") == ["1"]


def test_decision_defaults_follow_the_metric_and_refuse_unordered_labels() -> None:
    assert resolve_decision("LaMP-3") == "median" and resolve_decision("LaMP-2") == "argmax"
    assert resolve_decision("LaMP-1", "argmax") == "argmax" and resolve_decision("lamp3", "mean") == "mean"
    with pytest.raises(ValueError, match="ordered labels"):
        resolve_decision("LaMP-2", "median")
    with pytest.raises(ValueError, match="unknown decision"):
        resolve_decision("LaMP-3", "mode")
    with pytest.raises(ValueError, match="unknown calibration"):
        LLMConfig(answer_mode="choose", calibration="platt")  # type: ignore[arg-type]
    assert calibrated([0.0, float("nan")], None) == pytest.approx([1.0, 0.0])  # NaN never wins


def test_a_changed_reading_re_reads_the_cached_scores(tmp_path: Path) -> None:
    """The prompt store keeps label scores and terms, not answers: another calibration or decision costs no LLM
    call, and the answers change with the rule; a stored reading re-reads the same."""
    prompts = [f"review {i}" for i in range(6)]
    table = lamp3_table({p: [-0.2, -3.0, -2.5, -1.0, -1.5] for p in prompts})
    table.update(lamp3_table({p: [-0.1, -3.0, -3.0, -3.0, -3.0] for p in calibration_prompts("LaMP-3", "contextual")}))
    llm = ScriptedLLM(table)
    store = PromptStore(tmp_path / "store")
    plain = LLMConfig(answer_mode="choose", decision="argmax")
    assert LLMReader(plain, llm, store).answer_prompts("LaMP-3", prompts) == ["1"] * 6
    assert llm.pairs == 6 * 5
    calibrated_config = LLMConfig(answer_mode="choose", calibration="contextual")
    reading = LLMReader(calibrated_config, llm, store).read_prompts("LaMP-3", prompts, every_calibration=True)
    assert llm.pairs == 6 * 5 + 4 * 5  # the scores from the store; every calibration's prompts: 3 content-free, 1 premise
    assert set(reading.answers) == {"4"} and reading.decision == "median"
    assert plain.reading("LaMP-3") == {"calibration": "none", "decision": "argmax"}
    assert LLMConfig(answer_mode="generate").reading("LaMP-3") == {}
    rows = reading.to_json([str(i) for i in range(6)])["rows"]
    assert rows[0]["answer"] == "4" and sum(rows[0]["p"]) == pytest.approx(1.0, abs=1e-4)
    again = reading.under("none", "argmax")  # the stored scores under the uncalibrated rule: no LLM
    assert again.answers == ["1"] * 6 and llm.pairs == 6 * 5 + 4 * 5
    stored = LabelReading.from_json(json.loads(json.dumps(reading.to_json([str(i) for i in range(6)]))))
    assert stored.answers == reading.answers and stored.under("pmi").answers == reading.under("pmi").answers


def test_tiny_model_terms_are_its_content_free_scores(tiny_llm: str) -> None:
    """With a real (random) model: the terms are the log of the mean distribution its own `score_options` gives
    the content-free prompts (chat template and all), and the answers follow them."""
    from persrag_lightning.llm import load_llm
    from persrag_lightning.reading.decision import log_softmax

    llm = load_llm("hf", tiny_llm, device="cpu")
    prompts = ['"review":fine product; "score":', '"review":broke in a day; "score":']
    reading = choose_labels(llm, "LaMP-3", prompts, calibration="contextual", decision="argmax")
    free = [log_softmax(r) for r in llm.score_options(calibration_prompts("LaMP-3", "contextual"), list(SCORES))]
    mean = [sum(math.exp(r[i]) for r in free) / 3 for i in range(5)]
    assert reading.terms == pytest.approx([math.log(m) for m in mean], abs=1e-5)
    for got, want in zip(reading.log_scores, llm.score_options(prompts, list(SCORES))):
        assert got == pytest.approx(want, abs=1e-5)
    for row, probs in zip(reading.log_scores, reading.probabilities):
        shifted = [v - math.log(m) for v, m in zip(row, mean)]
        assert probs.index(max(probs)) == shifted.index(max(shifted))


def test_without_a_store_the_terms_are_scored_once_per_model_and_task() -> None:
    """Serving reads without a prompt store: each request scores its own prompt, the calibration's prompts once."""
    table = lamp3_table({p: [-0.1, -3.0, -3.0, -3.0, -3.0] for p in calibration_prompts("LaMP-3", "contextual")})
    table.update(lamp3_table({"request": [-0.2, -3.0, -2.5, -1.0, -1.5]}))
    llm = ScriptedLLM(table)
    config = LLMConfig(answer_mode="choose", calibration="contextual", decision="argmax")
    assert LLMReader(config, llm).answer_prompts("LaMP-3", ["request"]) == ["4"]
    assert llm.pairs == 5 + 3 * 5
    assert LLMReader(config, llm).answer_prompts("LaMP-3", ["request"]) == ["4"]
    assert llm.pairs == 5 + 3 * 5 + 5


def test_reread_labels_prints_every_rule_of_a_stored_row(tmp_path: Path) -> None:
    """benchmarks/reread_labels.py on a stored row: one line per (calibration, decision), its answers and MAE."""
    import subprocess
    import sys

    from tests.conftest import REPO

    reading = LabelReading("LaMP-3", SCORES, [[-0.1, -3.0, -3.0, -1.0, -3.0], [-0.1, -3.0, -3.0, -3.0, -1.0]],
                           "none", "median", {"none": None, "contextual": [-0.01] + [-5.0] * 4, "pmi": [0.0] * 5})
    (tmp_path / "predictions").mkdir()
    (tmp_path / "predictions" / "CFRAG.labels.json").write_text(json.dumps(reading.to_json(["a", "b"], ["4", "5"])))
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "reread_labels.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "| none | median | 1 2 | 3.500 |" in out  # "1" for golds 4 and 5
    assert "| contextual | argmax | 4 1, 5 1 | 0.000 |" in out  # the prior divided out: each review read right
    assert out.count("\n| ") == 1 + 9  # the header and 3 calibrations x 3 decisions
