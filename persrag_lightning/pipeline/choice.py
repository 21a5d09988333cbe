"""The dev choice: the CFRAG configurations it compares, the names the tables give them, the rows
the table reports around the chosen one, and the choosing, made on dev, never on test. Every choice
the main job makes (who reads, which configuration, the LLM's and the tuned generator's calibrations)
goes through `choose_on_dev`.

The candidates are rows of evaluate_cfrag.yaml: the main chain's reranked order and its first
stage's order, each with its "w/o user retrieval" row (the same chain and order with m = 1). The
paper's text-only chain is a reported row, not a candidate: the paired chain beats it on dev in
either order (docs/performance/main-job.md). With a preset's `split_reranker` the reranked order's
candidates are the split reranker's (`SPLIT_ROWS`), the order serving can compute within its budget;
stage 3's exact reranker stays a reported row.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from persrag_lightning.pipeline.runs import EvaluationRun
from persrag_lightning.presets import Preset
from persrag_lightning.utils import ConfigError

if TYPE_CHECKING:
    from persrag_lightning.evaluation.base import EvaluationReport

__all__ = ["CANDIDATES", "EVERY_CANDIDATE", "GATES", "ORDER_ROW", "SPLIT_ROWS", "TUNED", "DevChoice", "chain_names", "check_rows",
           "choose_on_dev", "dev_candidates", "report_rows", "table_name"]

# each order of the main chain → its "w/o user retrieval" row
CANDIDATES = {"CFRAG": "w/o user retrieval",
              "w/o reranker tuning": "w/o user retrieval (first-stage order)"}
# the neighbour gate's configurations (a preset's gate_on_dev): at most 2 neighbours' docs, or none
GATES = {"CFRAG, ≤ 2 neighbour docs": "w/o user retrieval",
         "w/o reranker tuning, ≤ 2 neighbour docs": "w/o user retrieval (first-stage order)",
         "w/o user retrieval": "w/o user retrieval",
         "w/o user retrieval (first-stage order)": "w/o user retrieval (first-stage order)"}
# a reranked candidate → the same configuration reranked by the split reranker (a preset's `split_reranker`)
SPLIT_ROWS = {"CFRAG": "CFRAG (split reranker)",
              "CFRAG, ≤ 2 neighbour docs": "CFRAG (split reranker), ≤ 2 neighbour docs",
              "w/o user retrieval": "w/o user retrieval (split reranker)"}
EVERY_CANDIDATE = {**CANDIDATES, **GATES}
EVERY_CANDIDATE |= {SPLIT_ROWS[c]: SPLIT_ROWS.get(w, w) for c, w in EVERY_CANDIDATE.items() if c in SPLIT_ROWS}
TUNED = " + tuned generator"
STAGE_ONE_READS = {"paired": "judgments", "profile": "judgment profile", "label": "label judgments",
                   "none": "text only"}
ORDER_ROW = "w/o user retrieval{order}"  # a preset's row: the chosen order's "w/o user retrieval" row


def chain_names(judgments: str) -> dict[str, str]:
    """The table's names of the dev choice's candidates: what stage 1 of the main chain reads and
    which order its docs take. evaluate_cfrag.yaml names the first-stage order by its ablation ("w/o
    reranker tuning"), which reads as a loss of the recipe when dev chooses it: in the pipeline's
    tables it is a configuration of CFRAG.

    Args:
        judgments: what stage 1 reads per history doc (`paired`, `profile`, `label`, `none`).
    """
    reads = STAGE_ONE_READS[judgments]
    return {"CFRAG": f"CFRAG ({reads}, reranked)", "w/o reranker tuning": f"CFRAG ({reads}, first-stage order)",
            "CFRAG, ≤ 2 neighbour docs": f"CFRAG ({reads}, reranked, ≤ 2 neighbour docs)",
            "w/o reranker tuning, ≤ 2 neighbour docs": f"CFRAG ({reads}, first-stage order, ≤ 2 neighbour docs)",
            SPLIT_ROWS["CFRAG"]: f"CFRAG ({reads}, split reranker)",
            SPLIT_ROWS["CFRAG, ≤ 2 neighbour docs"]: f"CFRAG ({reads}, split reranker, ≤ 2 neighbour docs)"}


def dev_candidates(preset: Preset) -> list[str]:
    """The configurations the dev choice compares: the main chain's two orders, and with the
    preset's `gate_on_dev` each order with at most 2 neighbours' docs and with none; with its
    `split_reranker` the reranked ones by the split reranker.

    Args:
        preset: the run's preset.
    """
    candidates = list({**CANDIDATES, **GATES} if preset.gate_on_dev else CANDIDATES)
    return [SPLIT_ROWS.get(c, c) for c in candidates] if preset.split_reranker else candidates


def table_name(name: str, names: dict[str, str]) -> str:
    """A config strategy's name in the tables (`--names`), a "+ tuned generator" row following its
    retrieval's.

    Args:
        name: the row's name in evaluate_cfrag.yaml.
        names: the table's names of the candidates (`chain_names`).
    """
    if name.endswith(TUNED) and name.removesuffix(TUNED) in names:
        return names[name.removesuffix(TUNED)] + TUNED
    return names.get(name, name)


def report_rows(preset: Preset, chosen: str, paper_chain: bool) -> list[str] | None:
    """The preset's reported rows with `{chosen}` / the chosen order's "w/o user retrieval" filled
    in (both orders are rows: CFRAG and "w/o reranker tuning", and with `split_reranker` the split
    reranker's beside CFRAG; a gated choice is put before its "w/o user retrieval" row); without the
    paper's chain trained, no row of it.

    Args:
        preset: the run's preset (its `rows`; None: every strategy of the config).
        chosen: the configuration chosen on dev.
        paper_chain: whether the paper's chain trains beside the main one.
    """
    if preset.rows is None:
        return None
    rows = [r.replace("{chosen}", chosen) for r in preset.rows]
    rows = [r2 for r in rows for r2 in ([chosen, EVERY_CANDIDATE[chosen]] if r == ORDER_ROW else [r])]
    if preset.split_reranker:  # the reranked order dev compared, beside stage 3's
        rows = [r2 for r in rows for r2 in ([r, SPLIT_ROWS[r]] if r == "CFRAG" else [r])]
    if not paper_chain:
        rows = [r for r in rows if "(paper" not in r]
    return list(dict.fromkeys(rows))


def check_rows(preset: Preset, name: str) -> None:
    """Refuse, before anything trains, a preset row that evaluate_cfrag.yaml does not have (one
    line, exit 2).

    Args:
        preset: the run's preset.
        name: the preset's name or file, as the error names it.
    """
    from persrag_lightning.retrieval.strategies import strategy_names

    known = set(strategy_names("evaluate_cfrag.yaml"))
    for row in preset.rows or []:
        chosen = [row.replace("{chosen}", c) for c in dev_candidates(preset)] if "{chosen}" in row else [row]
        if row != ORDER_ROW and not set(chosen) <= known:
            raise ConfigError(f"{Path(name).name}: rows: {row!r} is no strategy of evaluate_cfrag.yaml; it has "
                              f"{', '.join(sorted(known))}")


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
