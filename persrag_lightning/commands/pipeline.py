"""`persrag pipeline`: every CFRAG stage on the embedded default, in order, skipping stages already
exported.

user encoder → feedback + retriever (and the ROPG-style baseline, on the same labels) → feedback +
reranker (and its "w/o e_u" ablation) → the generator (the LLM tuned on CFRAG's prompts) →
evaluation on the test split, ending with the results table (intervals, paired tests). A preset
(configs/presets/*.yaml, read by presets.py) says what each kind of stage overrides, which stages of
stages.py train and which rows the table reports. `--task` runs the same stages on another LaMP task
(SynthLaMP generates LaMP-1, 2, 3, 4, 5 and 7); the main job is LaMP-2. With `--data_dir` the task
defaults to the folder's (its convert.json), which is how a converted log's own label set (`labels`)
reaches every stage.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persrag_lightning.bundles import exported_bundle
from persrag_lightning.commands.decisions import announce_decisions, label_overrides, precision_overrides
from persrag_lightning.commands.evaluate import run_evaluation
from persrag_lightning.commands.plan import build_plan, question_counts, reader_settings
from persrag_lightning.commands.runs import DEV_SELECTION_EXAMPLES, EvaluationRun, StageRun, dev_choice
from persrag_lightning.commands.task_switch import task_overrides
from persrag_lightning.commands.train import run_stage
from persrag_lightning.data.folder_task import resolve_task
from persrag_lightning.data.tasks import get_task
from persrag_lightning.hardware import bf16_is_native, bf16_verdict, describe_cpu
from persrag_lightning.models.corpus_embeddings import embedding_precision
from persrag_lightning.presets import Preset, load_preset, preset_names
from persrag_lightning.reading import LLM_READER
from persrag_lightning.record import RECORD
from persrag_lightning.retrieval.strategies import resolve_reranker_runtime
from persrag_lightning.stages import PAPER_STAGES, STAGES, Stage, bundle_address, run_folder
from persrag_lightning.utils import ConfigError, atomic_write_json, one_flag_style

if TYPE_CHECKING:
    from persrag_lightning.evaluation.base import EvaluationReport

__all__ = ["Job", "main"]

# the reader stage's export, as the evaluation and the feedback stages name it
TRAINED_READER = bundle_address("reader")
READER_ROWS = ["bm25"]  # the reader is chosen on dev on BM25's prompts: they need no trained stage


def _stage_done(export_root: str, run_name: str, stage: str) -> bool:
    return exported_bundle(run_folder(export_root, run_name), stage) is not None


# The CFRAG configurations `select_order_on_dev` chooses between (rows of evaluate_cfrag.yaml): the
# main chain's reranked order and its first stage's order, each with its "w/o user retrieval" row
# (the same chain and order with m = 1). The paper's text-only chain is a reported row, not a
# candidate: the paired chain beats it on dev in either order (docs/performance/main-job.md).
CANDIDATES = {"CFRAG": "w/o user retrieval",
              "w/o reranker tuning": "w/o user retrieval (first-stage order)"}
# the neighbour gate's configurations (a preset's gate_on_dev): at most 2 neighbours' docs, or none
GATES = {"CFRAG, ≤ 2 neighbour docs": "w/o user retrieval",
         "w/o reranker tuning, ≤ 2 neighbour docs": "w/o user retrieval (first-stage order)",
         "w/o user retrieval": "w/o user retrieval",
         "w/o user retrieval (first-stage order)": "w/o user retrieval (first-stage order)"}
EVERY_CANDIDATE = {**CANDIDATES, **GATES}
TUNED = " + tuned generator"
STAGE_ONE_READS = {"paired": "judgments", "label": "label judgments", "none": "text only"}


def chain_names(judgments: str) -> dict[str, str]:
    """The table's names of the dev choice's candidates: what stage 1 of the main chain reads and
    which order its docs take. evaluate_cfrag.yaml names the first-stage order by its ablation ("w/o
    reranker tuning"), which reads as a loss of the recipe when dev chooses it: in the pipeline's
    tables it is a configuration of CFRAG."""
    reads = STAGE_ONE_READS[judgments]
    return {"CFRAG": f"CFRAG ({reads}, reranked)", "w/o reranker tuning": f"CFRAG ({reads}, first-stage order)",
            "CFRAG, ≤ 2 neighbour docs": f"CFRAG ({reads}, reranked, ≤ 2 neighbour docs)",
            "w/o reranker tuning, ≤ 2 neighbour docs": f"CFRAG ({reads}, first-stage order, ≤ 2 neighbour docs)"}


def dev_candidates(preset: Preset) -> list[str]:
    """The configurations the dev choice compares: the main chain's two orders, and with the
    preset's `gate_on_dev` each order with at most 2 neighbours' docs and with none."""
    return list(EVERY_CANDIDATE if preset.gate_on_dev else CANDIDATES)


def shown(name: str, names: dict[str, str]) -> str:
    """A config strategy's name in the tables (`--names`), a "+ tuned generator" row following its
    retrieval's."""
    if name.endswith(TUNED) and name.removesuffix(TUNED) in names:
        return names[name.removesuffix(TUNED)] + TUNED
    return names.get(name, name)


def check_data_dir(data_dir: str, task: str, splits: tuple[str, ...]) -> None:
    """Refuse, in one line, a LaMP folder that lacks a split the pipeline trains on or reports (exit
    2)."""
    from persrag_lightning.data.lamp import LampFormatError, outputs_path, questions_path

    for split in splits:
        for path in (questions_path(data_dir, split), outputs_path(data_dir, split)):
            if not path.is_file():
                raise LampFormatError(f"{path}: missing; the pipeline's --data_dir needs {split} questions and "
                                      f"outputs for {task} (it trains on train, selects on dev, reports on --split)")


def choose_on_dev(
    report: EvaluationReport, run: EvaluationRun, calibrations: list[str] | None = None
) -> tuple[str, str | None, dict[str, float]]:
    """The best of `run`'s rows (a `dev_choice`) by the report's primary metric, with the dev
    numbers: the main job's recipe is chosen here, never on test. With `calibrations` (label
    calibrations), each row read as label scores is re-read under each calibration from the report
    (no LLM pass, no file) and the best (configuration, calibration) pair is chosen
    (`evaluation.selection`); a candidate whose dev answers equal an earlier one's is no choice, and
    the lines say so. The choice is returned by its config name."""
    from persrag_lightning.evaluation.selection import row_options, select

    options = row_options(report, {n: shown(n, run.names) for n in run.only or []}, calibrations)
    if not options:
        raise SystemExit("persrag pipeline: no CFRAG configuration could be evaluated on dev")
    selection = select(options, report.greater_is_better)
    for option, twin in selection.twins:
        print(f"[pipeline] dev answers of {option.label} are identical to {twin.label}'s: no choice between "
              f"them, {twin.label} stands")
    print(f"[pipeline] chosen on dev ({report.primary_metric}): {selection.chosen.label} — "
          + ", ".join(f"{o.label} {o.score:.3f}" for o in selection.options))
    name, calibration = selection.chosen.key
    return name, calibration, selection.scores


ORDER_ROW = "w/o user retrieval{order}"  # the chosen order's "w/o user retrieval" row (CANDIDATES)


def _report_strategies(preset: Preset, chosen: str, paper_chain: bool) -> list[str] | None:
    """The preset's reported rows with `{chosen}` / the chosen order's "w/o user retrieval" filled
    in (both orders are rows: CFRAG and "w/o reranker tuning"; a gated choice is put before its
    "w/o user retrieval" row); without the paper's chain trained, no row of it."""
    if preset.rows is None:
        return None
    rows = [r.replace("{chosen}", chosen) for r in preset.rows]
    rows = [r2 for r in rows for r2 in ([chosen, EVERY_CANDIDATE[chosen]] if r == ORDER_ROW else [r])]
    if not paper_chain:
        rows = [r for r in rows if "(paper" not in r]
    return list(dict.fromkeys(rows))


def _check_rows(preset: Preset, name: str) -> None:
    """Refuse, before anything trains, a preset row that evaluate_cfrag.yaml does not have (one
    line, exit 2)."""
    from persrag_lightning.retrieval.strategies import strategy_names

    known = set(strategy_names("evaluate_cfrag.yaml"))
    for row in preset.rows or []:
        chosen = [row.replace("{chosen}", c) for c in dev_candidates(preset)] if "{chosen}" in row else [row]
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
    """One `persrag pipeline` call, resolved from its preset and arguments before anything trains:
    what every stage and evaluation adds to its config, and what ran (`stages`, `evaluations`,
    `minutes`) for pipeline.json."""

    preset: Preset
    task: str
    judgments: str
    run_name: str
    export_root: str
    backend: str | None
    paper_chain: bool
    # the table's names of the dev choice's candidates (chain_names)
    names: dict[str, str]
    data: dict[str, Any]                # every stage: the task and the data folder
    # what each kind of stage adds: precision, judgments, backend, the task
    kinds: dict[str, dict[str, Any]]
    # every evaluation: the preset's and the task's, the split, --questions
    evaluate: dict[str, Any]
    extra: list[str] = field(default_factory=list)
    stages: list[StageRun] = field(default_factory=list)
    evaluations: list[EvaluationRun] = field(default_factory=list)
    minutes: dict[str, float] = field(default_factory=dict)

    @property
    def common(self) -> dict[str, Any]:
        return {"run_name": self.run_name, "export_root": self.export_root}

    def wanted(self) -> list[str]:
        """The preset's stages, the paper's chain only where it trains beside the main one, the
        reader only where the preset may read with it, on a label task (a generation task's reader
        is the LLM)."""
        reads = get_task(self.task).labels is not None and "trained" in (self.preset.readers or [])
        return [n for n in (self.preset.stages or STAGES) if (self.paper_chain or n not in PAPER_STAGES)
                and (reads or STAGES[n].kind != "reader")]

    def choose_reader(
        self, readers: list[str], calibrations: list[str] | None
    ) -> tuple[str, dict[str, float]]:
        """Who reads the label task, chosen on dev on BM25's prompts (READER_ROWS: no trained stage
        needed, so the feedback stages can be labelled by the chosen reader): each reader's best dev
        score (the LLM's under its best calibration), then the same selection among the readers; the
        earlier of `readers` wins a tie. The dev questions only select: the trained reader learnt
        from train questions alone."""
        from persrag_lightning.evaluation.selection import Option, select

        t0, best, scores = time.perf_counter(), [], {}
        for reader in readers:
            base = {**self.common, **self.evaluate,
                    "evaluation.reader": TRAINED_READER if reader == "trained" else LLM_READER}
            run = dev_choice(base, READER_ROWS, self.run_name, {}, f"select-on-dev/reader-{reader}")
            report = run_evaluation(run.resolve())
            _, calibration, dev = choose_on_dev(
                report, run, calibrations if reader == "llm" else None
            )
            self.evaluations.append(run)
            label = READER_ROWS[0] + (f" [calibration {calibration}]" if calibration else "")
            best.append(Option(reader, reader, dev[label]))
            scores.update({f"{reader} reader, {name}": value for name, value in dev.items()})
        chosen = select(best, report.greater_is_better).chosen.key
        print(f"[pipeline] reader chosen on dev ({report.primary_metric}, {READER_ROWS[0]}'s prompts): {chosen} — "
              + ", ".join(f"{o.label} {o.score:.3f}" for o in best))
        self.minutes["choose the reader on dev"] = (time.perf_counter() - t0) / 60
        return chosen, scores

    def read_with(self, reader: str) -> None:
        """Every later stage's feedback and every evaluation read with `reader` (trained: the reader
        stage's export; llm: the configs' LLM)."""
        if reader == "trained":
            self.kinds["feedback"]["data.init_args.feedback.reader"] = TRAINED_READER
            self.evaluate["evaluation.reader"] = TRAINED_READER

    def stage_run(self, stage: str, more: dict[str, Any] | None = None) -> StageRun:
        """`stage`'s fit in this job: its config and every override, typed, in the command line's
        order (the preset's data and kind, the task's, the job's, the stage's own, then `more`)."""
        spec: Stage = STAGES[stage]
        return StageRun(stage, spec.config, {**self.preset.overrides("data"), **self.data,
                                             **self.preset.overrides(spec.kind), **self.kinds[spec.kind],
                                             **spec.override_values(), **(more or {}), **self.common,
                                             "trainer.enable_progress_bar": False}, self.extra)

    def fit(self, stage: str, more: dict[str, Any] | None = None) -> None:
        """Train `stage` unless its bundle is exported already: from its resolved configuration, in
        this process; its command line is printed, as a user would run the stage alone."""
        if _stage_done(self.export_root, self.run_name, stage):
            print(f"[pipeline] {stage}: exported already, skipped")
            return
        run = self.stage_run(stage, more)
        print(f"[pipeline] {stage}: python train.py {' '.join(run.argv())}")
        t0 = time.perf_counter()
        run_stage(run.resolve())
        self.stages.append(run)
        self.minutes[stage] = (time.perf_counter() - t0) / 60

    def choose(self, step: str, candidates: list[str], calibrations: list[str] | None,
               folder: str = "select-on-dev") -> tuple[str, str | None, dict[str, float]]:
        """A dev choice among `candidates` (`choose_on_dev`, under each of `calibrations`), timed as
        `step`."""
        run = dev_choice(
            {**self.common, **self.evaluate}, candidates, self.run_name, self.names, folder
        )
        t0 = time.perf_counter()
        chosen = choose_on_dev(run_evaluation(run.resolve()), run, calibrations)
        self.evaluations.append(run)
        self.minutes[step] = (time.perf_counter() - t0) / 60
        return chosen

    def run_table(self, chosen: str) -> None:
        """The table on the reported split (`report`), evaluated in this process and timed as `evaluate`."""
        table = self.report(chosen)
        print(f"[pipeline] the reference row: {shown(chosen, self.names)}"
              + (" (chosen on dev)" if self.preset.select_order_on_dev else ""))
        t0 = time.perf_counter()
        run_evaluation(table.resolve())
        self.evaluations.append(table)
        self.minutes["evaluate"] = (time.perf_counter() - t0) / 60

    def report(self, chosen: str) -> EvaluationRun:
        """The table on the reported split: the preset's rows (the chosen configuration the
        reference), the docs' vote of BM25's and its prompts, and the goal's third paired test."""
        rows = _report_strategies(self.preset, chosen, self.paper_chain)
        tests: dict[str, Any] = {"evaluation.reference": chosen} if chosen != "CFRAG" else {}
        if rows is not None:
            tests["evaluation.votes"] = [r for r in ("bm25", chosen) if r in rows]
        if rows is not None and f"{chosen}{TUNED}" in rows and f"bm25{TUNED}" in rows:
            tests["evaluation.pairs"] = [[f"{chosen}{TUNED}", f"bm25{TUNED}"]]
        return EvaluationRun(
            "test table", {**self.common, **self.evaluate, **tests}, rows, self.names
        )


def resolve_job(opts: argparse.Namespace, extra: list[str], preset: Preset) -> Job:
    """The Job of parsed arguments: the run's name, and what each kind of stage and the evaluation
    add."""
    task, judgments = opts.task, opts.judgments or preset.judgments
    overrides = task_overrides(task, preset)
    data, evaluate = dict(overrides.data), {**overrides.evaluate, "evaluation.split": opts.split}
    if opts.data_dir is not None:
        data["data.init_args.data_dir"] = opts.data_dir
        evaluate["evaluation.data_dir"] = opts.data_dir
    # after the preset's own (smoke's 6) and the dev choice's cap: this one wins
    if opts.questions is not None:
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
               # else the main chain is it
               opts.export_root, backend, preset.paper_chain and judgments != "none",
               chain_names(judgments), data, kinds, evaluate, extra)


