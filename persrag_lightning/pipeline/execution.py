"""Running a job: its stages and evaluations through a `Runner`, each timed, what ran kept (`Ran`),
and pipeline.json beside the run's bundles, written from the resolved job and what ran: the raw
record a table of main-job times and a test of the recipe read, and serving's default (record.py
reads it back)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from persrag_lightning.pipeline.choice import DevChoice, choose_on_dev, table_name
from persrag_lightning.pipeline.job import READER_ROWS, Job
from persrag_lightning.pipeline.plan import Plan
from persrag_lightning.pipeline.runs import EvaluationRun, Runner, StageRun
from persrag_lightning.reading import LLM_READER
from persrag_lightning.record import RECORD
from persrag_lightning.stages import run_folder
from persrag_lightning.utils import atomic_write_json

if TYPE_CHECKING:
    from persrag_lightning.evaluation.base import EvaluationReport

__all__ = ["JobRun", "Ran", "print_minutes", "write_record"]


@dataclass
class Ran:
    """What a job ran, as pipeline.json keeps it: each stage's fit and each evaluation as they ran,
    and the minutes of each step."""

    stages: list[StageRun] = field(default_factory=list)
    evaluations: list[EvaluationRun] = field(default_factory=list)
    minutes: dict[str, float] = field(default_factory=dict)


class JobRun:
    """A job's stages and evaluations run through `runner`, in this process, each timed into `ran`.

    Args:
        runner: what resolves and runs a stage or an evaluation.
    """

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.ran = Ran()

    def fit(self, job: Job, stage: str, more: dict[str, Any] | None = None) -> None:
        """Train `stage` unless its bundle is exported already; its command line is printed, as a
        user would run the stage alone.

        Args:
            job: the job under the decisions made so far.
            stage: a stage of stages.py.
            more: overrides of this fit alone.
        """
        if job.exported(stage):
            print(f"[pipeline] {stage}: exported already, skipped")
            return
        run = job.stage_run(stage, more)
        print(f"[pipeline] {stage}: python train.py {' '.join(run.argv())}")
        t0 = time.perf_counter()
        self.runner.fit(self.runner.stage_config(run))
        self.ran.stages.append(run)
        self.ran.minutes[stage] = (time.perf_counter() - t0) / 60

    def evaluate(self, run: EvaluationRun, step: str | None = None) -> EvaluationReport:
        """Run an evaluation, kept in `ran`, its minutes under `step` (None: not timed alone)."""
        t0 = time.perf_counter()
        report = self.runner.evaluate(self.runner.evaluation_config(run))
        self.ran.evaluations.append(run)
        if step is not None:
            self.ran.minutes[step] = (time.perf_counter() - t0) / 60
        return report

    def choose_on_dev(self, step: str, run: EvaluationRun, calibrations: list[str] | None) -> DevChoice:
        """A dev choice among `run`'s rows (under each of `calibrations`), timed as `step`."""
        t0 = time.perf_counter()
        chosen = choose_on_dev(self.evaluate(run), run, calibrations)
        self.ran.minutes[step] = (time.perf_counter() - t0) / 60
        return chosen

    def choose_reader_on_dev(self, job: Job, readers: list[str], calibrations: list[str] | None) -> DevChoice:
        """Who reads the label task, chosen on dev on BM25's prompts (READER_ROWS: no trained stage
        needed, so the feedback stages can be labelled by the chosen reader): each reader's best dev
        score (the LLM's under its best calibration), then the same selection among the readers; the
        earlier of `readers` wins a tie. The dev questions only select: the trained reader learnt
        from train questions alone.

        Args:
            job: the job (its reader stage, if any, fitted).
            readers: the candidates, `trained` and `llm`, in the order of preference.
            calibrations: the LLM reader's calibrations the choice re-reads.
        """
        from persrag_lightning.evaluation.selection import Option, select

        t0, best, scores = time.perf_counter(), [], {}
        for reader in readers:
            run = job.reader_evaluation(reader)
            report = self.evaluate(run)
            dev = choose_on_dev(report, run, calibrations if reader == "llm" else None)
            label = READER_ROWS[0] + (f" [calibration {dev.calibration}]" if dev.calibration else "")
            best.append(Option(reader, reader, dev.scores[label]))
            scores.update({f"{reader} reader, {name}": value for name, value in dev.scores.items()})
        chosen = select(best, report.greater_is_better).chosen.key
        print(f"[pipeline] reader chosen on dev ({report.primary_metric}, {READER_ROWS[0]}'s prompts): {chosen} — "
              + ", ".join(f"{o.label} {o.score:.3f}" for o in best))
        self.ran.minutes["choose the reader on dev"] = (time.perf_counter() - t0) / 60
        return DevChoice(chosen, None, scores)

    def run_table(self, job: Job, chosen: str) -> None:
        """The table on the reported split (`Job.table`), timed as `evaluate`."""
        print(f"[pipeline] the reference row: {table_name(chosen, job.names)}"
              + (" (chosen on dev)" if job.preset.select_order_on_dev else ""))
        self.evaluate(job.table(chosen), "evaluate")


def print_minutes(ran: Ran, plan: Plan, reader: str) -> None:
    """Each step's minutes, the whole job's, and the estimate made before it started."""
    print("\n".join(f"[pipeline] {s}: {t:.1f} min" for s, t in ran.minutes.items()))
    if plan.minutes_for(reader) is not None:
        print(f"[pipeline] {sum(ran.minutes.values()):.1f} min in all; estimated {plan.minutes_for(reader):.1f} "
              f"before it started (with the {'LLM' if reader == LLM_READER else 'trained reader'} reading)")


def write_record(job: Job, ran: Ran, plan: Plan, call: dict[str, Any], decisions: dict[str, Any],
                 choices: dict[str, Any]) -> None:
    """Write <run>/pipeline.json atomically.

    Args:
        job: the job under every decision made on dev.
        ran: the stages and evaluations that ran, and their minutes.
        plan: the plan and its estimate.
        call: the command line as given (`argv`, `preset`, `split`, `questions`).
        decisions: the machine's decisions made before the plan (`decisions.announce_decisions`).
        choices: the dev choices (`run_job`).
    """
    atomic_write_json(run_folder(job.export_root, job.run_name) / RECORD, {
        **call, "task": job.task, "judgments": job.judgments, "precision": job.precision,
        **decisions,  # the machine, its precision decisions and GEMM paths, made once before the plan
        "feedback_labels": job.feedback_labels,
        "row_names": job.names, **choices,
        "stages": [asdict(r) for r in ran.stages], "evaluations": [asdict(r) for r in ran.evaluations],
        "minutes": {s: round(t, 2) for s, t in ran.minutes.items()}, "plan": plan.record(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
