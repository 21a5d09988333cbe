"""`persrag pipeline`: every CFRAG stage on the embedded default, in order, skipping stages already exported.

user encoder → feedback + retriever (and the ROPG-style baseline, on the same labels) → feedback + reranker (and
its "w/o e_u" ablation) → the generator (the LLM tuned on CFRAG's prompts) → evaluation on the test split, ending
with the results table (intervals, paired tests).
A preset (configs/presets/*.yaml, read by presets.py) says what each kind of stage overrides, which stages of
stages.py train and which rows the table reports. `--task` runs the same stages on another LaMP task (SynthLaMP
generates LaMP-1, 2, 3, 4, 5 and 7); the main job is LaMP-2. With `--data_dir` the task defaults to the folder's
(its convert.json), which is how a converted log's own label set (`labels`) reaches every stage.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from persrag_lightning.commands.decisions import announce_decisions, label_overrides, precision_overrides
from persrag_lightning.commands.evaluate import evaluate_command
from persrag_lightning.commands.plan import build_plan, question_counts
from persrag_lightning.commands.train import lightning_command
from persrag_lightning.data.folder_task import resolve_task
from persrag_lightning.data.tasks import get_task
from persrag_lightning.hardware import bf16_is_native, bf16_verdict, describe_cpu
from persrag_lightning.models.corpus_embeddings import embedding_precision
from persrag_lightning.presets import Preset, load_preset, preset_names
from persrag_lightning.reading import LLM_READER
from persrag_lightning.retrieval.strategies import resolve_reranker_runtime
from persrag_lightning.stages import PAPER_STAGES, STAGES, Stage, bundle_path, cli_overrides
from persrag_lightning.utils import ConfigError, atomic_write_json, one_flag_style

DEV_SELECTION_EXAMPLES = 300  # dev questions the choice is made on (SynthLaMP's quick data has 300)
TRAINED_READER = "{run_dir}/reader"  # the reader stage's export, as the evaluation and the feedback stages name it
READER_ROWS = ["bm25"]  # the reader is chosen on dev on BM25's prompts: they need no trained stage


def given(overrides: dict[str, Any]) -> dict[str, Any]:
    """A preset's overrides without its nulls (null: the config's own value, so no argument at all)."""
    return {k: v for k, v in overrides.items() if v is not None}


@dataclass
class StageRun:
    """One `train.py fit` of the job: the stage, its config and every override as a typed value, merged in the
    command line's order (a later source wins); pipeline.json keeps it as it ran."""

    stage: str
    config: str
    overrides: dict[str, Any]
    extra: list[str] = field(default_factory=list)  # the pipeline's unknown arguments, passed through as typed

    def argv(self) -> list[str]:
        return ["fit", "--config", self.config, *cli_overrides(self.overrides), *self.extra]


@dataclass
class EvaluationRun:
    """One `persrag evaluate` of the job: what it is for, its overrides of evaluate_cfrag.yaml as typed values,
    the rows it reads (`only`, by config name) and the names the table gives them."""

    purpose: str
    overrides: dict[str, Any]
    only: list[str] | None = None
    names: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        only = [] if self.only is None else [f"--only={json.dumps(self.only)}"]
        return ["--config", "evaluate_cfrag.yaml", *cli_overrides(self.overrides), *only,
                f"--names={json.dumps(self.names)}"]


def stage_done(export_root: str, run_name: str, stage: str) -> bool:
    return (bundle_path(Path(export_root) / run_name, stage) / "config.json").exists()


@dataclass
class TaskOverrides:
    """What switches a preset to a task: every stage's data, the generator stage's and the evaluation's overrides."""

    data: dict[str, Any]
    generator: dict[str, Any]
    evaluate: dict[str, Any]


