"""`persrag pipeline`: every CFRAG stage on the embedded default, in order, skipping stages already exported.

user encoder → feedback + retriever (and the ROPG-style baseline, on the same labels) → feedback + reranker (and
its "w/o e_u" ablation) → the generator (the LLM tuned on CFRAG's prompts) → evaluation on the test split, ending
with the results table (intervals, paired tests).
A preset may train only the bundles its reported strategies need. `--task` runs the same stages on another LaMP task
(SynthLaMP generates LaMP-1, 2, 3, 4, 5 and 7); the main job is LaMP-2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from persrag_lightning.commands.evaluate import evaluate_command
from persrag_lightning.commands.train import lightning_command
from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.evaluate import resolve_reranker_runtime
from persrag_lightning.hardware import bf16_is_native, bf16_verdict, cpu_has_native_bf16, describe_cpu
from persrag_lightning.models.corpus_embeddings import embedding_precision
from persrag_lightning.retrieval.cfrag import PAPER_STAGES, STAGES
from persrag_lightning.utils import atomic_write_json

# Settings shared by every stage of a preset, as CLI overrides, the bundles it trains and the strategies it
# reports (None: every strategy of evaluate_cfrag.yaml). Every preset reports on the TEST split; dev selects.
# Precision is never a preset's: `auto` stages train in bf16-mixed only where this machine computes bfloat16
# natively (hardware.py), in float32 elsewhere.
#
# `quick` is the main job, on 2 CPU cores (docs/getting-started.md has its time per CPU class). The 300-user
# SynthLaMP gives 300 test questions (one per user), enough for intervals that can show a difference. Answers are
# `choose` (the most likely of the 15 labels): the 135M LLM rarely *generates* a listed tag, so generated answers
# score ~0 whatever was retrieved. Its recipe:
# - stage 1 reads each history doc with its label (`judgments: paired`): same-community users at precision@5 0.485
#   on stage 1's validation users against the paper's text-only encoder's 0.329 (chance 0.124;
#   docs/methods/judgments.md);
# - the paper's exact CFRAG (text-only encoder, its own retriever and reranker) is trained beside it;
# - feedback: m = 3 users x k = 2 docs with log-likelihood labels (log p(y | prompt) ranks every candidate; the
#   task metric would be 0 for most), 32 train examples; inference keeps the paper's m = 6, k = 5; the retriever
#   and reranker stages validate nothing (one epoch keeps one checkpoint, so 16 dev examples selected nothing and
#   their labels cost ~1.8 of the job's minutes): the dev choice below, on 300 dev questions, is the selection;
# - whether the reranker (trained on 32 examples) or the first stage's order is kept is chosen on the dev
#   questions (`select_order_on_dev`), never on test: both stay rows of the table, and the "+ tuned generator"
#   and "w/o user retrieval" rows follow the choice (the stage-1 encoder was chosen on dev too, once: CANDIDATES);
# - the generator (LoRA) trains on the chosen CFRAG's prompts.
# `paper` keeps the paper's m, k, all examples and generated answers (hours on CPU; minutes on a GPU node).
Preset = dict[str, list[str] | bool | str | None]
PRESETS: dict[str, Preset] = {
    "smoke": {  # the end-to-end test: every stage with the real embedded models, minutes on 2 cores
        "data": ["--data.init_args.synth.num_users=24"],
        "user_encoder": ["--trainer.max_epochs=3"],
        "feedback": ["--data.init_args.m=2", "--data.init_args.k=2", "--data.init_args.max_train_examples=8",
                     "--trainer.limit_val_batches=0"],
        "generator": ["--data.init_args.max_train_examples=8", "--trainer.limit_val_batches=0",
                      "--data.init_args.batch_size=4", "--trainer.max_epochs=1"],
        "evaluate": ["--evaluation.synth.num_users=24", "--evaluation.max_examples=6",
                     "--evaluation.llm.answer_mode=choose", "--evaluation.n_resamples=200"],
        # the quick recipe at smoke scale: judgments paired, the paper's chain beside it, the order chosen on dev
        "judgments": "paired",
        "paper_chain": True,
        "select_order_on_dev": True,
        "readers": ["none", "contextual", "pmi"],
        "stages": None,
        "strategies": None,
    },
    "quick": {
        "data": [],
        "user_encoder": ["--trainer.max_epochs=20"],
        # Every step is logged: 8 steps per stage here (4 for the generator), which the configs' interval of 10
        # would leave without a single train/loss row.
        "feedback": ["--data.init_args.m=3", "--data.init_args.k=2", "--data.init_args.max_train_examples=32",
                     "--trainer.limit_val_batches=0", "--data.init_args.feedback_metric=loglik",
                     "--trainer.log_every_n_steps=1"],
        # The retriever and reranker train in bf16-mixed where the CPU computes bfloat16 natively: with their
        # batches of 4 examples, 3.7x and 2.3x the official single-example float32 loop at m*k = 30
        # (docs/performance/training.md). On a GPU they stay float32: bf16 paid only with large chunks there.
        "feedback_precision": "cpu_native",
        # Their log-likelihood labels too: SmolLM2 in bfloat16 where the CPU computes it natively (as a GPU run
        # labels with hf's `auto` dtype anyway): 2.2x the float32 label rate, median 0.065 nat from the float32
        # label, the best of a question's 6 candidates the same for 43 of 48 (docs/fidelity.md); on other CPUs
        # the configs' `backend: auto` keeps the fastest exact backend.
        "label_precision": "cpu_native",
        # Stage 1 as well: bf16-mixed on such a CPU, ~20 % less time per stage-1 fit, community precision@5 the
        # same to 0.002 on both seeds and both encoders (docs/fidelity.md); float32 elsewhere, GPUs included.
        "user_encoder_precision": "cpu_native",
        # The generator's prompt count was chosen on dev once (benchmarks/dev_generator_budget.py; more prompts did not
        # beat 32 on LaMP-3's dev and cost minutes: docs/evaluation/label-answers.md).
        # The generator (LoRA on SmolLM2, trained on the chosen CFRAG's prompts): 32 train examples x 1 epoch (4
        # steps of 8, so lr 1e-3 instead of 2e-4); no validation, as the feedback stages (one epoch, one
        # checkpoint: 16 dev examples selected nothing and cost ~0.3 min); bf16-mixed wherever bfloat16 is
        # native (CPU or GPU), float32 elsewhere (bf16 emulated on an AVX2-only CPU: 0.02 examples/s).
        "generator": ["--data.init_args.max_train_examples=32", "--trainer.limit_val_batches=0",
                      "--data.init_args.batch_size=8", "--trainer.max_epochs=1", "--model.init_args.lr=1e-3",
                      "--trainer.log_every_n_steps=1", "--data.init_args.reranker_runtime=bf16_if_native"],
        "generator_precision": "native",
        # The reader answers in bfloat16 where native: evaluation 13.2 -> 6.7 min, the float32 answer on 95-99.7 %
        # of the prompts per strategy and the same conclusions (docs/fidelity.md); float32 elsewhere. Feedback labels stay
        # exact on CPUs (the configs' `backend: auto`: float32 transformers or llama.cpp on f16 weights, whichever
        # is faster on this machine). The reranking rows' cross-encoder runs in bfloat16 autocast where native
        # (276 -> 140 ms per question on the AMX Xeon, 98.2 % of the top-5 docs the same; docs/fidelity.md), in
        # the generator stage's prompts too.
        "evaluate": ["--evaluation.llm.answer_mode=choose", '--evaluation.llm.options={"dtype": "bf16_if_native"}',
                     "--evaluation.reranker_runtime=bf16_if_native"],
        "judgments": "paired",
        "paper_chain": True,
        "select_order_on_dev": True,
        # the label calibrations (llm/calibration.py) the dev choice re-reads each configuration's stored dev
        # scores under (no further LLM pass); the test table reads labels under the chosen one
        "readers": ["none", "contextual", "pmi"],
        "stages": ["user_encoder", "retriever", "reranker", *PAPER_STAGES, "generator"],
        # `{order}` / `{chosen}` rows follow the configuration chosen on dev (CANDIDATES below)
        "strategies": ["zero_shot", "bm25", "CFRAG", "w/o reranker tuning", "w/o user retrieval{order}",
                       "CFRAG (paper)", "zero_shot + tuned generator", "bm25 + tuned generator",
                       "{chosen} + tuned generator"],
    },
    "paper": {"data": [], "user_encoder": [], "feedback": [], "generator": [],
              "evaluate": ["--evaluation.llm.answer_mode=generate"], "judgments": "none", "stages": None,
              "strategies": None},
}


# `full-feedback`: the quick protocol (same data, stages, answers, reported rows) with the paper's amount of feedback,
# which the quick reranker lacks (docs/methods/cfrag.md): m = 6 users x k = 5 docs for every train and every dev question
# (600 + 300 questions x 30 candidates per stage), log-likelihood labels in batches of 64. ~2 x 27,000 LLM calls:
# minutes on a GPU node, hours on 2 CPU cores.
PRESETS["full-feedback"] = {
    **PRESETS["quick"],
    "feedback": ["--data.init_args.feedback_metric=loglik", "--data.init_args.llm.batch_size=64"],
}

DEV_SELECTION_EXAMPLES = 300  # dev questions the choice is made on (SynthLaMP's quick data has 300)


def rule_is_native(rule: str) -> bool:
    """Whether a preset's precision rule asks for bfloat16 on this machine: `native` wherever bfloat16 is native
    (CUDA or CPU), `cpu_native` only on such a CPU (float32 on a GPU)."""
    if rule == "cpu_native":
        return not torch.cuda.is_available() and cpu_has_native_bf16()
    if rule == "native":
        return bf16_is_native()
    raise ValueError(f"unknown precision rule {rule!r}")


def precision_args(rule: str | None) -> list[str]:
    """`--trainer.precision` for a stage by a preset's rule (`rule_is_native`); None: the config's."""
    if rule is None:
        return []
    return ["--trainer.precision=bf16-mixed" if rule_is_native(rule) else "--trainer.precision=32-true"]


def label_args(rule: str | None, backend: str | None) -> list[str]:
    """The feedback LLM's dtype by a preset's rule: bfloat16 for hf where the rule says native (`cpu_native`: not
    on a GPU, where hf's `auto` dtype is bfloat16 already); nothing elsewhere, so the configs' `backend: auto`
    still picks the faster exact backend, nor under a backend without a dtype option."""
    if rule is None or backend not in (None, "auto", "hf"):
        return []
    return ['--data.init_args.llm.options={"dtype": "bfloat16"}'] if rule_is_native(rule) else []


def stage_done(export_root: str, run_name: str, stage: str) -> bool:
    return (Path(export_root) / run_name / stage / "config.json").exists()


def task_args(task: str, preset: Preset) -> tuple[list[str], list[str], list[str]]:
    """(every stage's data override, the generator stage's overrides, the evaluation's overrides) that switch a
    preset to `task`. Label tasks keep the preset's answer mode; generation tasks (LaMP-4/5/7) have no labels to
    `choose` among, so they generate, in the evaluation and in the generator stage's validation alike."""
    spec = get_task(task)
    if spec.name == "LaMP-2":
        return [], [], list(preset["evaluate"])
    evaluate = [a for a in preset["evaluate"] if not (spec.labels is None and a.startswith("--evaluation.llm.answer_mode"))]
    generator = []
    if spec.labels is None:
        evaluate.append("--evaluation.llm.answer_mode=generate")
        generator.append("--model.init_args.answer_mode=generate")
    return [f"--data.init_args.task={spec.name}"], generator, [f"--evaluation.task={spec.name}", *evaluate]


# The CFRAG configurations `select_order_on_dev` chooses between (rows of evaluate_cfrag.yaml): the main chain's
# reranked order and its first stage's order, each with its "w/o user retrieval" row (the same chain and order
# with m = 1). The stage-1 encoder is not chosen again in every run: on the 300 dev questions of both measured
# seeds the paired chain beat the paper's text-only chain in either order (first-stage order 0.317 / 0.330 against
# 0.293 / 0.260; docs/performance/main-job.md), so the paper's chain is a reported row (its reranked order, the
# paper's exact CFRAG), not a candidate: two dev evaluations and one test row fewer (the job: 30.3 -> 27.3 min;
# docs/getting-started.md).
CANDIDATES = {"CFRAG": "w/o user retrieval",
              "w/o reranker tuning": "w/o user retrieval (first-stage order)"}


# Said up front where the quick preset runs past the README's 20-minute budget: a CPU without native bfloat16 reads
# its 11 x 300 prompts in float32, which is compute-bound: were nothing but its matmuls to take time, the reading
# alone would take ~20 min on 2 AVX2 cores (benchmarks/bench_reader.py's float32 floor). Reading fewer questions
# (`--questions`) fits the budget only by losing what the table is for: with 100 questions the AVX2 job took 24.0 min
# on a slow day, and random 100 of the 300 test questions show all three of the goal's differences in 6-11 % of draws
# (benchmarks/subset_power.py on the float32 and bfloat16 runs). Times and tables: docs/getting-started.md#the-main-job.
FLOAT32_READER_NOTE = ("[pipeline] no native bfloat16 here, so the reader answers in float32: the quick preset took "
                       "28-47 min on 2 cores of such CPUs (12-17 with native bfloat16), most of it reading 11 x 300 "
                       "prompts; --questions 100 took 24 min, but 100 questions rarely show the table's differences "
                       "(docs/getting-started.md#the-main-job)")


def float32_reader_note(preset: str) -> str | None:
    """FLOAT32_READER_NOTE for the quick preset on a CPU without native bfloat16 (on a GPU it takes minutes)."""
    if preset == "quick" and not torch.cuda.is_available() and not cpu_has_native_bf16():
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
    from persrag_lightning.evaluation.evaluate import file_name
    from persrag_lightning.llm.calibration import LabelReading

    path = Path(out_dir) / "predictions" / f"{file_name(name)}.labels.json"
    if not path.is_file():
        return {}
    stored = json.loads(path.read_text())
    reading, golds = LabelReading.from_json(stored), [r["gold"] for r in stored["rows"]]
    return {reader: (reading.under(reader, reading.decision).answers, golds) for reader in readers}


def choose_on_dev(common: list[str], evaluate_args: list[str], names: list[str], run_name: str,
                  task: str, readers: list[str] | None = None,
                  folder: str = "select-on-dev") -> tuple[str, str | None, dict[str, float]]:
    """Evaluate `names` on dev (at most DEV_SELECTION_EXAMPLES questions, or `evaluate_args`' own count, e.g. from
    `--questions`) and return the best configuration by the task's first metric, with the dev numbers: the main
    job's recipe is chosen here, never on test. With `readers` (label calibrations), each configuration's stored
    label scores are also re-read under each calibration (no LLM pass) and the best (configuration,
    calibration) pair is chosen. A candidate whose dev answers equal an earlier one's is no choice: it is
    dropped, saying so, and the earlier one stands. The dev tables are written to runs/<run_name>/<folder>/."""
    from persrag_lightning.evaluation.stats import _HIGHER_IS_BETTER, LampMetricFn, metric_names

    metric = metric_names(task)[0]
    out_dir = f"runs/{run_name}/{folder}"
    results = evaluate_command(["--config", "evaluate_cfrag.yaml", *common,
                                f"--evaluation.max_examples={DEV_SELECTION_EXAMPLES}", *evaluate_args,
                                "--evaluation.split=dev", "--evaluation.reader_free=false",
                                f"--evaluation.out_dir={out_dir}", f"--only={json.dumps(names)}"])
    scores: dict[tuple[str, str | None], float] = {}
    answers: dict[tuple[str, str | None], list[str]] = {}
    for name in (n for n in names if n in results):
        readings = dev_readings(out_dir, name, readers) if readers else {}
        if not readings:  # generated answers, or no stored scores: the evaluation's own number
            scores[(name, None)] = results[name][metric]
            continue
        for reader, (said, golds) in readings.items():
            scores[(name, reader)], answers[(name, reader)] = LampMetricFn(task, metric)(said, golds), said
    if not scores:
        raise SystemExit("persrag pipeline: no CFRAG configuration could be evaluated on dev")
    candidates = list(scores)
    label = {c: c[0] + (f" [calibration {c[1]}]" if c[1] else "") for c in candidates}
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


def report_strategies(preset: Preset, chosen: str, paper_chain: bool) -> list[str] | None:
    """The preset's reported rows with `{chosen}` / the chosen order's "w/o user retrieval" filled in (both
    candidates of the dev choice are rows: CFRAG and "w/o reranker tuning"); without the paper's chain trained,
    no row of it."""
    if preset["strategies"] is None:
        return None
    rows = [r.replace("{chosen}", chosen) for r in preset["strategies"]]
    rows = [CANDIDATES[chosen] if r == "w/o user retrieval{order}" else r for r in rows]
    if not paper_chain:
        rows = [r for r in rows if "(paper" not in r]
    return list(dict.fromkeys(rows))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="persrag pipeline", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
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
    preset = PRESETS[opts.preset]
    try:
        task = get_task(opts.task).name
    except ValueError as e:
        parser.error(str(e))
    judgments = opts.judgments or preset["judgments"]
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
    judged = "" if judgments == preset["judgments"] else f"-{judgments}"
    source = "synthlamp" if opts.data_dir is None else Path(opts.data_dir).resolve().name
    run_name = opts.run_name or f"{source}-{suffix}{opts.preset}{judged}"
    common = [f"--run_name={run_name}", f"--export_root={opts.export_root}"]
    llm = [f"--data.init_args.llm.backend={opts.llm_backend}"] if opts.llm_backend else []
    evaluate_llm = [f"--evaluation.llm.backend={opts.llm_backend}"] if opts.llm_backend else []
    paper_chain = bool(preset.get("paper_chain")) and judgments != "none"  # else the main chain is the paper's
    feedback = [*preset["feedback"], *precision_args(preset.get("feedback_precision")), *llm,
                *label_args(preset.get("label_precision"), opts.llm_backend)]
    # stage 1 and the generator have their own settings; the other stages are feedback stages
    per_kind = {"user_encoder": [*preset["user_encoder"], *precision_args(preset.get("user_encoder_precision")),
                                 f"--model.init_args.judgments={judgments}"],
                "generator": [*preset["generator"], *precision_args(preset.get("generator_precision")),
                              *generator_task]}
    wanted = [n for n in (preset["stages"] or STAGES) if paper_chain or n not in PAPER_STAGES]
    print(f"[pipeline] {describe_cpu()}; bfloat16 native: {bf16_verdict()}")
    if note := float32_reader_note(opts.preset):
        print(note)
    if questions is not None:
        print(f"[pipeline] --questions {questions}: the dev choice and the table read the first {questions} dev and "
              "test questions by id (a fixed subset; wider intervals)")

    timings = []

    def fit(stage: str, more: tuple[str, ...] = ()) -> None:
        if stage_done(opts.export_root, run_name, stage):
            print(f"[pipeline] {stage}: exported already, skipped")
            return
        config, variant = STAGES[stage]
        args = ["--config", config, *preset["data"], *data_task,
                *per_kind.get(stage.removesuffix("_paper"), feedback), *variant, *more]
        t0 = time.perf_counter()
        print(f"[pipeline] {stage}: python train.py fit {' '.join(args + common + extra)}")
        lightning_command(["fit", *args, *common, "--trainer.enable_progress_bar=false", *extra])
        timings.append((stage, time.perf_counter() - t0))

    for stage in wanted:
        if stage != "generator":
            fit(stage)
    chosen, calibration, dev_scores = "CFRAG", None, {}
    readers = preset.get("readers") if get_task(task).labels is not None else None
    if preset.get("select_order_on_dev"):
        t0 = time.perf_counter()
        chosen, calibration, dev_scores = choose_on_dev(common, [*evaluate_args, *evaluate_llm], list(CANDIDATES),
                                                        run_name, task, readers)
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
                common, [*evaluate_args, *evaluate_llm], [f"{chosen} + tuned generator"], run_name, task, readers,
                folder="select-on-dev/generator")
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
    if rows is not None and f"{chosen} + tuned generator" in rows and "bm25 + tuned generator" in rows:
        # the goal's third test: the tuned generator reading the recipe's docs against it reading BM25's
        goal = [[f"{chosen} + tuned generator", "bm25 + tuned generator"]]
        tests.append(f"--evaluation.pairs={json.dumps(goal)}")
    evaluate_command(["--config", "evaluate_cfrag.yaml", *common, *evaluate_args, *only, *tests, *evaluate_llm])
    timings.append(("evaluate", time.perf_counter() - t0))
    print("\n".join(f"[pipeline] {s}: {t / 60:.1f} min" for s, t in timings))
    # what ran where, beside the run's bundles: the raw record a table of main-job times is made from
    atomic_write_json(Path(opts.export_root) / run_name / "pipeline.json", {
        "argv": argv, "preset": opts.preset, "task": task, "judgments": judgments, "split": opts.split,
        "questions": questions,
        "machine": describe_cpu(), "bf16_native": bf16_is_native(), "bf16_verdict": bf16_verdict(),
        "precision": {k: precision_args(preset.get(f"{k}_precision"))
                      for k in ("user_encoder", "feedback", "generator")},
        "feedback_labels": label_args(preset.get("label_precision"), opts.llm_backend),
        "corpus_embeddings": embedding_precision(), "evaluation_reranker": resolve_reranker_runtime(next(
            (a.split("=", 1)[1] for a in evaluate_args if a.startswith("--evaluation.reranker_runtime=")), "fp32")),
        "chosen_on_dev": chosen, "calibration_chosen_on_dev": calibration,
        "generator_calibration_chosen_on_dev": generator_calibration, "dev_scores": dev_scores,
        "minutes": {s: round(t / 60, 2) for s, t in timings},
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
