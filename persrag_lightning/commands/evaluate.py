"""`persrag evaluate`: the evaluator a config names (LaMP strategies × split, PersonaBench, memory)
→ its report.

From a command line (`evaluate_command`) or, inside one process, from the resolved configuration
object (`evaluation_config` → `run_evaluation`): the pipeline's evaluations take the object, and
write a command line only to print it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persrag_lightning.commands.train import check_task, resolve_config_args
from persrag_lightning.stages import fill_run_dir, run_folder
from persrag_lightning.utils import resolve_config_path

if TYPE_CHECKING:
    from jsonargparse import Namespace

    from persrag_lightning.evaluation.base import EvaluationReport

__all__ = ["evaluate_command", "evaluation_config", "for_run", "run_evaluation"]

# the short flags `persrag evaluate` takes for its evaluation's settings (either flag style)
SHORT_FLAGS = {"--max_examples": "--evaluation.max_examples", "--max-examples": "--evaluation.max_examples",
               "--split": "--evaluation.split"}


def evaluate_args(args: list[str]) -> list[str]:
    """The arguments with `--config` names resolved and SHORT_FLAGS spelled out, as the evaluate
    parser reads them.

    Args:
        args: the command line after `persrag evaluate`, as the user typed it.
    """
    return resolve_config_args([next((a.replace(k, v, 1) for k, v in SHORT_FLAGS.items() if a.startswith(k)), a)
                                for a in resolve_config_args(args)])


def evaluate_command(args: list[str]) -> EvaluationReport:
    """`persrag evaluate --config evaluate_cfrag.yaml [--max_examples N] [--split dev]`: runs the
    config's evaluator (`evaluation:`, by class_path; LaMP's by default: strategies × split, test by
    default → predictions, metrics.json, results.md in Table 2's layout with intervals,
    results.png); prints the table and returns the report.

    Args:
        args: the command line after `persrag evaluate`.
    """
    from persrag_lightning.evaluation.arguments import evaluate_parser

    return run_evaluation(
        evaluate_parser(description=evaluate_command.__doc__).parse_args(evaluate_args(args))
    )


@lru_cache(maxsize=8)
def _config_file(path: str, cwd: str) -> Namespace:
    """The values of one evaluate config file (cached per file and folder; used through clones)."""
    from persrag_lightning.evaluation.arguments import evaluate_parser

    return evaluate_parser().parse_args(["--config", path])


def evaluation_config(overrides: Mapping[str, Any], only: Sequence[str] | None = None,
                      names: Mapping[str, str] | None = None, config: str = "evaluate_cfrag.yaml") -> Namespace:
    """An evaluate configuration resolved as `persrag evaluate --config <config> --<key>=<value> ...
    --only ... --names ...` resolves it, without writing the typed values as text: the object
    `run_evaluation` takes.

    Args:
        overrides: dotted keys (`evaluation.split`, `run_name`) with typed values, applied after the
            file; None values are left out (the config's own value).
        only: the config's strategies to evaluate, by name (None: every one).
        names: the table's names of strategies of the config.
        config: the evaluate config file (a name of configs/ or a path).
    """
    from persrag_lightning.evaluation.arguments import evaluate_parser

    given = {k: v for k, v in overrides.items() if v is not None}
    given.update({"only": list(only)} if only is not None else {})
    given.update({"names": dict(names)} if names is not None else {})
    base = _config_file(resolve_config_path(config), os.getcwd())
    # the file's parse holds the defaults already: parsing them again would only repeat the work
    return evaluate_parser().parse_object(given, namespace=base.clone(), defaults=False)


def for_run(cfg: Namespace) -> Namespace:
    """A copy of an evaluate configuration as it runs for its run: `{run_dir}` filled with the run's
    folder, and the LaMP default `out_dir` following `run_name` (runs/<run_name>/evaluate)."""
    cfg = fill_run_dir(cfg.clone(), str(run_folder(cfg.export_root, cfg.run_name)))  # the caller keeps its own
    settings = cfg.evaluation.init_args
    if getattr(settings, "out_dir", None) == "runs/synthlamp/evaluate":
        settings.out_dir = str(Path("runs") / cfg.run_name / "evaluate")
    return cfg


def run_evaluation(cfg: Namespace) -> EvaluationReport:
    """Run a resolved evaluate configuration in this process: print the table and return the
    `EvaluationReport` (results, the primary metric and its direction, each label row's reading).

    Args:
        cfg: the parsed configuration (`evaluation_config`, or the evaluate parser's parse of a
            command line).
    """
    from persrag_lightning.evaluation.arguments import evaluate_parser, only_names, rename_strategies
    from persrag_lightning.evaluation.base import Evaluator
    from persrag_lightning.retrieval.strategies import bind_strategies

    cfg = for_run(cfg)
    settings = cfg.evaluation.init_args
    check_task(getattr(settings, "task", None), getattr(settings, "data_dir", None))
    init = evaluate_parser().instantiate_classes(cfg)
    evaluator: Evaluator = init.evaluation
    strategies = init.strategies
    # "+ tuned generator" rows retrieve as the strategy they name, even one not in --only
    bind_strategies(strategies)
    names = rename_strategies(strategies, cfg.names or {})
    evaluator.rename(names)
    if cfg.only is not None:
        only = [names.get(n, n) for n in only_names(cfg.only)]
        unknown = set(only) - {s.name for s in strategies}
        if unknown:
            raise SystemExit(
                f"persrag evaluate: --only names strategies not in the config: {sorted(unknown)}"
            )
        strategies = [s for s in strategies if s.name in only]
    report = evaluator.evaluate(strategies)
    print(report.table)
    if report.out_dir is not None:
        print(f"reports in {report.out_dir}")
    return report
