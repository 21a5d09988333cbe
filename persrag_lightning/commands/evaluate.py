"""`persrag evaluate`: strategies × split → predictions, metrics.json, results.md and results.png."""

from __future__ import annotations

from pathlib import Path

from persrag_lightning.commands.train import check_task, resolve_config_args


def evaluate_command(args: list[str]) -> dict:
    """`persrag evaluate --config evaluate_cfrag.yaml [--max-examples N] [--split dev]`: strategies × split (test
    by default) → predictions, metrics.json, results.md (Table 2 layout with intervals) and results.png; prints
    the table and returns the point results."""
    from persrag_lightning.evaluation.evaluate import (
        Evaluation,
        evaluate_parser,
        only_names,
        rename_strategies,
    )
    from persrag_lightning.retrieval.strategies import bind_strategies, substitute_run_dir

    args = resolve_config_args(args)
    section = personabench_section(args)
    if section is not None:
        return personabench_command(section)
    section = personabench_section(args, kind="memory")
    if section is not None:
        return memory_command(section)
    parser = evaluate_parser(description=evaluate_command.__doc__)
    aliases = {"--max-examples": "--evaluation.max_examples", "--split": "--evaluation.split"}
    args = resolve_config_args([next((a.replace(k, v, 1) for k, v in aliases.items() if a.startswith(k)), a)
                                for a in args])
    cfg = parser.parse_args(args)
    run_dir = str(Path(cfg.export_root) / cfg.run_name)
    cfg = substitute_run_dir(cfg, run_dir)
    if cfg.evaluation.out_dir == "runs/synthlamp/evaluate":
        cfg.evaluation.out_dir = str(Path("runs") / cfg.run_name / "evaluate")
    check_task(cfg.evaluation.task)
    init = parser.instantiate_classes(cfg)
    evaluation: Evaluation = init.evaluation
    strategies = init.strategies
    bind_strategies(strategies)  # "+ tuned generator" rows retrieve as the strategy they name, even one not in --only
    names = rename_strategies(strategies, cfg.names or {})
    evaluation.rename(names)
    if cfg.only is not None:
        only = [names.get(n, n) for n in only_names(cfg.only)]
        unknown = set(only) - {s.name for s in strategies}
        if unknown:
            raise SystemExit(f"persrag evaluate: --only names strategies not in the config: {sorted(unknown)}")
        strategies = [s for s in strategies if s.name in only]
    summary = evaluation.run(strategies)
    print(evaluation.table(summary, evaluation.skipped))
    print(f"reports in {evaluation.out_dir}")
    return summary.results


def personabench_section(args: list[str], kind: str = "personabench") -> dict | None:
    """The `evaluation` section of a PersonaBench config (`kind: personabench`; or of another `kind`, e.g. the
    memory evaluation's) with `--evaluation.x=v` overrides applied (values parsed as YAML), or None for a LaMP
    config."""
    import yaml

    config = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")),
                  next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None))
    if config is None or not Path(config).is_file():
        return None
    section = (yaml.safe_load(Path(config).read_text()) or {}).get("evaluation") or {}
    if section.get("kind") != kind:
        return None
    pairs = [a.split("=", 1) for a in args if a.startswith("--evaluation.") and "=" in a]
    pairs += [[a, args[i + 1]] for i, a in enumerate(args[:-1]) if a.startswith("--evaluation.") and "=" not in a]
    for key, value in pairs:
        *path, leaf = key.removeprefix("--evaluation.").split(".")
        node = section
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return section


def personabench_command(section: dict) -> dict:
    """PBR variants on a PersonaBench community (evaluation/personabench_eval.py): prints and writes the table."""
    from persrag_lightning.evaluation.personabench_eval import config_from_dict, run_personabench

    report = run_personabench(config_from_dict(section))
    print(report.markdown())
    return {s.variant: {"recall@5": s.recall, "ndcg@5": s.ndcg} for s in report.summaries}


def memory_command(section: dict) -> dict:
    """What remembered facts add (evaluation/memory_eval.py): planted facts, questions, answers, counted."""
    from persrag_lightning.evaluation.memory_eval import MemoryEvalConfig, run_memory_evaluation
    from persrag_lightning.llm.registry import LLMConfig

    section = {k: v for k, v in section.items() if k != "kind"}
    llm = LLMConfig(**section.pop("llm", {}) or {})
    known = set(MemoryEvalConfig.__dataclass_fields__)
    unknown = sorted(set(section) - known)
    if unknown:
        raise SystemExit(f"persrag evaluate: unknown memory evaluation settings {unknown}; known: {sorted(known)}")
    cfg = MemoryEvalConfig(**section, llm=llm)
    if not (Path(cfg.run_dir) / "docstore").is_dir():
        raise FileNotFoundError(f"{cfg.run_dir}/docstore: no exported run; train one first "
                                "(`python train.py pipeline --preset quick`)")
    results = run_memory_evaluation(cfg)
    print((Path(cfg.out_dir) / "results.md").read_text())  # the table with its extraction counts, as written
    print(f"reports in {cfg.out_dir}")
    return {r.name: {"recall@k": r.recall_at_k, "answer_hits": r.answer_hits} for r in results}