def task_overrides(task: str, preset: Preset) -> TaskOverrides:
    """Label tasks keep the preset's answer mode; generation tasks (LaMP-4/5/7) have no labels to `choose` among,
    so they generate, in the evaluation and in the generator stage's validation alike. LaMP-2 is the configs'."""
    spec = get_task(task)
    evaluate = given(preset.evaluate)
    if spec.name == "LaMP-2":
        return TaskOverrides({}, {}, evaluate)
    if spec.labels is None:
        evaluate = {k: v for k, v in evaluate.items() if not k.startswith("evaluation.llm.answer_mode")}
        return TaskOverrides({"data.init_args.task": spec.name}, {"model.init_args.answer_mode": "generate"},
                             {"evaluation.task": spec.name, **evaluate, "evaluation.llm.answer_mode": "generate"})
    return TaskOverrides({"data.init_args.task": spec.name}, {}, {"evaluation.task": spec.name, **evaluate})


# The CFRAG configurations `select_order_on_dev` chooses between (rows of evaluate_cfrag.yaml): the main chain's
# reranked order and its first stage's order, each with its "w/o user retrieval" row (the same chain and order
# with m = 1). The stage-1 encoder is not chosen again in every run: on the dev questions of both measured seeds
# the paired chain beat the paper's text-only chain in either order (docs/performance/main-job.md), so the paper's
# chain is a reported row, not a candidate.
CANDIDATES = {"CFRAG": "w/o user retrieval",
              "w/o reranker tuning": "w/o user retrieval (first-stage order)"}
TUNED = " + tuned generator"
STAGE_ONE_READS = {"paired": "judgments", "label": "label judgments", "none": "text only"}


def chain_names(judgments: str) -> dict[str, str]:
    """The table's names of the dev choice's candidates: what stage 1 of the main chain reads and which order its
    docs take. evaluate_cfrag.yaml names the first-stage order by its ablation ("w/o reranker tuning"), which
    reads as a loss of the recipe when dev chooses it: in the pipeline's tables it is a configuration of CFRAG."""
    reads = STAGE_ONE_READS[judgments]
    return {"CFRAG": f"CFRAG ({reads}, reranked)", "w/o reranker tuning": f"CFRAG ({reads}, first-stage order)"}


def shown(name: str, names: dict[str, str]) -> str:
    """A config strategy's name in the tables (`--names`), a "+ tuned generator" row following its retrieval's."""
    if name.endswith(TUNED) and name.removesuffix(TUNED) in names:
        return names[name.removesuffix(TUNED)] + TUNED
    return names.get(name, name)


def check_data_dir(data_dir: str, task: str, splits: tuple[str, ...]) -> None:
    """Refuse, in one line, a LaMP folder that lacks a split the pipeline trains on or reports (exit 2)."""
    from persrag_lightning.data.lamp import LampFormatError, outputs_path, questions_path

    for split in splits:
        for path in (questions_path(data_dir, split), outputs_path(data_dir, split)):
            if not path.is_file():
                raise LampFormatError(f"{path}: missing; the pipeline's --data_dir needs {split} questions and "
                                      f"outputs for {task} (it trains on train, selects on dev, reports on --split)")


