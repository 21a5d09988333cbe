"""One `persrag pipeline` call resolved before anything trains: the task's spec (looked up once),
the preset's choices, and what every stage and evaluation adds to its config. A `Job` is frozen:
a decision made on dev (who reads, the LLM's calibration, the generator's) gives a new job, so each
stage and evaluation is built from the decisions made before it and nothing else.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from persrag_lightning.bundles import exported_bundle
from persrag_lightning.data.tasks import TaskSpec, get_task
from persrag_lightning.pipeline.choice import EVERY_CANDIDATE, TUNED, chain_names, report_rows
from persrag_lightning.pipeline.decisions import label_overrides, precision_overrides
from persrag_lightning.pipeline.runs import EvaluationRun, StageRun, dev_evaluation
from persrag_lightning.presets import Preset
from persrag_lightning.reading import LLM_READER
from persrag_lightning.stages import (
    CROSS_FIT_FOLDS,
    FOLD_READER,
    FOLD_READERS,
    PAPER_STAGES,
    STAGES,
    Key,
    bundle_address,
    run_folder,
)
from persrag_lightning.utils import ConfigError

__all__ = ["READER_ROWS", "TRAINED_READER", "Job", "TaskOverrides", "resolve_job", "task_overrides"]

# the reader stage's export, as the evaluation and the feedback stages name it
TRAINED_READER = bundle_address("reader")
READER_ROWS = ["bm25"]  # the reader is chosen on dev on BM25's prompts: they need no trained stage
# the kinds of stage whose precision a preset sets, as pipeline.json keeps them
PRECISION_KINDS = ("user_encoder", "feedback", "generator")


@dataclass(frozen=True)
class Job:
    """A resolved pipeline call.

    Args:
        preset: the run's preset.
        spec: the task, looked up once.
        judgments: what stage 1 reads per history doc.
        run_name: the run's folder under `export_root`.
        export_root: where the run's bundles go.
        backend: `--llm_backend` (None: the configs').
        paper_chain: whether the paper's chain trains beside the main one.
        names: the table's names of the dev choice's candidates (`chain_names`).
        data: what every stage's data takes (the task, the data folder).
        kinds: what each kind of stage adds (precision, judgments, backend, the task).
        evaluate: what every evaluation takes (the preset's and the task's, the split, `--questions`).
        precision: each kind of work's `trainer.precision` override (pipeline.json keeps them).
        feedback_labels: the feedback LLM's dtype override.
        extra: the command line's unknown arguments, passed to every stage last.
        reader: who reads the label task (`llm`, or `trained`: the reader stage's export).
        calibration: the LLM reader's calibration chosen on dev (None: the config's).
        generator_calibration: the tuned generator's, chosen on dev (None: the config's).
    """

    preset: Preset
    spec: TaskSpec
    judgments: str
    run_name: str
    export_root: str
    backend: str | None
    paper_chain: bool
    names: dict[str, str]
    data: dict[str, Any]
    kinds: dict[str, dict[str, Any]]
    evaluate: dict[str, Any]
    precision: dict[str, dict[str, Any]] = field(default_factory=dict)
    feedback_labels: dict[str, Any] = field(default_factory=dict)
    extra: tuple[str, ...] = ()
    reader: str = LLM_READER
    calibration: str | None = None
    generator_calibration: str | None = None

    @property
    def task(self) -> str:
        return self.spec.name

    @property
    def run(self) -> dict[str, Any]:
        """What every stage and evaluation is told of the run: its name and its export root."""
        return {"run_name": self.run_name, "export_root": self.export_root}

    @property
    def evaluation(self) -> dict[str, Any]:
        """Every evaluation's overrides under the decisions made so far."""
        decided = {Key.READER: TRAINED_READER} if self.reader == "trained" else {}
        decided |= {Key.CALIBRATION: self.calibration} if self.calibration is not None else {}
        if self.generator_calibration is not None:
            decided[Key.GENERATOR_CALIBRATION] = self.generator_calibration
        return {**self.run, **self.evaluate, **decided}

    def decided(self, **decisions: str | None) -> Job:
        """This job with decisions made on dev (`reader`, `calibration`, `generator_calibration`)."""
        return replace(self, **decisions)

    def wanted(self) -> list[str]:
        """The preset's stages, the paper's chain only where it trains beside the main one, the
        reader only where the preset may read with it, on a label task (a generation task's reader
        is the LLM)."""
        reads = self.spec.labels is not None and "trained" in (self.preset.readers or [])
        return [n for n in (self.preset.stages or STAGES) if (self.paper_chain or n not in PAPER_STAGES)
                and (reads or STAGES[n].kind != "reader") and (self.cross_fit or n not in FOLD_READERS)]

    @property
    def cross_fit(self) -> int:
        """The folds the feedback's trained reader is cross-fitted over (the preset's
        `feedback.cross_fit`; 0: none): the run trains one reader per fold (`FOLD_READERS`)."""
        folds = int(self.preset.overrides("feedback").get(Key.FEEDBACK_CROSS_FIT) or 0)
        if folds not in (0, CROSS_FIT_FOLDS):
            raise ConfigError(f"the preset's feedback {Key.FEEDBACK_CROSS_FIT}: {folds}; the pipeline "
                              f"trains {CROSS_FIT_FOLDS} fold readers ({', '.join(FOLD_READERS)}): use "
                              f"{CROSS_FIT_FOLDS} or 0")
        return folds

    def exported(self, stage: str) -> bool:
        """Whether `stage`'s bundle is in the run's folder already (it is not trained again)."""
        return exported_bundle(run_folder(self.export_root, self.run_name), stage) is not None

    def stage_run(self, stage: str, more: dict[str, Any] | None = None) -> StageRun:
        """`stage`'s fit in this job: its config and every override, typed, in the command line's
        order (the preset's data and kind, the task's, the job's, the stage's own, then `more`).

        Args:
            stage: a stage of stages.py.
            more: overrides of this fit alone (the generator's prompts).
        """
        spec = STAGES[stage]
        kind = dict(self.kinds[spec.kind])
        if spec.kind == "feedback" and self.reader == "trained":  # labelled by the reader chosen on dev
            kind[Key.FEEDBACK_READER] = bundle_address(FOLD_READER) if self.cross_fit else TRAINED_READER
        elif spec.kind == "feedback" and self.cross_fit:  # the LLM trained on no question: nothing to cross-fit
            kind[Key.FEEDBACK_CROSS_FIT] = 0
        return StageRun(stage, spec.config, {**self.preset.overrides("data"), **self.data,
                                             **self.preset.overrides(spec.kind), **kind,
                                             **spec.override_values(), **(more or {}), **self.run,
                                             Key.PROGRESS_BAR: False}, list(self.extra), list(spec.overlays))

    def dev_evaluation(self, candidates: list[str], folder: str = "select-on-dev") -> EvaluationRun:
        """The evaluation a dev choice among `candidates` reads (runs/<run_name>/<folder>/)."""
        return dev_evaluation(self.evaluation, candidates, self.run_name, self.names, folder)

    def reader_evaluation(self, reader: str) -> EvaluationRun:
        """The dev evaluation that scores `reader` (`trained` or `llm`) on BM25's prompts."""
        base = {**self.evaluation, Key.READER: TRAINED_READER if reader == "trained" else LLM_READER}
        return dev_evaluation(base, READER_ROWS, self.run_name, {}, f"select-on-dev/reader-{reader}")

    def table(self, chosen: str) -> EvaluationRun:
        """The table on the reported split: the preset's rows (the chosen configuration the
        reference), the docs' vote of BM25's and its prompts, and the goal's third paired test.

        Args:
            chosen: the configuration chosen on dev (by its name in evaluate_cfrag.yaml).
        """
        rows = report_rows(self.preset, chosen, self.paper_chain)
        tests: dict[str, Any] = {Key.REFERENCE: chosen} if chosen != "CFRAG" else {}
        if rows is not None:
            tests[Key.VOTES] = [r for r in ("bm25", chosen) if r in rows]
            # where the neighbours help: the reference against the user's own docs, by the asker's history size
            tests[Key.BY_HISTORY] = [r for r in ("bm25", EVERY_CANDIDATE.get(chosen)) if r in rows and r != chosen]
        if rows is not None and f"{chosen}{TUNED}" in rows and f"bm25{TUNED}" in rows:
            tests[Key.PAIRS] = [[f"{chosen}{TUNED}", f"bm25{TUNED}"]]
        return EvaluationRun("test table", {**self.evaluation, **tests}, rows, self.names)


