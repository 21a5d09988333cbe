"""The one contract of every evaluator (as sentence-transformers' `SentenceEvaluator`): `evaluate`
runs it and returns an `EvaluationReport` with the primary metric and its direction, the table it
printed and wrote, and the raw results. An evaluate config names its evaluator by `class_path` under
`evaluation:` (the LaMP `Evaluation` when it names none).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from persrag_lightning.reading.label_reading import LabelReading
from persrag_lightning.retrieval.base import Strategy
from persrag_lightning.utils import ConfigError

__all__ = ["EvaluationReport", "Evaluator"]


@dataclass(frozen=True)
class EvaluationReport:
    """What one evaluation measured: rows (strategies, variants) × metrics, the table as written
    and, for rows read as label scores, the readings themselves, so a dev choice can re-read them
    under another calibration without the LLM and without reading a file back.

    Args:
        primary_metric: the results' metric a selection compares rows on (`metrics.primary_metric`
            for LaMP).
        greater_is_better: the primary metric's direction.
        table: the table, markdown, as written under out_dir.
        results: row → metric → value (the raw results).
        out_dir: where the reports were written (None: nowhere).
        readings: row → its `LabelReading` (every label's score and the calibration terms), for the
            rows a reader of labels answered; the others (generated answers, reader-free rows) have
            none.
        golds: the evaluated questions' golds, in the order of every reading's rows.
    """

    primary_metric: str
    greater_is_better: bool
    table: str
    results: dict[str, dict]
    out_dir: Path | None = None
    readings: dict[str, LabelReading] = field(default_factory=dict)
    golds: tuple[str, ...] = ()

    def primary(self) -> dict[str, float]:
        """Each row's primary metric (rows without it left out)."""
        return {row: m[self.primary_metric] for row, m in self.results.items()
                if m.get(self.primary_metric) is not None}


class Evaluator(ABC):
    """An evaluation a config selects by `class_path`; `strategies` are the config's top-level rows
    (LaMP's)."""

    greater_is_better: bool = True

    @property
    @abstractmethod
    def primary_metric(self) -> str:
        """The metric of `results` a selection compares on."""

    @abstractmethod
    def evaluate(self, strategies: Sequence[Strategy] = ()) -> EvaluationReport:
        """Run, write the reports under out_dir, return what was measured.

        Args:
            strategies: the config's `strategies` list; an evaluator whose rows are its own settings
                refuses a non-empty one.
        """

    def rename(self, names: dict[str, str]) -> None:
        """Follow `--names`' renames in the evaluator's own settings (none by default).

        Args:
            names: `--names`: config name → table name.
        """

    def refuse_strategies(self, strategies: Sequence[Strategy], own: str) -> None:
        """An evaluator whose rows are its own settings (`own`) rejects a config's `strategies`
        list.

        Args:
            strategies: the config's `strategies` list.
            own: the setting that lists this evaluator's rows, named in the error.
        """
        if strategies:
            raise ConfigError(
                f"strategies: {type(self).__name__} evaluates its own rows ({own}), not a "
                "`strategies` list"
            )