def dev_readings(out_dir: str, name: str, calibrations: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """A dev row's (answers, golds) under each calibration of `calibrations`, re-read from the label scores its
    evaluation stored (predictions/<row>.labels.json): no LLM call. Empty when the row stored none."""
    from persrag_lightning.llm.calibration import LabelReading
    from persrag_lightning.retrieval.strategies import file_name

    path = Path(out_dir) / "predictions" / f"{file_name(name)}.labels.json"
    if not path.is_file():
        return {}
    stored = json.loads(path.read_text())
    reading, golds = LabelReading.from_json(stored), [r["gold"] for r in stored["rows"]]
    return {calibration: (reading.under(calibration, reading.decision).answers, golds) for calibration in calibrations}


def dev_choice(base: dict[str, Any], candidates: list[str], run_name: str, names: dict[str, str],
               folder: str = "select-on-dev") -> EvaluationRun:
    """The evaluation a dev choice reads: `candidates` on at most DEV_SELECTION_EXAMPLES dev questions (or `base`'s
    own count, e.g. from `--questions`), no reader-free rows, its tables in runs/<run_name>/<folder>/."""
    return EvaluationRun(f"dev choice: {folder}", {"evaluation.max_examples": DEV_SELECTION_EXAMPLES, **base,
                                                   "evaluation.split": "dev", "evaluation.reader_free": False,
                                                   "evaluation.out_dir": f"runs/{run_name}/{folder}"},
                         candidates, names)


def choose_on_dev(run: EvaluationRun, task: str,
                  calibrations: list[str] | None = None) -> tuple[str, str | None, dict[str, float]]:
    """Evaluate `run` (a `dev_choice`) and return the best of its rows by the task's first metric, with the dev
    numbers: the main job's recipe is chosen here, never on test. With `calibrations` (label calibrations), each
    configuration's stored label scores are also re-read under each calibration (no LLM pass) and the best
    (configuration, calibration) pair is chosen. A candidate whose dev answers equal an earlier one's is no choice:
    it is dropped, saying so, and the earlier one stands. The choice is returned by its config name."""
    from persrag_lightning.evaluation.stats import _HIGHER_IS_BETTER, LampMetricFn, metric_names

    metric = metric_names(task)[0]
    out_dir, names, row_names = run.overrides["evaluation.out_dir"], run.only or [], run.names
    results = evaluate_command(run.argv())
    scores: dict[tuple[str, str | None], float] = {}
    answers: dict[tuple[str, str | None], list[str]] = {}
    for name in (n for n in names if shown(n, row_names) in results):
        row = shown(name, row_names)
        readings = dev_readings(out_dir, row, calibrations) if calibrations else {}
        if not readings:  # generated answers, or no stored scores: the evaluation's own number
            scores[(name, None)] = results[row][metric]
            continue
        for calibration, (said, golds) in readings.items():
            scores[(name, calibration)], answers[(name, calibration)] = LampMetricFn(task, metric)(said, golds), said
    if not scores:
        raise SystemExit("persrag pipeline: no CFRAG configuration could be evaluated on dev")
    candidates = list(scores)
    label = {c: shown(c[0], row_names) + (f" [calibration {c[1]}]" if c[1] else "") for c in candidates}
    distinct: list[tuple[str, str | None]] = []
    for c in candidates:
        twin = next((d for d in distinct if c in answers and answers.get(d) == answers[c]), None)
        if twin is None:
            distinct.append(c)
        else:
            print(f"[pipeline] dev answers of {label[c]} are identical to {label[twin]}'s: no choice between "
                  f"them, {label[twin]} stands")
    sign = 1 if _HIGHER_IS_BETTER[metric] else -1
    chosen = max(distinct, key=lambda c: (sign * scores[c], -candidates.index(c)))  # ties: the earlier
    print(f"[pipeline] chosen on dev ({metric}): {label[chosen]} — "
          + ", ".join(f"{label[c]} {scores[c]:.3f}" for c in candidates))
    return chosen[0], chosen[1], {label[c]: v for c, v in scores.items()}


ORDER_ROW = "w/o user retrieval{order}"  # the chosen order's "w/o user retrieval" row (CANDIDATES)


def report_strategies(preset: Preset, chosen: str, paper_chain: bool) -> list[str] | None:
    """The preset's reported rows with `{chosen}` / the chosen order's "w/o user retrieval" filled in (both
    candidates of the dev choice are rows: CFRAG and "w/o reranker tuning"); without the paper's chain trained,
    no row of it."""
    if preset.rows is None:
        return None
    rows = [r.replace("{chosen}", chosen) for r in preset.rows]
    rows = [CANDIDATES[chosen] if r == ORDER_ROW else r for r in rows]
    if not paper_chain:
        rows = [r for r in rows if "(paper" not in r]
    return list(dict.fromkeys(rows))


def check_rows(preset: Preset, name: str) -> None:
    """Refuse, before anything trains, a preset row that evaluate_cfrag.yaml does not have (one line, exit 2)."""
    from persrag_lightning.retrieval.strategies import strategy_names

    known = set(strategy_names("evaluate_cfrag.yaml"))
    for row in preset.rows or []:
        chosen = [row.replace("{chosen}", c) for c in CANDIDATES] if "{chosen}" in row else [row]
        if row != ORDER_ROW and not set(chosen) <= known:
            raise ConfigError(f"{Path(name).name}: rows: {row!r} is no strategy of evaluate_cfrag.yaml; it has "
                              f"{', '.join(sorted(known))}")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="persrag pipeline", description=__doc__)
    parser.add_argument("--preset", default="quick",
                        help=f"a preset of configs/presets/ ({', '.join(preset_names())}) or a YAML file of your own "
                             "(docs/training/configs.md)")
    parser.add_argument("--task", default=None,
                        help="LaMP task, or labels (a converted folder's own label set); default: the --data_dir "
                             "folder's (its convert.json), else LaMP-2, the main job")
    parser.add_argument("--data_dir", default=None,
                        help="a LaMP-format folder (train/dev/<split> questions and outputs) that every stage and "
                             "the evaluation read; default: the embedded SynthLaMP")
    parser.add_argument("--split", default="test", choices=["dev", "test"],
                        help="the split the table reports (test; dev where a folder's test outputs are hidden)")
    parser.add_argument("--judgments", choices=["none", "label", "paired"], default=None,
                        help="stage 1's input per history doc: the paper's text only (none), + a label embedding "
                             "(label), + a label-specific map of the doc vector (paired); default: the preset's "
                             "(quick: paired, with the paper's text-only chain trained beside it)")
    parser.add_argument("--run_name", default=None,
                        help="default: synthlamp-<preset> (LaMP-2), synthlamp-lamp<N>-<preset> for another task, "
                             "with -<judgments> appended when not the preset's; <folder name>-... with --data_dir")
    parser.add_argument("--export_root", default="checkpoints")
    parser.add_argument("--llm_backend", default=None,
                        help="auto, hf, llamacpp, openai or vllm for feedback labels and evaluation answers alike; "
                             "default: the configs' (feedback auto: the faster exact backend, timed once per machine; "
                             "evaluation hf, bfloat16 where native)")
    parser.add_argument("--questions", type=int, default=None,
                        help="read only the first N dev and test questions by id (a fixed subset) in the dev choice "
                             f"and the table; default: every one (the dev choice at most {DEV_SELECTION_EXAMPLES}). "
                             "Fewer questions take less time and give wider intervals")
    parser.add_argument("--plan", action="store_true",
                        help="print the machine, the precision and runtime decisions, the plan and its estimate "
                             "against this CPU class's budget, then exit before anything trains")
    opts, extra = one_flag_style(parser).parse_known_args(argv)
    if opts.questions is not None and opts.questions < 1:
        parser.error(f"--questions must be a positive number of questions, got {opts.questions}")
    try:
        opts.task = resolve_task(opts.task, opts.data_dir)
    except ValueError as e:
        parser.error(str(e))
    return opts, extra