@dataclass(frozen=True)
class TaskOverrides:
    """What switches a preset to a task: every stage's data, the generator stage's and the
    evaluation's overrides."""

    data: dict[str, Any]
    generator: dict[str, Any]
    evaluate: dict[str, Any]


def task_overrides(spec: TaskSpec, preset: Preset) -> TaskOverrides:
    """Label tasks keep the preset's answer mode; generation tasks (LaMP-4/5/7) have no labels to
    `choose` among, so they generate, in the evaluation and in the generator stage's validation
    alike. LaMP-2 is the configs'.

    Args:
        spec: the task `--task` names (or the data folder's), looked up once by the job.
        preset: the run's preset, whose evaluation overrides the task's are added to.
    """
    evaluate = preset.overrides("evaluate")
    if spec.name == "LaMP-2":
        return TaskOverrides({}, {}, evaluate)
    if spec.labels is None:
        evaluate = {k: v for k, v in evaluate.items() if not k.startswith(Key.LLM_ANSWER_MODE)}
        return TaskOverrides({Key.TASK: spec.name}, {Key.ANSWER_MODE: "generate"},
                             {Key.EVALUATION_TASK: spec.name, **evaluate, Key.LLM_ANSWER_MODE: "generate"})
    return TaskOverrides({Key.TASK: spec.name}, {}, {Key.EVALUATION_TASK: spec.name, **evaluate})


