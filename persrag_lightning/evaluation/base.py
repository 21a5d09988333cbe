"""The one contract of every evaluator (as sentence-transformers' `SentenceEvaluator`): `evaluate` runs it and returns
an `EvaluationReport` with the primary metric and its direction, the table it printed and wrote, and the raw results.
An evaluate config names its evaluator by `class_path` under `evaluation:` (the LaMP `Evaluation` when it names none).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from persrag_lightning.retrieval.base import Strategy
from persrag_lightning.utils import ConfigError


@dataclass(frozen=True)
class EvaluationReport:
    """What one evaluation measured: rows (strategies, variants) × metrics, and the table as written."""

    primary_metric: str  # the results' metric a selection compares rows on
    greater_is_better: bool
    table: str  # markdown, as written under out_dir
    results: dict[str, dict]  # row → metric → value (the raw results)
    out_dir: Path | None = None

    def primary(self) -> dict[str, float]:
        """Each row's primary metric (rows without it left out)."""
        return {row: m[self.primary_metric] for row, m in self.results.items()
                if m.get(self.primary_metric) is not None}


class Evaluator(ABC):
    """An evaluation a config selects by `class_path`; `strategies` are the config's top-level rows (LaMP's)."""

    greater_is_better: bool = True

    @property
    @abstractmethod
    def primary_metric(self) -> str:
        """The metric of `results` a selection compares on."""

    @abstractmethod
    def evaluate(self, strategies: Sequence[Strategy] = ()) -> EvaluationReport:
        """Run, write the reports under out_dir, return what was measured."""

    def rename(self, names: dict[str, str]) -> None:
        """Follow `--names`' renames in the evaluator's own settings (none by default)."""

    def refuse_strategies(self, strategies: Sequence[Strategy], own: str) -> None:
        """An evaluator whose rows are its own settings (`own`) rejects a config's `strategies` list."""
        if strategies:
            raise ConfigError(f"strategies: {type(self).__name__} evaluates its own rows ({own}), not a "
                              "`strategies` list")
