"""`persrag evaluate`: the evaluator a config names (LaMP strategies × split, PersonaBench, memory) → its reports."""

from __future__ import annotations

from pathlib import Path

from persrag_lightning.commands.train import check_task, resolve_config_args

# the short flags `persrag evaluate` takes for its evaluation's settings (either flag style)
SHORT_FLAGS = {"--max_examples": "--evaluation.max_examples", "--max-examples": "--evaluation.max_examples",
               "--split": "--evaluation.split"}


def evaluate_args(args: list[str]) -> list[str]:
    """The arguments with `--config` names resolved and SHORT_FLAGS spelled out, as the evaluate parser reads them."""
    return resolve_config_args([next((a.replace(k, v, 1) for k, v in SHORT_FLAGS.items() if a.startswith(k)), a)
                                for a in resolve_config_args(args)])


def evaluate_command(args: list[str]) -> dict:
    """`persrag evaluate --config evaluate_cfrag.yaml [--max_examples N] [--split dev]`: runs the config's evaluator
    (`evaluation:`, by class_path; LaMP's by default: strategies × split, test by default → predictions,
    metrics.json, results.md in Table 2's layout with intervals, results.png); prints the table and returns the
    raw results."""
    from persrag_lightning.evaluation.base import Evaluator
    from persrag_lightning.evaluation.evaluate import evaluate_parser, only_names, rename_strategies
    from persrag_lightning.retrieval.strategies import bind_strategies, substitute_run_dir

    parser = evaluate_parser(description=evaluate_command.__doc__)
    cfg = parser.parse_args(evaluate_args(args))
    cfg = substitute_run_dir(cfg, str(Path(cfg.export_root) / cfg.run_name))
    settings = cfg.evaluation.init_args
    if getattr(settings, "out_dir", None) == "runs/synthlamp/evaluate":  # the LaMP default follows --run_name
        settings.out_dir = str(Path("runs") / cfg.run_name / "evaluate")
    check_task(getattr(settings, "task", None), getattr(settings, "data_dir", None))
    init = parser.instantiate_classes(cfg)
    evaluator: Evaluator = init.evaluation
    strategies = init.strategies
    bind_strategies(strategies)  # "+ tuned generator" rows retrieve as the strategy they name, even one not in --only
    names = rename_strategies(strategies, cfg.names or {})
    evaluator.rename(names)
    if cfg.only is not None:
        only = [names.get(n, n) for n in only_names(cfg.only)]
        unknown = set(only) - {s.name for s in strategies}
        if unknown:
            raise SystemExit(f"persrag evaluate: --only names strategies not in the config: {sorted(unknown)}")
        strategies = [s for s in strategies if s.name in only]
    report = evaluator.evaluate(strategies)
    print(report.table)
    if report.out_dir is not None:
        print(f"reports in {report.out_dir}")
    return report.results
