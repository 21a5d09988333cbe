"""A pipeline's stages and evaluations as objects: the config, every override as a typed value, and
for an evaluation the rows it reads and the names the table gives them.

A command line (`argv`) is written only where one is printed, or where a subprocess or an `sbatch`
needs it; inside the pipeline's process a `Runner` resolves each run to the configuration object
LightningCLI or the evaluate parser reads and runs it from there. Both come from the same overrides,
so the printed command is what ran. pipeline.json keeps each as it ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from persrag_lightning.stages import Key, cli_overrides, config_args

if TYPE_CHECKING:
    from jsonargparse import Namespace

    from persrag_lightning.evaluation.base import EvaluationReport

__all__ = ["DEV_SELECTION_EXAMPLES", "EVALUATE_CONFIG", "EvaluationRun", "Runner", "StageRun", "dev_evaluation"]

EVALUATE_CONFIG = "evaluate_cfrag.yaml"
DEV_SELECTION_EXAMPLES = 300  # dev questions the choice is made on: the quick preset's whole dev split


@dataclass
class StageRun:
    """One `train.py fit` of the job: the stage, its config and every override as a typed value,
    merged in the command line's order (a later source wins).

    Args:
        stage: the stage's name in stages.py.
        config: its config file (a name of configs/).
        overrides: dotted keys with typed values, applied after the file in order.
        extra: the pipeline's unknown arguments, passed on as the user typed them, last.
        overlays: config files laid over `config`, in order, before the overrides.
    """

    stage: str
    config: str
    overrides: dict[str, Any]
    extra: list[str] = field(default_factory=list)
    overlays: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        """The command line after `train.py` (printed; a subprocess or an sbatch script would run
        it)."""
        return ["fit", *config_args(self.config, self.overlays), *cli_overrides(self.overrides), *self.extra]


@dataclass
class EvaluationRun:
    """One `persrag evaluate` of the job over evaluate_cfrag.yaml.

    Args:
        purpose: what it is for (a dev choice, the test table), as pipeline.json names it.
        overrides: dotted keys of the evaluate config with typed values.
        only: the rows it reads, by config name (None: every one).
        names: the table's names of rows of the config.
    """

    purpose: str
    overrides: dict[str, Any]
    only: list[str] | None = None
    names: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        """The command line after `persrag evaluate` (printed; a subprocess would run it)."""
        only = [] if self.only is None else [f"--only={json.dumps(self.only)}"]
        return ["--config", EVALUATE_CONFIG, *cli_overrides(self.overrides), *only,
                f"--names={json.dumps(self.names)}"]


class Runner(Protocol):
    """What resolves and runs a job's stages and evaluations: the commands that own LightningCLI and
    the evaluate parser give it (`command.LocalRunner` runs both in this process)."""

    def stage_config(self, run: StageRun) -> Namespace:
        """The resolved `fit` configuration `run` trains from (what its `argv` resolves to)."""

    def fit(self, config: Namespace) -> None:
        """Train one stage from its resolved configuration."""

    def evaluation_config(self, run: EvaluationRun) -> Namespace:
        """The resolved evaluate configuration `run` evaluates (what its `argv` resolves to)."""

    def evaluate(self, config: Namespace) -> EvaluationReport:
        """Evaluate a resolved configuration: the table printed, the report returned."""


def dev_evaluation(base: dict[str, Any], candidates: list[str], run_name: str, names: dict[str, str],
                   folder: str = "select-on-dev") -> EvaluationRun:
    """The evaluation a dev choice reads: `candidates` on at most DEV_SELECTION_EXAMPLES dev
    questions (or `base`'s own count, e.g. from `--questions`), no reader-free rows, its tables in
    runs/<run_name>/<folder>/.

    Args:
        base: the job's overrides of every evaluation.
        candidates: the rows to choose among, by config name, in the order of preference.
        run_name: the job's run name.
        names: the table's names of rows of the config.
        folder: the folder under runs/<run_name>/ its tables go to.
    """
    return EvaluationRun(f"dev choice: {folder}", {Key.MAX_EXAMPLES: DEV_SELECTION_EXAMPLES, **base,
                                                   Key.SPLIT: "dev", Key.READER_FREE: False,
                                                   Key.OUT_DIR: f"runs/{run_name}/{folder}"},
                         candidates, names)