@dataclass
class Job:
    """One `persrag pipeline` call, resolved from its preset and arguments before anything trains: what every stage
    and evaluation adds to its config, and what ran (`stages`, `evaluations`, `minutes`) for pipeline.json."""

    preset: Preset
    task: str
    judgments: str
    run_name: str
    export_root: str
    backend: str | None
    paper_chain: bool
    names: dict[str, str]               # the table's names of the dev choice's candidates (chain_names)
    data: dict[str, Any]                # every stage: the task and the data folder
    kinds: dict[str, dict[str, Any]]    # what each kind of stage adds: precision, judgments, backend, the task
    evaluate: dict[str, Any]            # every evaluation: the preset's and the task's, the split, --questions
    extra: list[str] = field(default_factory=list)
    stages: list[StageRun] = field(default_factory=list)
    evaluations: list[EvaluationRun] = field(default_factory=list)
    minutes: dict[str, float] = field(default_factory=dict)

    @property
    def common(self) -> dict[str, Any]:
        return {"run_name": self.run_name, "export_root": self.export_root}

    def wanted(self) -> list[str]:
        """The preset's stages, the paper's chain only where it trains beside the main one, the reader only where
        the preset may read with it, on a label task (a generation task's reader is the LLM)."""
        reads = get_task(self.task).labels is not None and "trained" in (self.preset.readers or [])
        return [n for n in (self.preset.stages or STAGES) if (self.paper_chain or n not in PAPER_STAGES)
                and (reads or STAGES[n].kind != "reader")]

    def choose_reader(self, readers: list[str], calibrations: list[str] | None) -> tuple[str, dict[str, float]]:
        """Who reads the label task, chosen on dev on BM25's prompts (READER_ROWS: no trained stage needed, so the
        feedback stages can be labelled by the chosen reader): each reader's best dev score (the LLM's under its
        best calibration); the earlier of `readers` wins a tie. The dev questions only select: the trained reader
        learnt from train questions alone."""
        from persrag_lightning.evaluation.stats import LampMetricFn, metric_names

        metric = metric_names(self.task)[0]
        sign = 1 if LampMetricFn(self.task, metric).higher_is_better else -1
        t0, best, scores = time.perf_counter(), {}, {}
        for reader in readers:
            base = {**self.common, **self.evaluate,
                    "evaluation.reader": TRAINED_READER if reader == "trained" else LLM_READER}
            run = dev_choice(base, READER_ROWS, self.run_name, {}, f"select-on-dev/reader-{reader}")
            _, calibration, dev = choose_on_dev(run, self.task, calibrations if reader == "llm" else None)
            self.evaluations.append(run)
            best[reader] = dev[READER_ROWS[0] + (f" [calibration {calibration}]" if calibration else "")]
            scores.update({f"{reader} reader, {name}": value for name, value in dev.items()})
        chosen = max(readers, key=lambda r: (sign * best[r], -readers.index(r)))
        print(f"[pipeline] reader chosen on dev ({metric}, {READER_ROWS[0]}'s prompts): {chosen} — "
              + ", ".join(f"{r} {best[r]:.3f}" for r in readers))
        self.minutes["choose the reader on dev"] = (time.perf_counter() - t0) / 60
        return chosen, scores

    def read_with(self, reader: str) -> None:
        """Every later stage's feedback and every evaluation read with `reader` (trained: the reader stage's
        export; llm: the configs' LLM)."""
        if reader == "trained":
            self.kinds["feedback"]["data.init_args.feedback.reader"] = TRAINED_READER
            self.evaluate["evaluation.reader"] = TRAINED_READER

    def fit(self, stage: str, more: dict[str, Any] | None = None) -> None:
        """Train `stage` unless its bundle is exported already."""
        if stage_done(self.export_root, self.run_name, stage):
            print(f"[pipeline] {stage}: exported already, skipped")
            return
        spec: Stage = STAGES[stage]
        run = StageRun(stage, spec.config, {**given(self.preset.data), **self.data,
                                            **given(getattr(self.preset, spec.kind)), **self.kinds[spec.kind],
                                            **spec.override_values(), **(more or {}), **self.common,
                                            "trainer.enable_progress_bar": False}, self.extra)
        print(f"[pipeline] {stage}: python train.py {' '.join(run.argv())}")
        t0 = time.perf_counter()
        lightning_command(run.argv())
        self.stages.append(run)
        self.minutes[stage] = (time.perf_counter() - t0) / 60

    def choose(self, step: str, candidates: list[str], calibrations: list[str] | None,
               folder: str = "select-on-dev") -> tuple[str, str | None, dict[str, float]]:
        """A dev choice among `candidates` (`choose_on_dev`, under each of `calibrations`), timed as `step`."""
        run = dev_choice({**self.common, **self.evaluate}, candidates, self.run_name, self.names, folder)
        t0 = time.perf_counter()
        chosen = choose_on_dev(run, self.task, calibrations)
        self.evaluations.append(run)
        self.minutes[step] = (time.perf_counter() - t0) / 60
        return chosen

    def report(self, chosen: str) -> EvaluationRun:
        """The table on the reported split: the preset's rows (the chosen configuration the reference), the docs'
        vote of BM25's and its prompts, and the goal's third paired test."""
        rows = report_strategies(self.preset, chosen, self.paper_chain)
        tests: dict[str, Any] = {"evaluation.reference": chosen} if chosen != "CFRAG" else {}
        if rows is not None:
            tests["evaluation.votes"] = [r for r in ("bm25", chosen) if r in rows]
        if rows is not None and f"{chosen}{TUNED}" in rows and f"bm25{TUNED}" in rows:
            tests["evaluation.pairs"] = [[f"{chosen}{TUNED}", f"bm25{TUNED}"]]
        return EvaluationRun("test table", {**self.common, **self.evaluate, **tests}, rows, self.names)


