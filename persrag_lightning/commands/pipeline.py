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
from persrag_lightning.llm.hf import cpu_has_native_bf16
from persrag_lightning.retrieval.cfrag import STAGES

# Settings shared by every stage of a preset, as CLI overrides, the bundles it trains and the strategies it
# reports (None: every strategy of evaluate_cfrag.yaml). Every preset reports on the TEST split (dev selects).
#
# `quick` is the main job: within 20 minutes on 2 CPU cores with AMX (10–17 min measured; 23.6 on a Zen 4 without
# matrix units, README "Main job"). The 300-user SynthLaMP gives 300 test questions (one per
# user), enough for intervals that can show a difference. Answers are `choose` (the most likely of the 15 labels):
# the 135M LLM rarely *generates* a listed tag, so generated answers score ~0 whatever was retrieved. Feedback uses
# m = 3 users x k = 2 docs with log-likelihood labels (log p(y | prompt) ranks every
# candidate; the task metric would be 0 for most), 32 + 16 examples; the user encoder trains 20 epochs (30 in
# its config); inference keeps the paper's m = 6, k = 5. Answering costs
# ~0.3 s per full prompt on 2 cores (bfloat16), so the preset reports the strategies that answer the main question — does
# collaborative retrieval beat the best own-history retrieval? — and leaves the Table 3 ablations to `paper`.
# `paper` keeps the paper's m, k, all examples and generated answers (hours on CPU; minutes on a GPU node).
Preset = dict[str, list[str] | bool | None]
PRESETS: dict[str, Preset] = {
    "smoke": {  # the end-to-end test: every stage with the real embedded models, minutes on 2 cores
        "data": ["--data.init_args.synth.num_users=24"],
        "user_encoder": ["--trainer.max_epochs=3"],
        "feedback": ["--data.init_args.m=2", "--data.init_args.k=2", "--data.init_args.max_train_examples=8",
                     "--data.init_args.max_val_examples=4"],
        "generator": ["--data.init_args.max_train_examples=8", "--data.init_args.max_val_examples=4",
                      "--data.init_args.batch_size=4", "--trainer.max_epochs=1"],
        "evaluate": ["--evaluation.synth.num_users=24", "--evaluation.max_examples=6",
                     "--evaluation.llm.answer_mode=choose", "--evaluation.n_resamples=200"],
        "stages": None,
        "strategies": None,
    },
    "quick": {
        "data": [],
        "user_encoder": ["--trainer.max_epochs=20"],
        # The retriever and reranker train in bfloat16 autocast where the CPU computes it natively: with their
        # batches of 4 examples, 3.3x and 2.0x the official single-example float32 loop at m*k = 30 (README
        # "Retriever and reranker training"); elsewhere in float32.
        # Every step is logged: 8 steps per stage here (4 for the generator), which the configs' interval of 10
        # would leave without a single train/loss row.
        "feedback": ["--data.init_args.m=3", "--data.init_args.k=2", "--data.init_args.max_train_examples=32",
                     "--data.init_args.max_val_examples=16", "--data.init_args.feedback_metric=loglik",
                     "--trainer.log_every_n_steps=1"],
        "feedback_bf16_where_native": True,
        # The generator (LoRA on SmolLM2, trained on CFRAG's prompts) gets what is left of the budget once the
        # three "+ tuned generator" rows (~1.1 min each to answer 300 test prompts) are paid: ~2.5 minutes. It trains
        # 32 train examples x 1 epoch (4 steps of 8, so lr 1e-3 instead of 2e-4) in bfloat16 autocast and validates
        # on 16 dev examples. Measured alone with 48 examples (BM25 prompts, shared CPU at load 10-12): 336 s of CPU
        # time, read as ~3 min on 2 quiet cores; 32 examples cut the training third of it. On a quiet machine the
        # whole stage took 0.8 min in the main job (README "Generator training throughput").
        "generator": ["--data.init_args.max_train_examples=32", "--data.init_args.max_val_examples=16",
                      "--data.init_args.batch_size=8", "--trainer.max_epochs=1", "--trainer.precision=bf16-mixed",
                      "--model.init_args.lr=1e-3", "--trainer.log_every_n_steps=1"],
        # bfloat16 where the CPU computes it natively: evaluation 13.2 -> 6.7 min, the float32 answer on 95-99.7 %
        # of the prompts per strategy and the same conclusions (README). Feedback labels stay exact on CPUs (the
        # configs' `backend: auto`: float32 transformers or llama.cpp on f16 weights, whichever is faster here).
        "evaluate": ["--evaluation.llm.answer_mode=choose", '--evaluation.llm.options={"dtype": "bf16_if_native"}'],
        "stages": ["user_encoder", "retriever", "reranker", "generator"],
        # "w/o reranker tuning" (the same m·k candidates in first-stage order) shows what the quick preset's reranker,
        # trained for 8 steps, does to them (README "Main job")
        "strategies": ["zero_shot", "bm25", "CFRAG", "w/o user retrieval", "w/o reranker tuning",
                       "zero_shot + tuned generator", "bm25 + tuned generator", "CFRAG + tuned generator"],
    },
    "paper": {"data": [], "user_encoder": [], "feedback": [], "generator": [],
              "evaluate": ["--evaluation.llm.answer_mode=generate"], "stages": None, "strategies": None},
}


