"""What label calibration costs the reader: `choose` prompts/s without calibration, with each calibration
(llm/calibration.py: its terms come from a few prompts per task) and with every calibration's terms at once (what
`persrag evaluate` computes so a stored reading can be re-read under any), next to the naive per-prompt contextual
calibration (each prompt's own docs with a content-free input, Zhao et al.'s demonstrations kept: one more prompt
per prompt). Prompts: the first --prompts SynthLaMP questions of --task with BM25's top-5 docs, built by the
evaluation's prompt path; SmolLM2 in the dtype `bf16_if_native` gives on this CPU. Each row also says how often its
most frequent answer is given (a reader answering by prior gives one label) and its accuracy / MAE on these
questions. Prints Markdown; asserts nothing about time.

    python benchmarks/bench_calibration.py [--task LaMP-3] [--prompts 96]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from bench_reader import main_job_prompts

from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.evaluate import Evaluation
from persrag_lightning.evaluation.stats import LampMetricFn, metric_names
from persrag_lightning.hardware import bf16_verdict, describe_cpu
from persrag_lightning.llm import load_llm
from persrag_lightning.llm.answer import allowed_labels
from persrag_lightning.llm.calibration import CONTENT_FREE_INPUTS, calibration_prompts
from persrag_lightning.llm.prompts import task_prompt
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading.decision import CALIBRATIONS, resolve_decision
from persrag_lightning.reading.label_reading import LabelReading
from persrag_lightning.reading.llm import LLMReader


def naive_contextual(llm, task: str, prompts: list[str], labels: list[str]) -> LabelReading:
    """Per-prompt contextual calibration: each prompt's own history with its input line's query made "N/A"."""
    line = task_prompt(task).input_format.replace("{query}", CONTENT_FREE_INPUTS[0])
    free = [p.rsplit("\n", 1)[0] + "\n" + line for p in prompts]
    rows, free_rows = llm.score_options(prompts, labels), llm.score_options(free, labels)
    shifted = [[v - f for v, f in zip(r, fr)] for r, fr in zip(rows, free_rows)]
    return LabelReading(task, tuple(labels), shifted, "none", resolve_decision(task), {"none": None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="LaMP-3")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--cache_dir", default=".cache/persrag")
    args = parser.parse_args()
    task = get_task(args.task).name
    labels = list(allowed_labels(task))
    llm = load_llm("hf", "smollm2", batch_size=args.batch_size, device="cpu", dtype="bf16_if_native")
    prompts = main_job_prompts(args.prompts, args.cache_dir, llm, task)
    evaluation = Evaluation(task=task, max_examples=args.prompts, cache_dir=args.cache_dir)
    evaluation.source.prepare()
    golds = [e.target for e in evaluation.examples(evaluation.source.load())]
    metric = metric_names(task)[0]
    print(f"{describe_cpu()}; bfloat16 native: {bf16_verdict()}; SmolLM2 {str(llm.model.dtype).split('.')[-1]}, "
          f"{len(prompts)} {task} prompts, batch {args.batch_size}\n")
    llm.score_options(prompts[: args.batch_size], labels)  # warm-up

    def timed(run) -> tuple[LabelReading, float]:
        t0 = time.perf_counter()
        reading = run()
        return reading, time.perf_counter() - t0

    def read(calibration: str, every: bool = False) -> LabelReading:  # the LLM reader, no store: every prompt read
        config = LLMConfig(answer_mode="choose", calibration=calibration)
        return LLMReader(config, llm=llm, remember_terms=False).read_prompts(task, prompts, every_calibration=every)

    base, base_s = timed(lambda: read("none"))
    rows = [("none (scores only)", base, base_s, 0)]
    for method in CALIBRATIONS[1:]:
        reading, seconds = timed(lambda m=method: read(m))
        rows.append((method, reading, seconds, len(calibration_prompts(task, method))))
    every, every_s = timed(lambda: read("none", every=True))
    rows.append(("every calibration's terms (evaluate)", every, every_s,
                 sum(len(calibration_prompts(task, m)) for m in CALIBRATIONS)))
    naive, naive_s = timed(lambda: naive_contextual(llm, task, prompts, labels))
    rows.append(("naive: per-prompt content-free input", naive, naive_s, len(prompts)))
    print(f"| reading | extra prompts | prompts/s | time vs none | top answer (share) | {metric} |")
    print("|---|---|---|---|---|---|")
    for name, reading, seconds, extra in rows:
        answers = reading.answers
        top, count = Counter(answers).most_common(1)[0]
        print(f"| {name} | {extra} | {len(prompts) / seconds:.2f} | {seconds / base_s:.2f}x | {top} "
              f"({count / len(answers):.0%}) | {LampMetricFn(task, metric)(answers, golds):.3f} |")
    gold_top, gold_count = Counter(golds).most_common(1)[0]
    print(f"\nGolds' most frequent label: {gold_top} ({gold_count / len(golds):.0%}). Decision: "
          f"{base.decision} (the task metric's default).")


if __name__ == "__main__":
    main()