def run_name(opts: argparse.Namespace, spec: TaskSpec, judgments: str, preset: Preset) -> str:
    """`--run_name`, else <source>-<task>-<preset>[-<judgments>]: synthlamp-quick for the main job."""
    if opts.run_name:
        return opts.run_name
    number = spec.name.split("-")[1] if spec.name.startswith("LaMP-") else None
    task = "" if spec.name == "LaMP-2" else f"lamp{number}-" if number else f"{spec.name}-"
    judged = "" if judgments == preset.judgments else f"-{judgments}"
    source = "synthlamp" if opts.data_dir is None else Path(opts.data_dir).resolve().name
    return f"{source}-{task}{Path(opts.preset).stem}{judged}"


def resolve_job(opts: argparse.Namespace, extra: list[str], preset: Preset) -> Job:
    """The Job of parsed arguments: the run's name, and what each kind of stage and the evaluation
    add.

    Args:
        opts: `persrag pipeline`'s parsed arguments (task, judgments, data_dir, split, questions,
            llm_backend, run_name, preset, export_root).
        extra: the command line's unknown arguments (every stage's `fit` overrides).
        preset: the loaded preset.
    """
    spec, judgments, backend = get_task(opts.task), opts.judgments or preset.judgments, opts.llm_backend
    overrides = task_overrides(spec, preset)
    data, evaluate = dict(overrides.data), {**overrides.evaluate, Key.SPLIT: opts.split}
    if opts.data_dir is not None:
        data[Key.DATA_DIR] = opts.data_dir
        evaluate[Key.EVALUATION_DATA_DIR] = opts.data_dir
    # after the preset's own (smoke's 6) and the dev choice's cap: this one wins
    if opts.questions is not None:
        evaluate[Key.MAX_EXAMPLES] = opts.questions
    if backend:
        evaluate[Key.LLM_BACKEND] = backend
    precision = {k: precision_overrides(getattr(preset.precision, k)) for k in PRECISION_KINDS}
    labels = label_overrides(preset.precision.labels, backend)
    kinds = {"user_encoder": {**precision["user_encoder"], Key.JUDGMENTS: judgments},
             "feedback": {**precision["feedback"], **({Key.FEEDBACK_BACKEND: backend} if backend else {}), **labels},
             "reader": {},
             "distilled": precision["feedback"],
             "generator": {**precision["generator"], **overrides.generator}}
    # without judgments the main chain is the paper's
    return Job(preset, spec, judgments, run_name(opts, spec, judgments, preset), opts.export_root, backend,
               preset.paper_chain and judgments != "none", chain_names(judgments), data, kinds, evaluate,
               precision, labels, tuple(extra))
