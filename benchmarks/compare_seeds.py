"""Main-job runs of one data set under several training seeds, read together: per seed, the reference row (chosen on
dev in that run) against the rows it must beat, each with the run's own paired test; then over the seeds, per test
question, the reference's mean score against each row's mean score (accuracy: the share of seeds that answered it;
MAE: the mean absolute error), with a bootstrap interval of the mean difference and a sign-flip test over the
questions. The pooled test asks whether the method, trained under any seed, beats the row on these questions: the
seeds vary the training, not the questions, so it says nothing beyond this question set. The last column is the
smallest mean difference such a test would find at 80 % power (two-sided, p < 0.05) with the per-question differences'
spread as observed (a normal approximation: (1.96 + 0.84) x their standard deviation / sqrt(questions)): what this
question set can tell from zero at all. One run alone is a valid input (its per-question differences, no pooling).

    python benchmarks/compare_seeds.py runs/<seed 0> runs/<seed 1> runs/<seed 2> [--rows bm25 "w/o user retrieval"]
        [--data_dir <LaMP folder>]   # the runs' data (default: the embedded SynthLaMP their metrics.json names)

A row named by a prefix takes the run's first row that starts with it ("w/o user retrieval" is the reference's
order's row).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.evaluation.stats import LampMetricFn, bootstrap_interval, sign_flip_test
from persrag_lightning.metrics.primary import primary_metric
from persrag_lightning.retrieval.strategies import file_name

Z_ALPHA, Z_POWER = 1.96, 0.8416  # the normal quantiles of a two-sided p < 0.05 and of 80 % power


def row_name(metrics: dict, prefix: str) -> str:
    """The run's first row named `prefix` or starting with it (the reference excluded)."""
    names = [n for n in metrics["results"] if n != metrics["reference"]]
    found = [n for n in names if n == prefix] or [n for n in names if n.startswith(prefix)]
    if not found:
        raise SystemExit(f"no row {prefix!r} among {names}")
    return found[0]


def per_question(run: Path, row: str, golds: dict[str, str], metric: LampMetricFn) -> dict[str, float]:
    """A row's per-question score (accuracy: 1 or 0; MAE: the absolute error), by question id."""
    answers = {p["id"]: p["output"] for p in json.loads((run / "evaluate/predictions" /
                                                         f"{file_name(row)}.json").read_text())["golds"]}
    ids = sorted(answers)
    values, gold = metric.encode([answers[i] for i in ids], [golds[i] for i in ids])
    scores = (values == gold).astype(float) if metric.name == "accuracy" else np.abs(values)
    return dict(zip(ids, scores.tolist()))


def detectable(diff: np.ndarray) -> float:
    """The smallest mean of per-question differences a two-sided test at p < 0.05 finds with 80 % power, given
    their observed standard deviation (normal approximation)."""
    return float((Z_ALPHA + Z_POWER) * diff.std(ddof=1) / np.sqrt(len(diff)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--rows", nargs="+", default=["bm25", "w/o user retrieval"])
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--cache_dir", default=".cache/persrag")
    args = parser.parse_args()
    runs = [(run, json.loads((run / "evaluate/metrics.json").read_text())) for run in args.runs]
    task, split = runs[0][1]["task"], runs[0][1]["split"]
    synth = runs[0][1].get("synth")
    source = LampSource(task, args.data_dir, synth=SynthConfig(**synth) if synth and not args.data_dir else None,
                        cache_dir=args.cache_dir)
    source.prepare()
    golds = {e.example_id: e.target for e in source.load().examples[split]}
    name = primary_metric(task).name
    metric = LampMetricFn(task, name)
    print(f"{task} {split}, {len(golds)} questions, {name}; {len(runs)} runs\n")
    print(f"| run | reference (chosen on dev) | {name} | " + " | ".join(f"{r} (p)" for r in args.rows) + " |")
    print("|---|---|---|" + "---|" * len(args.rows))
    pooled: dict[str, list[dict[str, float]]] = {"reference": [], **{r: [] for r in args.rows}}
    for run, m in runs:
        ref = m["reference"]
        cells = []
        for prefix in args.rows:
            row = row_name(m, prefix)
            cells.append(f"{m['results'][row][name]:.3f} ({m['p_values'][row][name]:.3f})")
            pooled[prefix].append(per_question(run, row, golds, metric))
        pooled["reference"].append(per_question(run, ref, golds, metric))
        print(f"| {run.name} | {ref} | {m['results'][ref][name]:.3f} | " + " | ".join(cells) + " |")
    ids = sorted(set.intersection(*(set(s) for scores in pooled.values() for s in scores)))
    mean = {key: np.mean([[s[i] for i in ids] for s in scores], axis=0) for key, scores in pooled.items()}
    seeds = f"{len(runs)} seeds" if len(runs) > 1 else "1 seed"
    print(f"\nOver the {seeds}, per question ({len(ids)} questions): the reference's mean {name} "
          f"{mean['reference'].mean():.3f}")
    print(f"\n| row | mean {name} | reference − row [95% interval] | p (sign flip over questions) | "
          "smallest difference detected at 80 % power |")
    print("|---|---|---|---|---|")
    for prefix in args.rows:
        diff = mean["reference"] - mean[prefix]
        low, high = bootstrap_interval(diff)
        print(f"| {prefix} | {mean[prefix].mean():.3f} | {diff.mean():+.3f} [{low:+.3f}, {high:+.3f}] | "
              f"{sign_flip_test(diff):.4f} | {detectable(diff):.3f} |")


if __name__ == "__main__":
    main()
