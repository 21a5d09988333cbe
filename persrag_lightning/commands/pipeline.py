"""`persrag pipeline`: every CFRAG stage on the embedded default, in order, skipping stages already exported.

user encoder → feedback + retriever (and the ROPG-style baseline, on the same labels) → feedback + reranker (and
its "w/o e_u" ablation) → the generator (the LLM tuned on CFRAG's prompts) → evaluation on the test split, ending
with the results table (intervals, paired tests).
A preset (configs/presets/*.yaml, read by presets.py) says what each kind of stage overrides, which stages of
stages.py train and which rows the table reports. `--task` runs the same stages on another LaMP task (SynthLaMP
generates LaMP-1, 2, 3, 4, 5 and 7); the main job is LaMP-2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from persrag_lightning.commands.evaluate import evaluate_command
from persrag_lightning.commands.plan import build_plan, question_counts, reader_dtype, reader_settings
from persrag_lightning.commands.train import lightning_command
from persrag_lightning.data.tasks import get_task
from persrag_lightning.hardware import (
    Precision,
    auto_precision,
    bf16_is_native,
    bf16_verdict,
    describe_cpu,
    uses_bf16,
)
from persrag_lightning.models.corpus_embeddings import embedding_precision
from persrag_lightning.presets import Preset, load_preset, preset_names
from persrag_lightning.retrieval.strategies import resolve_reranker_runtime
from persrag_lightning.stages import PAPER_STAGES, STAGES, Stage, bundle_path, cli_overrides
from persrag_lightning.utils import ConfigError, atomic_write_json

DEV_SELECTION_EXAMPLES = 300  # dev questions the choice is made on (SynthLaMP's quick data has 300)


def precision_args(rule: Precision | str | None) -> list[str]:
    """`--trainer.precision` for a stage by a preset's policy (hardware.uses_bf16); None: the config's."""
    if rule is None:
        return []
    return [f"--trainer.precision={auto_precision(policy=rule)}"]


def label_args(rule: Precision | str | None, backend: str | None) -> list[str]:
    """The feedback LLM's dtype by a preset's rule: bfloat16 for hf where the rule says native (`cpu_native`: not
    on a GPU, where hf's `auto` dtype is bfloat16 already); nothing elsewhere, so the configs' `backend: auto`
    still picks the faster exact backend, nor under a backend without a dtype option."""
    if rule is None or backend not in (None, "auto", "hf"):
        return []
    return ['--data.init_args.llm.options={"dtype": "bfloat16"}'] if uses_bf16(rule) else []


def precision_decisions(preset: Preset, backend: str | None) -> dict[str, str]:
    """Where this run computes in bfloat16, each kind of work once (hardware.uses_bf16 under the preset's policy):
    printed before the plan and kept in pipeline.json."""
    rules = preset.precision
    stages = {"stage 1": rules.user_encoder, "feedback stages": rules.feedback, "generator": rules.generator}
    out = {k: "config's" if rule is None else auto_precision(policy=rule) for k, rule in stages.items()}
    out["feedback labels"] = "bfloat16" if label_args(rules.labels, backend) else "the configs' backend (exact)"
    llm = reader_settings(preset, backend)
    out["reader"] = reader_dtype(llm) if llm.get("backend") == "hf" else f"the {llm.get('backend')} backend's"
    out["rerankers"] = resolve_reranker_runtime(preset.evaluate.get("evaluation.reranker_runtime") or "fp32")
    out["corpus embeddings"] = embedding_precision()
    return out


def stage_done(export_root: str, run_name: str, stage: str) -> bool:
    return (bundle_path(Path(export_root) / run_name, stage) / "config.json").exists()


def task_args(task: str, preset: Preset) -> tuple[list[str], list[str], list[str]]:
    """(every stage's data override, the generator stage's overrides, the evaluation's overrides) that switch a
    preset to `task`. Label tasks keep the preset's answer mode; generation tasks (LaMP-4/5/7) have no labels to
    `choose` among, so they generate, in the evaluation and in the generator stage's validation alike."""
    spec = get_task(task)
    if spec.name == "LaMP-2":
        return [], [], preset.evaluate_arguments()
    evaluate = [a for a in preset.evaluate_arguments()
                if not (spec.labels is None and a.startswith("--evaluation.llm.answer_mode"))]
    generator = []
    if spec.labels is None:
        evaluate.append("--evaluation.llm.answer_mode=generate")
        generator.append("--model.init_args.answer_mode=generate")
    return [f"--data.init_args.task={spec.name}"], generator, [f"--evaluation.task={spec.name}", *evaluate]


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


# Said before the plan where the preset asks for a bfloat16 reader and the CPU cannot give one: float32 reading is
# compute-bound and most of such a job, and reading fewer questions buys time only by losing the table's power.
FLOAT32_READER_NOTE = ("[pipeline] no native bfloat16 here, so the reader answers in float32, which is most of this "
                       "job's time: the estimate below says how long; --questions reads fewer questions but rarely "
                       "shows the table's differences (docs/getting-started.md#the-main-job)")


def float32_reader_note(preset: Preset, backend: str | None) -> str | None:
    """FLOAT32_READER_NOTE where the preset's hf reader would read in bfloat16 where native and this CPU has no
    native bfloat16 (on a GPU it reads in bfloat16)."""
    llm = reader_settings(preset, backend)
    wants_bf16 = (llm.get("options") or {}).get("dtype") == "bf16_if_native"
    if llm.get("backend") == "hf" and wants_bf16 and reader_dtype(llm) != "bfloat16":
        return FLOAT32_READER_NOTE
    return None


def check_data_dir(data_dir: str, task: str, splits: tuple[str, ...]) -> None:
    """Refuse, in one line, a LaMP folder that lacks a split the pipeline trains on or reports (exit 2)."""
    from persrag_lightning.data.lamp import LampFormatError, outputs_path, questions_path

    for split in splits:
        for path in (questions_path(data_dir, split), outputs_path(data_dir, split)):
            if not path.is_file():
                raise LampFormatError(f"{path}: missing; the pipeline's --data_dir needs {split} questions and "
                                      f"outputs for {task} (it trains on train, selects on dev, reports on --split)")


def dev_readings(out_dir: str, name: str, readers: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """A dev row's (answers, golds) under each calibration of `readers`, re-read from the label scores its
    evaluation stored (predictions/<row>.labels.json): no LLM call. Empty when the row stored none."""
    from persrag_lightning.llm.calibration import LabelReading
    from persrag_lightning.retrieval.strategies import file_name

    path = Path(out_dir) / "predictions" / f"{file_name(name)}.labels.json"
    if not path.is_file():
        return {}
    stored = json.loads(path.read_text())
    reading, golds = LabelReading.from_json(stored), [r["gold"] for r in stored["rows"]]
    return {reader: (reading.under(reader, reading.decision).answers, golds) for reader in readers}


def choose_on_dev(common: list[str], evaluate_args: list[str], names: list[str], run_name: str,
                  task: str, readers: list[str] | None = None, folder: str = "select-on-dev",
                  row_names: dict[str, str] | None = None) -> tuple[str, str | None, dict[str, float]]:
    """Evaluate `names` on dev (at most DEV_SELECTION_EXAMPLES questions, or `evaluate_args`' own count, e.g. from
    `--questions`) and return the best configuration by the task's first metric, with the dev numbers: the main
    job's recipe is chosen here, never on test. With `readers` (label calibrations), each configuration's stored
    label scores are also re-read under each calibration (no LLM pass) and the best (configuration,
    calibration) pair is chosen. A candidate whose dev answers equal an earlier one's is no choice: it is
    dropped, saying so, and the earlier one stands. The dev tables are written to runs/<run_name>/<folder>/, under
    `row_names` (`chain_names`); the choice is returned by its config name."""
    from persrag_lightning.evaluation.stats import _HIGHER_IS_BETTER, LampMetricFn, metric_names

    metric = metric_names(task)[0]
    out_dir = f"runs/{run_name}/{folder}"
    results = evaluate_command(["--config", "evaluate_cfrag.yaml", *common,
                                f"--evaluation.max_examples={DEV_SELECTION_EXAMPLES}", *evaluate_args,
                                "--evaluation.split=dev", "--evaluation.reader_free=false",
                                f"--evaluation.out_dir={out_dir}", f"--only={json.dumps(names)}",
                                f"--names={json.dumps(row_names or {})}"])
    scores: dict[tuple[str, str | None], float] = {}
    answers: dict[tuple[str, str | None], list[str]] = {}
    for name in (n for n in names if shown(n, row_names or {}) in results):
        row = shown(name, row_names or {})
        readings = dev_readings(out_dir, row, readers) if readers else {}
        if not readings:  # generated answers, or no stored scores: the evaluation's own number
            scores[(name, None)] = results[row][metric]
            continue
        for reader, (said, golds) in readings.items():
            scores[(name, reader)], answers[(name, reader)] = LampMetricFn(task, metric)(said, golds), said
    if not scores:
        raise SystemExit("persrag pipeline: no CFRAG configuration could be evaluated on dev")
    candidates = list(scores)
    label = {c: shown(c[0], row_names or {}) + (f" [calibration {c[1]}]" if c[1] else "") for c in candidates}
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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="persrag pipeline", description=__doc__)
    parser.add_argument("--preset", default="quick",
                        help=f"a preset of configs/presets/ ({', '.join(preset_names())}) or a YAML file of your own "
                             "(docs/training/configs.md)")
    parser.add_argument("--task", default="LaMP-2", help="LaMP task (default LaMP-2, the main job)")
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
    parser.add_argument("--llm-backend", default=None,
                        help="auto, hf, llamacpp, openai or vllm for feedback labels and evaluation answers alike; "
                             "default: the configs' (feedback auto: the faster exact backend, timed once per machine; "
                             "evaluation hf, bfloat16 where native)")
    parser.add_argument("--questions", type=int, default=None,
                        help="read only the first N dev and test questions by id (a fixed subset) in the dev choice "
                             f"and the table; default: every one (the dev choice at most {DEV_SELECTION_EXAMPLES}). "
                             "Fewer questions take less time and give wider intervals")
    opts, extra = parser.parse_known_args(argv)
    if opts.questions is not None and opts.questions < 1:
        parser.error(f"--questions must be a positive number of questions, got {opts.questions}")
    preset = load_preset(opts.preset)
    check_rows(preset, opts.preset)
    try:
        task = get_task(opts.task).name
    except ValueError as e:
        parser.error(str(e))
    judgments = opts.judgments or preset.judgments
    if opts.data_dir is not None:
        check_data_dir(opts.data_dir, task, ("train", "dev", opts.split) if opts.split != "dev" else ("train", "dev"))
    data_task, generator_task, evaluate_args = task_args(task, preset)
    if opts.data_dir is not None:
        data_task = [*data_task, f"--data.init_args.data_dir={opts.data_dir}"]
        evaluate_args = [*evaluate_args, f"--evaluation.data_dir={opts.data_dir}"]
    evaluate_args = [*evaluate_args, f"--evaluation.split={opts.split}"]
    questions = opts.questions
    if questions is not None:  # after the preset's own (smoke's 6) and the dev choice's cap: the last one given wins
        evaluate_args.append(f"--evaluation.max_examples={questions}")
    suffix = "" if task == "LaMP-2" else f"lamp{task.split('-')[1]}-"
    judged = "" if judgments == preset.judgments else f"-{judgments}"
    source = "synthlamp" if opts.data_dir is None else Path(opts.data_dir).resolve().name
    run_name = opts.run_name or f"{source}-{suffix}{Path(opts.preset).stem}{judged}"
    common = [f"--run_name={run_name}", f"--export_root={opts.export_root}"]
    llm = [f"--data.init_args.llm.backend={opts.llm_backend}"] if opts.llm_backend else []
    evaluate_llm = [f"--evaluation.llm.backend={opts.llm_backend}"] if opts.llm_backend else []
    paper_chain = preset.paper_chain and judgments != "none"  # else the main chain is the paper's
    names = chain_names(judgments)
    rules = preset.precision
    # what each kind of stage adds to its preset overrides: precision, judgments, the LLM backend, the task
    kind_args = {"user_encoder": [*precision_args(rules.user_encoder), f"--model.init_args.judgments={judgments}"],
                 "feedback": [*precision_args(rules.feedback), *llm, *label_args(rules.labels, opts.llm_backend)],
                 "generator": [*precision_args(rules.generator), *generator_task]}
    wanted = [n for n in (preset.stages or STAGES) if paper_chain or n not in PAPER_STAGES]
    print(f"[pipeline] {describe_cpu()}; bfloat16 native: {bf16_verdict()}")
    if note := float32_reader_note(preset, opts.llm_backend):
        print(note)
    decisions = precision_decisions(preset, opts.llm_backend)
    print("[pipeline] precision: " + ", ".join(f"{k} {v}" for k, v in decisions.items()))
    plan = build_plan(wanted, [s for s in wanted if stage_done(opts.export_root, run_name, s)],
                      [shown(r, names) for r in report_strategies(preset, "CFRAG", paper_chain) or []] or None,
                      preset, task,
                      question_counts(opts.data_dir, preset), (len(CANDIDATES), DEV_SELECTION_EXAMPLES), questions,
                      opts.llm_backend)
    print("\n".join(plan.lines()), flush=True)
    if questions is not None:
        print(f"[pipeline] --questions {questions}: the dev choice and the table read the first {questions} dev and "
              "test questions by id (a fixed subset; wider intervals)")

    timings = []

    def fit(stage: str, more: tuple[str, ...] = ()) -> None:
        if stage_done(opts.export_root, run_name, stage):
            print(f"[pipeline] {stage}: exported already, skipped")
            return
        spec: Stage = STAGES[stage]
        args = ["--config", spec.config, *cli_overrides(preset.data), *data_task,
                *cli_overrides(getattr(preset, spec.kind)), *kind_args[spec.kind], *spec.arguments(), *more]
        t0 = time.perf_counter()
        print(f"[pipeline] {stage}: python train.py fit {' '.join(args + common + extra)}")
        lightning_command(["fit", *args, *common, "--trainer.enable_progress_bar=false", *extra])
        timings.append((stage, time.perf_counter() - t0))

    for stage in wanted:
        if stage != "generator":
            fit(stage)
    chosen, calibration, dev_scores = "CFRAG", None, {}
    readers = preset.readers if get_task(task).labels is not None else None
    if preset.select_order_on_dev:
        t0 = time.perf_counter()
        chosen, calibration, dev_scores = choose_on_dev(common, [*evaluate_args, *evaluate_llm], list(CANDIDATES),
                                                        run_name, task, readers, row_names=names)
        timings.append(("choose on dev", time.perf_counter() - t0))
    if calibration is not None:
        evaluate_args.append(f"--evaluation.llm.calibration={calibration}")
    generator_calibration = None
    if "generator" in wanted:
        fit("generator", (f"--data.init_args.strategy={chosen}",) if chosen != "CFRAG" else ())
        if calibration is not None:  # label scores were read on dev: the tuned generator's are read the same way,
            # under its own calibration (it learned the labels' prior), chosen on dev
            t0 = time.perf_counter()
            _, generator_calibration, generator_dev = choose_on_dev(
                common, [*evaluate_args, *evaluate_llm], [f"{chosen}{TUNED}"], run_name, task, readers,
                folder="select-on-dev/generator", row_names=names)
            dev_scores.update(generator_dev)
            timings.append(("generator's calibration on dev", time.perf_counter() - t0))
    if generator_calibration is not None:
        evaluate_args.append(f"--evaluation.generator_calibration={generator_calibration}")
    t0 = time.perf_counter()
    rows = report_strategies(preset, chosen, paper_chain)
    only = [] if rows is None else [f"--only={json.dumps(rows)}"]
    tests = [f"--evaluation.reference={chosen}"] if chosen != "CFRAG" else []
    if rows is not None:  # the reader-free docs' vote of BM25's and the chosen configuration's prompts
        tests.append(f"--evaluation.votes={json.dumps([r for r in ('bm25', chosen) if r in rows])}")
    if rows is not None and f"{chosen}{TUNED}" in rows and f"bm25{TUNED}" in rows:
        # the goal's third test: the tuned generator reading the recipe's docs against it reading BM25's
        tests.append(f"--evaluation.pairs={json.dumps([[f'{chosen}{TUNED}', f'bm25{TUNED}']])}")
    print(f"[pipeline] the reference row: {shown(chosen, names)} (chosen on dev)" if preset.select_order_on_dev
          else f"[pipeline] the reference row: {shown(chosen, names)}")
    evaluate_command(["--config", "evaluate_cfrag.yaml", *common, *evaluate_args, *only, *tests, *evaluate_llm,
                      f"--names={json.dumps(names)}"])
    timings.append(("evaluate", time.perf_counter() - t0))
    print("\n".join(f"[pipeline] {s}: {t / 60:.1f} min" for s, t in timings))
    total = sum(t for _, t in timings) / 60
    if plan.minutes is not None:
        print(f"[pipeline] {total:.1f} min in all; estimated {plan.minutes:.1f} before it started")
    # what ran where, beside the run's bundles: the raw record a table of main-job times is made from
    atomic_write_json(Path(opts.export_root) / run_name / "pipeline.json", {
        "argv": argv, "preset": opts.preset, "task": task, "judgments": judgments, "split": opts.split,
        "questions": questions,
        "machine": describe_cpu(), "bf16_native": bf16_is_native(), "bf16_verdict": bf16_verdict(),
        "precision": {k: precision_args(getattr(rules, k)) for k in ("user_encoder", "feedback", "generator")},
        "precision_decisions": decisions,
        "feedback_labels": label_args(rules.labels, opts.llm_backend),
        "corpus_embeddings": embedding_precision(),
        "evaluation_reranker": resolve_reranker_runtime(preset.evaluate.get("evaluation.reranker_runtime") or "fp32"),
        "chosen_on_dev": chosen, "row_names": names, "reference_row": shown(chosen, names),
        "calibration_chosen_on_dev": calibration,
        "generator_calibration_chosen_on_dev": generator_calibration, "dev_scores": dev_scores,
        "minutes": {s: round(t / 60, 2) for s, t in timings}, "plan": plan.record(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