def announce(
    job: Job, questions: int | None, data_dir: str | None
) -> tuple[dict[str, Any], object]:
    """The lines before training: the machine, the precision and runtime decisions, the plan and its
    estimate, all read from the job's resolved stages and evaluations; the decisions as
    pipeline.json keeps them."""
    table = job.report("CFRAG").resolve()
    precision, gemm = announce_decisions(job.preset, job.backend, reader_settings(table))
    stages = {s: job.stage_run(s).resolve() for s in job.wanted()}
    rows = [
        shown(r, job.names) for r in _report_strategies(job.preset, "CFRAG", job.paper_chain) or []
    ] or None
    candidates = dev_candidates(job.preset)
    dev = dev_choice({**job.common, **job.evaluate}, candidates, job.run_name, job.names).resolve()
    users = next(iter(stages.values())).fit.data.init_args.synth.num_users if stages else None
    plan = build_plan(stages, [s for s in stages if _stage_done(job.export_root, job.run_name, s)], rows, job.preset,
                      job.task, question_counts(data_dir, users), (len(candidates), dev), table)
    print("\n".join(plan.lines()), flush=True)
    if questions is not None:
        print(f"[pipeline] --questions {questions}: the dev choice and the table read the first {questions} dev and "
              "test questions by id (a fixed subset; wider intervals)")
    return {"precision_decisions": precision, "gemm": gemm.record()}, plan


