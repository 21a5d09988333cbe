"""Dev choices: which of several candidates a run takes (a CFRAG configuration, a label calibration,
a reader), decided on the dev split by the evaluation's primary metric, never on test.

A candidate whose dev answers equal an earlier one's is no choice: it is set aside and the earlier
one stands (choosing between identical columns would be choosing on noise). Among the rest the best
score wins, and a tie keeps the earlier candidate, so the order the candidates are listed in is the
order of preference. A row read as label scores is re-read under each calibration from the report's
`LabelReading`: no LLM call, no file.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from persrag_lightning.evaluation.base import EvaluationReport
from persrag_lightning.evaluation.stats import LampMetricFn

__all__ = ["Option", "Selection", "row_options", "select"]


@dataclass(frozen=True)
class Option:
    """One candidate of a dev choice.

    Args:
        key: what is chosen (a row's config name with its calibration, a reader).
        label: its name in the lines a run prints and in its record.
        score: its dev score on the primary metric.
        answers: its dev answers where two candidates' answers can be compared (None: never a twin).
    """

    key: Hashable
    label: str
    score: float
    answers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Selection:
    """What a dev choice decided: the chosen option, every option in order, and the twins set aside.

    Args:
        chosen: the best distinct option (ties: the earlier).
        options: every option, in the order given.
        twins: (option, the earlier option whose dev answers it repeats), each set aside.
    """

    chosen: Option
    options: tuple[Option, ...]
    twins: tuple[tuple[Option, Option], ...] = ()

    @property
    def scores(self) -> dict[str, float]:
        """Every option's dev score by its label (twins included), as a run records them."""
        return {o.label: o.score for o in self.options}


def row_options(report: EvaluationReport, rows: Mapping[str, str],
                calibrations: Sequence[str] | None = None) -> list[Option]:
    """The options of a dev evaluation's rows: each row as it was evaluated, or, with
    `calibrations`, each row that was read as label scores under each calibration (key: (name,
    calibration); calibration None: as evaluated).

    Args:
        report: the dev evaluation's report.
        rows: name → the row's name in the report (the table's), in the order of preference; a row
            the report lacks (its bundle not trained) is no option.
        calibrations: the label calibrations to re-read stored scores under (None: the evaluation's
            numbers).
    """
    metric, out = report.primary_metric, []
    for name, row in rows.items():
        if row not in report.results:
            continue
        reading = report.readings.get(row) if calibrations else None
        if reading is None:  # generated answers, or no scores: the evaluation's own number
            out.append(Option((name, None), row, report.results[row][metric]))
            continue
        score = LampMetricFn(reading.task, metric)
        for calibration in calibrations or ():
            said = reading.under(calibration, reading.decision).answers
            out.append(Option((name, calibration), f"{row} [calibration {calibration}]",
                              score(said, list(report.golds)), tuple(said)))
    return out


def select(options: Sequence[Option], greater_is_better: bool) -> Selection:
    """The dev choice among `options`: twins set aside, then the best score, ties to the earlier
    option.

    Args:
        options: the candidates, in the order of preference (at least one).
        greater_is_better: the primary metric's direction.
    """
    if not options:
        raise ValueError("a dev choice needs at least one option")
    distinct: list[Option] = []
    twins: list[tuple[Option, Option]] = []
    for option in options:
        twin = next((d for d in distinct if option.answers is not None and d.answers == option.answers), None)
        if twin is None:
            distinct.append(option)
        else:
            twins.append((option, twin))
    sign = 1 if greater_is_better else -1
    order = {id(o): i for i, o in enumerate(options)}
    chosen = max(distinct, key=lambda o: (sign * o.score, -order[id(o)]))
    return Selection(chosen, tuple(options), tuple(twins))
