"""`persrag pipeline`: every CFRAG stage on the embedded default, in order, skipping stages already exported.

user encoder → feedback + retriever (and the ROPG-style baseline, on the same labels) → feedback + reranker (and
its "w/o e_u" ablation) → evaluation of every strategy and ablation, ending with the results table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from persrag_lightning.commands.evaluate import evaluate_command
from persrag_lightning.commands.train import lightning_command
from persrag_lightning.retrieval.cfrag import STAGES

# Settings shared by every stage of a preset, as CLI overrides. `quick` fits the main job in ~20 minutes on
# 2 CPU cores: fewer users, m = 3 users x k = 2 docs per example (paper: 6 x 5), a subset of the examples for
# feedback and evaluation (inference keeps the paper's m = 6, k = 5 for every preset), and the target's
# log-likelihood as eval(y, O): the embedded 135M LLM answers LaMP-2 correctly for ~4 % of the candidates, so the
# task metric labels carry signal for ~1 example in 8, while log p(y | prompt) ranks every candidate. `paper` keeps the paper's m, k and all examples (hours on CPU; minutes on a GPU node).
PRESETS: dict[str, dict[str, list[str]]] = {
    "smoke": {  # the end-to-end test: every stage with the real embedded models, minutes on 2 cores
        "data": ["--data.init_args.synth.num_users=24"],
        "user_encoder": ["--trainer.max_epochs=3"],
        "feedback": ["--data.init_args.m=2", "--data.init_args.k=2", "--data.init_args.max_train_examples=8",
                     "--data.init_args.max_val_examples=4"],
        "evaluate": ["--evaluation.synth.num_users=24", "--evaluation.max_examples=4"],
    },
    "quick": {
        "data": ["--data.init_args.synth.num_users=100"],
        "user_encoder": [],
        "feedback": ["--data.init_args.m=3", "--data.init_args.k=2", "--data.init_args.max_train_examples=64",
                     "--data.init_args.max_val_examples=16", "--data.init_args.feedback_metric=loglik"],
        "evaluate": ["--evaluation.synth.num_users=100", "--evaluation.max_examples=24"],
    },
    "paper": {"data": [], "user_encoder": [], "feedback": [], "evaluate": []},
}


def stage_done(export_root: str, run_name: str, stage: str) -> bool:
    return (Path(export_root) / run_name / stage / "config.json").exists()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="persrag pipeline", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--run_name", default=None, help="default: synthlamp-<preset>")
    parser.add_argument("--export_root", default="checkpoints")
    parser.add_argument("--llm-backend", default="hf", help="hf (default), llamacpp, openai or vllm")
    opts, extra = parser.parse_known_args(argv)
    preset = PRESETS[opts.preset]
    run_name = opts.run_name or f"synthlamp-{opts.preset}"
    common = [f"--run_name={run_name}", f"--export_root={opts.export_root}"]
    llm = [f"--data.init_args.llm.backend={opts.llm_backend}"]
    stages = [(name, ["--config", config, *preset["data"], *(preset["user_encoder"] if name == "user_encoder" else
                                                              [*preset["feedback"], *llm]), *variant])
              for name, (config, variant) in STAGES.items()]
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
    evaluate_command(["--config", "evaluate_cfrag.yaml", *common, *preset["evaluate"],
                      f"--evaluation.llm.backend={opts.llm_backend}"])
    timings.append(("evaluate", time.perf_counter() - t0))
    print("\n".join(f"[pipeline] {s}: {t / 60:.1f} min" for s, t in timings))