def choose_reader(job: Job, readers: list[str] | None, wanted: list[str],
                  calibrations: list[str] | None) -> tuple[str, dict[str, Any], str | None]:
    """The label task's reader, chosen on dev before it labels the feedback stages.

    Args:
        job: the resolved job (its reader stage, if any, already fitted).
        readers: the preset's reader candidates (`trained`, `llm`); None on a generation task (the
            LLM reads).
        wanted: the stages this job trains; the trained reader is a candidate only where the reader
            stage is one.
        calibrations: the LLM reader's calibrations the dev choice re-reads.

    Returns: The reader, its dev scores, and the reader again when dev chose it among several (None
        otherwise).
    """
    kept = [r for r in readers or [] if r != "trained" or "reader" in wanted]
    if len(kept) < len(readers or []):
        print("[pipeline] readers: the trained reader is left out: the preset's stages have no reader stage")
    if len(kept) < 2:
        return (kept or [LLM_READER])[0], {}, None
    reader, dev_scores = job.choose_reader(kept, calibrations)
    return reader, dev_scores, reader


def main(argv: list[str]) -> None:
    """`python train.py pipeline`: the decisions and the plan, then every stage the preset names (those already
    exported are skipped), the dev choices and the table on `--split`; pipeline.json records what ran.

    Args:
        argv: the arguments after `pipeline` (`--preset`, `--task`, `--data_dir`, `--plan`, ...; `--help` lists
            them), and any `fit` override for every stage.
    """
    opts, extra = parse_args(argv)
    preset = load_preset(opts.preset)
    _check_rows(preset, opts.preset)
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
    # need no reader's feedback
    first = [s for s in wanted if STAGES[s].kind in ("user_encoder", "reader")]
    for stage in first:
        job.fit(stage)
    reader, dev_scores, reader_chosen = choose_reader(job, preset.readers if labels else None, wanted, calibrations)
    job.read_with(reader)
    for stage in wanted:  # the feedback stages, labelled by that reader
        if stage not in first and stage != "generator":
            job.fit(stage)
    chosen, calibration = "CFRAG", None
    # choose the configuration (and the LLM reader's calibration) on dev
    if preset.select_order_on_dev:
        chosen, calibration, chosen_dev = job.choose("choose on dev", dev_candidates(preset),
                                                     calibrations if reader == LLM_READER else None)
        dev_scores.update(chosen_dev)
    if calibration is not None:
        job.evaluate["evaluation.llm.calibration"] = calibration
    generator_calibration = None
    if "generator" in wanted:  # the generator learns the chosen configuration's prompts
        job.fit("generator", {"data.init_args.strategy": chosen} if chosen != "CFRAG" else {})
        # its label scores are read under its own calibration
        if calibrations and preset.select_order_on_dev:
            _, generator_calibration, generator_dev = job.choose(
                "generator's calibration on dev", [f"{chosen}{TUNED}"], calibrations, "select-on-dev/generator")
            dev_scores.update(generator_dev)
    if generator_calibration is not None:
        job.evaluate["evaluation.generator_calibration"] = generator_calibration
    job.run_table(chosen)
    print("\n".join(f"[pipeline] {s}: {t:.1f} min" for s, t in job.minutes.items()))
    total = sum(job.minutes.values())
    if plan.minutes_for(reader) is not None:
        print(f"[pipeline] {total:.1f} min in all; estimated {plan.minutes_for(reader):.1f} before it started "
              f"(with the {'LLM' if reader == LLM_READER else 'trained reader'} reading)")
    write_record(job, argv, opts, decisions, plan, {"reader_chosen_on_dev": reader_chosen,
                                                   "reader": reader,
                                                   "chosen_on_dev": chosen, "reference_row": shown(chosen, job.names),
                                                   "calibration_chosen_on_dev": calibration,
                                                   "generator_calibration_chosen_on_dev": generator_calibration,
                                                   "dev_scores": dev_scores})


