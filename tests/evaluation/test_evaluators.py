"""The evaluator contract (evaluation/base.py): the three evaluators a config selects by class_path, one report."""

from __future__ import annotations

import pytest

from persrag_lightning.commands.evaluate import evaluate_command
from persrag_lightning.commands.train import resolve_config_args
from persrag_lightning.evaluation.arguments import evaluate_parser
from persrag_lightning.evaluation.base import EvaluationReport, Evaluator
from persrag_lightning.evaluation.evaluate import Evaluation
from persrag_lightning.evaluation.memory_eval import MemoryEvaluation
from persrag_lightning.evaluation.personabench_eval import PersonaBenchEvaluation
from persrag_lightning.retrieval.baselines import ZeroShot
from persrag_lightning.utils import ConfigError
from tests.data.test_personabench import write_community


@pytest.mark.parametrize("config, cls, primary, greater", [
    ("evaluate_cfrag.yaml", Evaluation, "accuracy", True),
    ("evaluate_personabench.yaml", PersonaBenchEvaluation, "recall@5", True),
    ("evaluate_memory.yaml", MemoryEvaluation, "answer_hits", True),
])
def test_each_config_selects_its_evaluator(config, cls, primary, greater):
    parser = evaluate_parser()
    cfg = parser.parse_args(resolve_config_args(["--config", config]))
    evaluator = parser.instantiate_classes(cfg).evaluation
    assert type(evaluator) is cls and isinstance(evaluator, Evaluator)
    assert (evaluator.primary_metric, evaluator.greater_is_better) == (primary, greater)


def test_overrides_reach_the_evaluator_and_misspelt_keys_are_refused(capsys, tmp_path):
    parser = evaluate_parser()
    cfg = parser.parse_args(resolve_config_args(["--config", "evaluate_personabench.yaml", "--evaluation.pbr.theta=0.5",
                                                 "--evaluation.variants=[Base]"]))
    evaluator = parser.instantiate_classes(cfg).evaluation
    assert evaluator.pbr.theta == 0.5 and evaluator.variants == ["Base"]
    with pytest.raises(SystemExit):
        parser.parse_args(resolve_config_args(["--config", "evaluate_memory.yaml", "--evaluation.userz=3"]))
    assert "userz" in capsys.readouterr().err
    regression = parser.parse_args(["--evaluation.task=LaMP-3"])
    assert regression.evaluation.class_path.endswith("evaluate.Evaluation")  # a config naming none: LaMP's
    assert Evaluation(task="LaMP-3", cache_dir=str(tmp_path)).greater_is_better is False  # MAE


def test_personabench_runs_through_the_contract(tmp_path, tiny_bert, capsys):
    folder = write_community(tmp_path / "c0")
    report = evaluate_command(["--config", "evaluate_personabench.yaml", f"--evaluation.data_dir={folder}",
                               "--evaluation.variants=[PBR w/o P-PRF, Base]", "--evaluation.warm_rerun=false",
                               f"--evaluation.encoder={tiny_bert}", "--evaluation.bootstrap_samples=20",
                               f"--evaluation.cache_dir={tmp_path / 'cache'}",
                               f"--evaluation.out_dir={tmp_path / 'out'}"])
    results = report.results
    assert set(results) == {"PBR w/o P-PRF", "Base"} and set(results["Base"]) == {"recall@5", "ndcg@5"}
    assert report.readings == {}  # rows of retrieval metrics: no label scores
    # the process's GEMM choice is announced once, by whichever model converts first: this test's when it runs alone
    printed = "".join(line for line in capsys.readouterr().out.splitlines(keepends=True)
                      if not line.startswith("[runtime] "))
    assert printed == (tmp_path / "out" / "table.md").read_text() + f"\nreports in {tmp_path / 'out'}\n"


def test_evaluators_with_their_own_rows_refuse_a_strategies_list(tmp_path):
    with pytest.raises(ConfigError, match="evaluation.variants"):
        PersonaBenchEvaluation(out_dir=str(tmp_path)).evaluate([ZeroShot()])
    with pytest.raises(ConfigError, match="at least one strategy"):
        Evaluation(cache_dir=str(tmp_path)).evaluate([])
    report = EvaluationReport("recall@5", True, "", {"a": {"recall@5": 0.5}, "b": {"recall@5": None}})
    assert report.primary() == {"a": 0.5}
