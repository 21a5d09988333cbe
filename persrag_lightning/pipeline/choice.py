"""The dev choice: the best of an evaluation's rows by its primary metric, made on dev, never on
test. Every choice the main job makes (who reads, which configuration, the LLM's and the tuned
generator's calibrations) goes through `choose_on_dev`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from persrag_lightning.pipeline.candidates import table_name
from persrag_lightning.pipeline.runs import EvaluationRun

if TYPE_CHECKING:
    from persrag_lightning.evaluation.base import EvaluationReport

__all__ = ["DevChoice", "choose_on_dev"]


class DevChoice(NamedTuple):
    """What a dev choice chose, by its config name, and the dev scores it chose on (by the rows'
    labels in the tables)."""

    name: str
    calibration: str | None
    scores: dict[str, float]


def choose_on_dev(report: EvaluationReport, run: EvaluationRun, calibrations: list[str] | None = None) -> DevChoice:
    """The best of `run`'s rows by the report's primary metric, with the dev numbers. With
    `calibrations` (label calibrations), each row read as label scores is re-read under each
    calibration from the report (no LLM pass, no file) and the best (configuration, calibration)
    pair is chosen (`evaluation.selection`); a candidate whose dev answers equal an earlier one's is
    no choice, and the lines say so.

    Args:
        report: the dev evaluation's report.
        run: the dev evaluation (`Job.dev_evaluation`): its rows are the candidates, in the order of
            preference.
        calibrations: the LLM reader's calibrations to re-read each row under (None: as read).
    """
    from persrag_lightning.evaluation.selection import row_options, select

    options = row_options(report, {n: table_name(n, run.names) for n in run.only or []}, calibrations)
    if not options:
        raise SystemExit("persrag pipeline: no CFRAG configuration could be evaluated on dev")
    selection = select(options, report.greater_is_better)
    for option, twin in selection.twins:
        print(f"[pipeline] dev answers of {option.label} are identical to {twin.label}'s: no choice between "
              f"them, {twin.label} stands")
    print(f"[pipeline] chosen on dev ({report.primary_metric}): {selection.chosen.label} — "
          + ", ".join(f"{o.label} {o.score:.3f}" for o in selection.options))
    name, calibration = selection.chosen.key
    return DevChoice(name, calibration, selection.scores)
