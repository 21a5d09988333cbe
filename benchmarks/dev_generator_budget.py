"""Dev-only: how many train prompts the quick preset's generator stage needs to learn a task's labels.

    python benchmarks/dev_generator_budget.py --run_name synthlamp-lamp3-quick --task LaMP-3 --prompts 32 128 256

After a quick run of `--task` (its bundles under checkpoints/<run_name>/ and its choice in pipeline.json), trains
the generator stage as the quick preset does (batch 8, one epoch, lr 1e-3, LoRA) on the first N train prompts of
the configuration chosen on dev, for each N of `--prompts` (exported as `generator_dev<N>`; an existing export is
reused), then answers the 300 dev questions with each tuned generator under the calibration chosen on dev and
prints one row per N: optimizer steps, training minutes, the dev metric, the share of the most frequent answer and
the golds' own top share. The test split is never read: the preset's number is chosen here.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from persrag_lightning.commands.train import lightning_command
from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.evaluate import Evaluation
from persrag_lightning.evaluation.stats import metric_names
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.pipeline import decisions, runs
from persrag_lightning.presets import load_preset
from persrag_lightning.retrieval.strategies import strategy_by_name
from persrag_lightning.retrieval.tuned_generator import TunedGenerator
from persrag_lightning.stages import cli_overrides, run_folder

BATCH = 8  # the quick preset's generator batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_name", required=True)
    parser.add_argument("--task", default="LaMP-2")
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--export_root", default="checkpoints")
    args = parser.parse_args()
    task = get_task(args.task).name
    run_dir = run_folder(args.export_root, args.run_name)
    record = json.loads((run_dir / "pipeline.json").read_text())
    chosen, calibration = record["chosen_on_dev"], record.get("calibration_chosen_on_dev") or "none"
    preset = load_preset("quick")
    quick = cli_overrides({k: v for k, v in preset.generator.items() if k != "data.init_args.splits.max_train_examples"})
    minutes: dict[int, float] = {}
    for n in args.prompts:
        stage = f"generator_dev{n}"
        if (run_dir / stage / "config.json").is_file():
            continue
        t0 = time.perf_counter()
        lightning_command(["fit", "--config", "generator.yaml", *quick,
                           f"--data.init_args.splits.max_train_examples={n}",
                           *cli_overrides(decisions.precision_overrides(preset.precision.generator)),
                           f"--data.init_args.task={task}", f"--data.init_args.strategy={chosen}",
                           f"--stage_name={stage}", f"--run_name={args.run_name}",
                           f"--export_root={args.export_root}", "--trainer.enable_progress_bar=false"])
        minutes[n] = (time.perf_counter() - t0) / 60
    base = strategy_by_name("configs/evaluate_cfrag.yaml", chosen, str(run_dir), "bf16_if_native")
    rows = [TunedGenerator(chosen, str(run_dir / f"generator_dev{n}"), name=f"{n} prompts") for n in args.prompts]
    evaluation = Evaluation(task=task, split="dev", max_examples=runs.DEV_SELECTION_EXAMPLES,
                            out_dir=f"runs/{args.run_name}/dev-generator-budget", reference=chosen,
                            reranker_runtime="bf16_if_native", reader_free=False,
                            llm=LLMConfig(answer_mode="choose", calibration=calibration,
                                          options={"dtype": "bf16_if_native"}))
    summary = evaluation.run([base, *rows])
    metric = metric_names(task)[0]
    golds = [e.target for e in evaluation.examples(evaluation.source.load())]
    gold, count = Counter(golds).most_common(1)[0]
    print(f"\n{task} dev, {summary.n_examples} questions, {chosen} docs, calibration {calibration}; golds' top "
          f"label {gold} ({count / len(golds):.0%})\n")
    print(f"| generator | train prompts | steps | train min | {metric} | top answer (share) |\n|---|---|---|---|---|---|")
    for name, (answer, share) in evaluation.top_answers.items():
        n = int(name.split()[0]) if name.endswith(" prompts") else 0
        cells = [name, str(n or "-"), str(n // BATCH if n else "-"),
                 f"{minutes[n]:.1f}" if n in minutes else ("(reused)" if n else "-")]
        print("| " + " | ".join([*cells, str(summary.intervals[name][metric]), f"{answer} ({share:.0%})"]) + " |")


if __name__ == "__main__":
    main()
