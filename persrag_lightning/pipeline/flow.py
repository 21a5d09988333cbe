"""The main job's order: the plan before anything trains, then stage 1 and the reader, the reader's
dev choice, the feedback stages it labels, the configuration's dev choice, the generator on the
chosen configuration's prompts, and the table on the reported split."""

from __future__ import annotations

from typing import Any

from persrag_lightning.pipeline.choice import TUNED, dev_candidates, report_rows, table_name
from persrag_lightning.pipeline.decisions import announce_decisions
from persrag_lightning.pipeline.execution import JobRun
from persrag_lightning.pipeline.job import Job
from persrag_lightning.pipeline.plan import Plan, build_plan, pair_scale, question_counts
from persrag_lightning.pipeline.rates import evaluation_llm_settings
from persrag_lightning.pipeline.runs import Runner
from persrag_lightning.reading import LLM_READER
from persrag_lightning.stages import FOLD_READERS, STAGES, Key

__all__ = ["plan_job", "run_job"]


def plan_job(job: Job, runner: Runner, questions: int | None, data_dir: str | None) -> tuple[dict[str, Any], Plan]:
    """The lines before training: the machine, the precision and runtime decisions, the plan and its
    estimate, all read from the job's resolved stages and evaluations; the decisions as
    pipeline.json keeps them.

    Args:
        job: the resolved job.
        runner: what resolves the job's stages and evaluations.
        questions: `--questions` (None: every one).
        data_dir: `--data_dir` (None: the embedded SynthLaMP).
    """
    table = runner.evaluation_config(job.table("CFRAG"))
    decisions = announce_decisions(job.preset, job.backend, evaluation_llm_settings(table))
    stages = {s: runner.stage_config(job.stage_run(s)) for s in job.wanted()}
    rows = [table_name(r, job.names) for r in report_rows(job.preset, "CFRAG", job.paper_chain) or []] or None
    candidates = dev_candidates(job.preset)
    dev = runner.evaluation_config(job.dev_evaluation(candidates))
    users = next(iter(stages.values())).fit.data.init_args.synth.num_users if stages else None
    skip = [s for s in stages if job.exported(s)]
    # a distilled stage scores every pair of its questions: its work grows with their length
    pairs = any(STAGES[s].kind == "distilled" for s in stages if s not in skip)
    plan = build_plan(stages, skip, rows, job.preset, job.spec, question_counts(data_dir, users),
                      (len(candidates), dev), table, pair_scale(data_dir, job.spec) if pairs else 1.0)
    print("\n".join(plan.lines()), flush=True)
    if questions is not None:
        print(f"[pipeline] --questions {questions}: the dev choice and the table read the first {questions} dev and "
              "test questions by id (a fixed subset; wider intervals)")
    return decisions, plan


def reader_candidates(job: Job) -> list[str]:
    """The readers dev chooses among: the preset's on a label task (the trained reader only where the
    reader stage trains); a generation task's reader is the LLM."""
    readers = job.preset.readers if job.spec.labels is not None else None
    kept = [r for r in readers or [] if r != "trained" or "reader" in job.wanted()]
    if len(kept) < len(readers or []):
        print("[pipeline] readers: the trained reader is left out: the preset's stages have no reader stage")
    return kept or [LLM_READER]


def run_job(job: Job, execution: JobRun) -> tuple[Job, dict[str, Any]]:
    """Every stage the job wants (those exported already are skipped), the dev choices and the table.

    Args:
        job: the resolved job.
        execution: what runs its stages and evaluations, and keeps what ran.

    Returns: The job under every decision made on dev, and the choices as pipeline.json keeps them.
    """
    calibrations = job.preset.calibrations if job.spec.labels is not None else None
    wanted = job.wanted()
    # need no reader's feedback (the fold readers wait for the reader's dev choice: only a trained reader needs them)
    first = [s for s in wanted if STAGES[s].kind in ("user_encoder", "reader") and s not in FOLD_READERS]
    for stage in first:
        execution.fit(job, stage)
    readers, reader_chosen, scores = reader_candidates(job), None, {}
    if len(readers) > 1:
        reader_chosen, _, scores = execution.choose_reader_on_dev(job, readers, calibrations)
    job = job.decided(reader=reader_chosen or readers[0])
    # the fold readers of cross-fitted feedback (only if the trained reader reads), the feedback stages labelled by
    # the chosen reader
    later = [s for s in wanted if s not in first and s != "generator"
             and (s not in FOLD_READERS or job.reader == "trained")]
    for stage in later:
        execution.fit(job, stage)
    chosen = "CFRAG"
    if job.preset.select_order_on_dev:  # the configuration (and the LLM reader's calibration)
        choice = execution.choose_on_dev("choose on dev", job.dev_evaluation(dev_candidates(job.preset)),
                                         calibrations if job.reader == LLM_READER else None)
        chosen, job, scores = choice.name, job.decided(calibration=choice.calibration), {**scores, **choice.scores}
    if "generator" in wanted:  # the generator learns the chosen configuration's prompts
        execution.fit(job, "generator", {Key.STRATEGY: chosen} if chosen != "CFRAG" else {})
        if calibrations and job.preset.select_order_on_dev:  # its label scores, under its own calibration
            choice = execution.choose_on_dev("generator's calibration on dev", job.dev_evaluation(
                [f"{chosen}{TUNED}"], "select-on-dev/generator"), calibrations)
            job, scores = job.decided(generator_calibration=choice.calibration), {**scores, **choice.scores}
    execution.run_table(job, chosen)
    return job, {"reader_chosen_on_dev": reader_chosen, "reader": job.reader, "chosen_on_dev": chosen,
                 "reference_row": table_name(chosen, job.names), "calibration_chosen_on_dev": job.calibration,
                 "generator_calibration_chosen_on_dev": job.generator_calibration, "dev_scores": scores}