def resolve_job(opts: argparse.Namespace, extra: list[str], preset: Preset) -> Job:
    """The Job of parsed arguments: the run's name, and what each kind of stage and the evaluation add."""
    task, judgments = opts.task, opts.judgments or preset.judgments
    overrides = task_overrides(task, preset)
    data, evaluate = dict(overrides.data), {**overrides.evaluate, "evaluation.split": opts.split}
    if opts.data_dir is not None:
        data["data.init_args.data_dir"] = opts.data_dir
        evaluate["evaluation.data_dir"] = opts.data_dir
    if opts.questions is not None:  # after the preset's own (smoke's 6) and the dev choice's cap: this one wins
        evaluate["evaluation.max_examples"] = opts.questions
    if opts.llm_backend:
        evaluate["evaluation.llm.backend"] = opts.llm_backend
    suffix = "" if task == "LaMP-2" else f"lamp{task.split('-')[1]}-" if task.startswith("LaMP-") else f"{task}-"
    judged = "" if judgments == preset.judgments else f"-{judgments}"
    source = "synthlamp" if opts.data_dir is None else Path(opts.data_dir).resolve().name
    rules, backend = preset.precision, opts.llm_backend
    kinds = {"user_encoder": {**precision_overrides(rules.user_encoder),
                              "model.init_args.config.judgments": judgments},
             "feedback": {**precision_overrides(rules.feedback),
                          **({"data.init_args.feedback.llm.backend": backend} if backend else {}),
                          **label_overrides(rules.labels, backend)},
             "reader": {},
             "generator": {**precision_overrides(rules.generator), **overrides.generator}}
    return Job(preset, task, judgments, opts.run_name or f"{source}-{suffix}{Path(opts.preset).stem}{judged}",
               opts.export_root, backend, preset.paper_chain and judgments != "none",  # else the main chain is it
               chain_names(judgments), data, kinds, evaluate, extra)


