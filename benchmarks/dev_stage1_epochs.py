"""Dev-only: the quick preset's recipe chain with its stage 1 trained for another number of epochs, up to the dev
choice and no further (the test split is never evaluated: a recipe is chosen on dev).

    python benchmarks/dev_stage1_epochs.py --epochs 2 --seed 1     # run from the repository root

Trains `user_encoder`, `retriever` and `reranker` of the paired chain under `--run_name` (default
`dev-stage1-<epochs>ep-seed<seed>`; the feedback labels come from the project's cache when an earlier run made
them), evaluates both orders on the 300 dev questions as the pipeline's dev choice does and prints its line
`[pipeline] chosen on dev (accuracy): ...`; the table is in runs/<run_name>/select-on-dev/. Compare with the same
seed's dev line of a quick run (20 epochs).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from persrag_lightning.pipeline import command as pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run_name", default=None)
    args = parser.parse_args()
    preset = Path(tempfile.mkdtemp()) / "dev-stage1-epochs.yaml"  # the quick preset, stage 1's epochs changed
    preset.write_text(f"base: quick\nuser_encoder: {{trainer.max_epochs: {args.epochs}}}\n"
                      "stages: [user_encoder, retriever, reranker]\npaper_chain: false\n")
    evaluate = pipeline.run_evaluation

    def dev_only(cfg):
        if cfg.evaluation.init_args.split != "dev":  # the table on test: never in a dev-only experiment
            raise SystemExit("[dev_stage1_epochs] done: the dev choice is above; the test split is not evaluated")
        return evaluate(cfg)

    pipeline.run_evaluation = dev_only
    pipeline.main(["--preset", str(preset), f"--seed_everything={args.seed}",
                   "--run_name", args.run_name or f"dev-stage1-{args.epochs}ep-seed{args.seed}"])


if __name__ == "__main__":
    main()