# `full-feedback`: the quick protocol (same data, stages, answers, reported rows) with the paper's amount of feedback,
# which the quick reranker lacks (README "Main job"): m = 6 users x k = 5 docs for every train and every dev question
# (600 + 300 questions x 30 candidates per stage), log-likelihood labels in batches of 64. ~2 x 27,000 LLM calls:
# minutes on a GPU node, hours on 2 CPU cores.
PRESETS["full-feedback"] = {
    **PRESETS["quick"],
    "feedback": ["--data.init_args.feedback_metric=loglik", "--data.init_args.llm.batch_size=64"],
}


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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="persrag pipeline", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--task", default="LaMP-2", help="LaMP task (default LaMP-2, the main job)")
    parser.add_argument("--judgments", choices=["none", "label", "paired"], default="none",
                        help="stage 1's input per history doc (judgment-aware encoder): the paper's text "
                             "only (default), + a label embedding, + a label-specific map of the doc vector; "
                             "only the user encoder gets it")
    parser.add_argument("--run_name", default=None,
                        help="default: synthlamp-<preset> (LaMP-2), synthlamp-lamp<N>-<preset> for another task, "
                             "with -<judgments> appended unless none")
    parser.add_argument("--export_root", default="checkpoints")
    parser.add_argument("--llm-backend", default=None,
                        help="auto, hf, llamacpp, openai or vllm for feedback labels and evaluation answers alike; "
                             "default: the configs' (feedback auto: the faster exact backend, timed once per machine; "
                             "evaluation hf, bfloat16 where native)")
    opts, extra = parser.parse_known_args(argv)
    preset = PRESETS[opts.preset]
    try:
        task = get_task(opts.task).name
    except ValueError as e:
        parser.error(str(e))
    data_task, generator_task, evaluate_args = task_args(task, preset)
    suffix = "" if task == "LaMP-2" else f"lamp{task.split('-')[1]}-"
    judged = "" if opts.judgments == "none" else f"-{opts.judgments}"
    run_name = opts.run_name or f"synthlamp-{suffix}{opts.preset}{judged}"
    common = [f"--run_name={run_name}", f"--export_root={opts.export_root}"]
    llm = [f"--data.init_args.llm.backend={opts.llm_backend}"] if opts.llm_backend else []
    # stage 1 and the generator have their own settings; the other stages are feedback stages
    judgments = [f"--model.init_args.judgments={opts.judgments}"] if judged else []
    per_stage = {"user_encoder": [*preset["user_encoder"], *judgments],
                 "generator": [*preset["generator"], *generator_task]}
    # bf16-mixed when the trainer runs on a CPU that computes bfloat16 natively. Not on a GPU (accelerator auto
    # picks CUDA when present): there bf16 pays only with large chunks (one H100, 32 examples per step at m·k = 30,
    # 256 rows per forward: 1.2x float32), not measured at the configs' 4 examples per step, and the GPU runs
    # reported in the README trained in float32 (README "GPU paths").
    native = preset.get("feedback_bf16_where_native") and not torch.cuda.is_available() and cpu_has_native_bf16()
    bf16 = ["--trainer.precision=bf16-mixed"] if native else []
    feedback = [*preset["feedback"], *bf16, *llm]
    stages = [(name, ["--config", config, *preset["data"], *data_task, *per_stage.get(name, feedback),
                      *variant])
              for name, (config, variant) in STAGES.items() if preset["stages"] is None or name in preset["stages"]]
    timings = []
    for stage, args in stages:
        if stage_done(opts.export_root, run_name, stage):
            print(f"[pipeline] {stage}: exported already, skipped")
            continue
        t0 = time.perf_counter()
        print(f"[pipeline] {stage}: python train.py fit {' '.join(args + common + extra)}")
        lightning_command(["fit", *args, *common, "--trainer.enable_progress_bar=false", *extra])
        timings.append((stage, time.perf_counter() - t0))
    t0 = time.perf_counter()
    only = [] if preset["strategies"] is None else [f"--only={json.dumps(preset['strategies'])}"]
    evaluate_llm = [f"--evaluation.llm.backend={opts.llm_backend}"] if opts.llm_backend else []
    evaluate_command(["--config", "evaluate_cfrag.yaml", *common, *evaluate_args, *only, *evaluate_llm])
    timings.append(("evaluate", time.perf_counter() - t0))
    print("\n".join(f"[pipeline] {s}: {t / 60:.1f} min" for s, t in timings))