def announce(job: Job, questions: int | None, data_dir: str | None) -> tuple[dict[str, Any], object]:
    """The lines before training: the machine, the precision and runtime decisions, the plan and its estimate; the
    decisions as pipeline.json keeps them."""
    precision, gemm = announce_decisions(job.preset, job.backend)
    wanted = job.wanted()
    rows = [shown(r, job.names) for r in report_strategies(job.preset, "CFRAG", job.paper_chain) or []] or None
    plan = build_plan(wanted, [s for s in wanted if stage_done(job.export_root, job.run_name, s)], rows, job.preset,
                      job.task, question_counts(data_dir, job.preset), (len(CANDIDATES), DEV_SELECTION_EXAMPLES),
                      questions, job.backend)
    print("\n".join(plan.lines()), flush=True)
    if questions is not None:
        print(f"[pipeline] --questions {questions}: the dev choice and the table read the first {questions} dev and "
              "test questions by id (a fixed subset; wider intervals)")
    return {"precision_decisions": precision, "gemm": gemm.record()}, plan


def main(argv: list[str]) -> None:
    opts, extra = parse_args(argv)
    preset = load_preset(opts.preset)
    check_rows(preset, opts.preset)
    if opts.data_dir is not None:
        check_data_dir(opts.data_dir, opts.task, ("train", "dev", opts.split) if opts.split != "dev" else ("train", "dev"))
    job = resolve_job(opts, extra, preset)
    decisions, plan = announce(job, opts.questions, opts.data_dir)
    if opts.plan:
        print("[pipeline] --plan: nothing trained; the same command without --plan runs this plan")
        return
    labels = get_task(job.task).labels is not None
    calibrations = preset.calibrations if labels else None
    wanted = job.wanted()
    first = [s for s in wanted if STAGES[s].kind in ("user_encoder", "reader")]  # need no reader's feedback
    for stage in first:
        job.fit(stage)
    readers = [r for r in preset.readers or [] if r != "trained" or "reader" in wanted] if labels else []
    if labels and len(readers) < len(preset.readers or []):
        print("[pipeline] readers: the trained reader is left out: the preset's stages have no reader stage")
    reader, dev_scores = (readers or [LLM_READER])[0], {}
    if len(readers) > 1:  # the label task's reader, chosen on dev before it labels the feedback stages
        reader, dev_scores = job.choose_reader(readers, calibrations)
    job.read_with(reader)
    for stage in wanted:  # the feedback stages, labelled by that reader
        if stage not in first and stage != "generator":
            job.fit(stage)
    chosen, calibration = "CFRAG", None
    if preset.select_order_on_dev:  # choose the configuration (and the LLM reader's calibration) on dev
        chosen, calibration, chosen_dev = job.choose("choose on dev", list(CANDIDATES),
                                                     calibrations if reader == LLM_READER else None)
        dev_scores.update(chosen_dev)
    if calibration is not None:
        job.evaluate["evaluation.llm.calibration"] = calibration
    generator_calibration = None
    if "generator" in wanted:  # the generator learns the chosen configuration's prompts
        job.fit("generator", {"data.init_args.strategy": chosen} if chosen != "CFRAG" else {})
        if calibrations and preset.select_order_on_dev:  # its label scores are read under its own calibration
            _, generator_calibration, generator_dev = job.choose(
                "generator's calibration on dev", [f"{chosen}{TUNED}"], calibrations, "select-on-dev/generator")
            dev_scores.update(generator_dev)
    if generator_calibration is not None:
        job.evaluate["evaluation.generator_calibration"] = generator_calibration
    table = job.report(chosen)  # the table on the reported split
    print(f"[pipeline] the reference row: {shown(chosen, job.names)}"
          + (" (chosen on dev)" if preset.select_order_on_dev else ""))
    t0 = time.perf_counter()
    evaluate_command(table.argv())
    job.evaluations.append(table)
    job.minutes["evaluate"] = (time.perf_counter() - t0) / 60
    print("\n".join(f"[pipeline] {s}: {t:.1f} min" for s, t in job.minutes.items()))
    total = sum(job.minutes.values())
    if plan.minutes_for(reader) is not None:
        print(f"[pipeline] {total:.1f} min in all; estimated {plan.minutes_for(reader):.1f} before it started "
              f"(with the {'LLM' if reader == LLM_READER else 'trained reader'} reading)")
    write_record(job, argv, opts, decisions, plan, {"reader_chosen_on_dev": reader if len(readers) > 1 else None,
                                                   "reader": reader,
                                                   "chosen_on_dev": chosen, "reference_row": shown(chosen, job.names),
                                                   "calibration_chosen_on_dev": calibration,
                                                   "generator_calibration_chosen_on_dev": generator_calibration,
                                                   "dev_scores": dev_scores})


