"""An evaluate config's command line: the parser of `persrag evaluate` (and of the pipeline's evaluations),
and what it reads back from `--only` and `--names`."""

from __future__ import annotations

from persrag_lightning.evaluation.base import Evaluator
from persrag_lightning.evaluation.evaluate import Evaluation
from persrag_lightning.retrieval.base import Strategy
from persrag_lightning.utils import ConfigError

__all__ = ["evaluate_parser", "only_names", "rename_strategies"]


def evaluate_parser(prog: str = "persrag evaluate", description: str | None = None):
    """The parser of an evaluate config (`run_name`, `evaluation`: an `Evaluator`, `strategies`,
    `only`, `names`).

    Args:
        prog: the program name shown in usage and errors.
        description: the help's description; None = the module's.
    """
    from jsonargparse import ActionConfigFile, ArgumentParser, lazy_instance

    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--run_name", type=str, default="synthlamp")
    parser.add_argument("--export_root", type=str, default="checkpoints")
    # any Evaluator by class_path (PersonaBench, memory); a config that names none is the LaMP
    # Evaluation
    parser.add_argument("--evaluation", type=Evaluator, default=lazy_instance(Evaluation))
    parser.add_argument("--strategies", type=list[Strategy], default=[])
    # dict: an unquoted name with ": " in a YAML list ('[CFRAG (users: cluster)]') parses as a
    # one-key mapping; `only_names` turns it back into the name the user typed instead of failing
    # with a type error
    parser.add_argument("--only", type=list[str | dict[str, str]] | None, default=None,
                        help="evaluate only these strategies of the config, by name (e.g. '[bm25, CFRAG]')")
    parser.add_argument("--names", type=dict[str, str] | None, default=None,
                        help="the table's name for a strategy of the config, e.g. '{\"CFRAG\": \"CFRAG "
                             "(judgments, reranked)\"}': its rows, predictions and paired tests take that name; "
                             "--only, reference, votes and pairs may use either")
    return parser


def only_names(only: list[str | dict[str, str]]) -> list[str]:
    """`--only`'s names, a `{"CFRAG (users": "cluster)"}` read back as "CFRAG (users: cluster)".

    Args:
        only: `--only` as parsed: names, a name holding ": " arriving as a one-key mapping.
    """
    return [n if isinstance(n, str) else ", ".join(f"{k}: {v}" for k, v in n.items()) for n in only]


def rename_strategies(strategies: list[Strategy], names: dict[str, str]) -> dict[str, str]:
    """Give the strategies named in `names` their new names, after `bind_strategies` (bound by the
    old ones). A "+ tuned generator" row over a renamed strategy follows it. Returns every rename
    made, old → new; a new name that another strategy already has is refused (one line, exit 2).

    Args:
        strategies: the bound strategies, renamed in place.
        names: config name → table name.
    """
    made = {}
    for s in strategies:
        wrapped = s.wrapped_name
        if s.name in names:
            made[s.name] = names[s.name]
        elif wrapped in names and s.name == f"{wrapped} + tuned generator":
            made[s.name] = f"{names[wrapped]} + tuned generator"
    unknown = set(names) - {s.name for s in strategies}
    if unknown:
        raise ConfigError(f"--names: {sorted(unknown)} name no strategy of the config")
    kept = {s.name for s in strategies} - set(made)
    clash = kept & set(made.values())
    if clash:
        raise ConfigError(
            f"--names: {sorted(clash)} is already the name of another strategy of the config"
        )
    for s in strategies:
        s.name = made.get(s.name, s.name)
    return made