def write_record(job: Job, argv: list[str], opts: argparse.Namespace, decisions: dict[str, Any], plan,
                 choices: dict[str, Any]) -> None:
    """pipeline.json beside the run's bundles, from the typed Job: the raw record a table of
    main-job times and a test of the recipe read, and serving's default (record.py reads it back)."""
    rules = job.preset.precision
    atomic_write_json(run_folder(job.export_root, job.run_name) / RECORD, {
        "argv": argv, "preset": opts.preset, "task": job.task, "judgments": job.judgments, "split": opts.split,
        "questions": opts.questions,
        "machine": describe_cpu(), "bf16_native": bf16_is_native(), "bf16_verdict": bf16_verdict(),
        "precision": {k: precision_overrides(getattr(rules, k)) for k in ("user_encoder", "feedback", "generator")},
        # precision_decisions, and gemm: the float32 GEMM path of the reader and the encoders
        **decisions,
        "feedback_labels": label_overrides(rules.labels, job.backend),
        "corpus_embeddings": embedding_precision(),
        "evaluation_reranker": resolve_reranker_runtime(job.preset.evaluate.get("evaluation.reranker_runtime")
                                                        or "fp32"),
        "row_names": job.names, **choices,
        "stages": [asdict(r) for r in job.stages], "evaluations": [asdict(r) for r in job.evaluations],
        "minutes": {s: round(t, 2) for s, t in job.minutes.items()}, "plan": plan.record(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