def write_record(job: Job, argv: list[str], opts: argparse.Namespace, decisions: dict[str, Any], plan,
                 choices: dict[str, Any]) -> None:
    """pipeline.json beside the run's bundles, from the typed Job: the raw record a table of main-job times and a
    test of the recipe read."""
    rules = job.preset.precision
    atomic_write_json(Path(job.export_root) / job.run_name / "pipeline.json", {
        "argv": argv, "preset": opts.preset, "task": job.task, "judgments": job.judgments, "split": opts.split,
        "questions": opts.questions,
        "machine": describe_cpu(), "bf16_native": bf16_is_native(), "bf16_verdict": bf16_verdict(),
        "precision": {k: precision_overrides(getattr(rules, k)) for k in ("user_encoder", "feedback", "generator")},
        **decisions,  # precision_decisions, and gemm: the float32 GEMM path of the reader and the encoders
        "feedback_labels": label_overrides(rules.labels, job.backend),
        "corpus_embeddings": embedding_precision(),
        "evaluation_reranker": resolve_reranker_runtime(job.preset.evaluate.get("evaluation.reranker_runtime")
                                                        or "fp32"),
        "row_names": job.names, **choices,
        "stages": [asdict(r) for r in job.stages], "evaluations": [asdict(r) for r in job.evaluations],
        "minutes": {s: round(t, 2) for s, t in job.minutes.items()}, "plan": plan.record(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
