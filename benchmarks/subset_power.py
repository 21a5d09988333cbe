"""How often a smaller test set would show a run's significant differences: random subsets of its questions, re-tested.

    python benchmarks/subset_power.py --run benchmarks/results/cpu-2026-11-27j-mainjob-noamx --sizes 100 150 200

Reads a stored evaluation (`evaluate_metrics.json`: task, split, SynthLaMP config, reference row and paired tests;
`predictions/`: each row's answers in LaMP's output format) and rebuilds the golds from the SynthLaMP config; no model
runs. For each size n it draws `--draws` random subsets of n questions and counts how often each of the goal's tests
(the reference against BM25 and against its chain without user retrieval; every pair of metrics.json, e.g. + tuned
generator against BM25 + tuned generator) is significant (paired approximate randomisation, p < 0.05) in the run's
direction; then the first n questions by id (the subset `python train.py pipeline --questions n` reads) and the
other ones, with each test's p. Subsets of one run's questions, not new questions: the shares say how much a smaller
protocol leaves to chance, not the power of a fresh run.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.evaluation.stats import LampMetricFn, metric_names, paired_test
from persrag_lightning.retrieval.strategies import file_name

ALPHA = 0.05


def goal_tests(metrics: dict) -> list[tuple[str, str]]:
    """(a, b) pairs a run claims a > b for: its reference against BM25 and against its "w/o user retrieval" row,
    then every extra pair it reported."""
    reference = metrics["reference"]
    tests = [(reference, n) for n in metrics["results"] if n == "bm25" or n.startswith("w/o user retrieval")]
    tests += [(p["strategy"], p["against"]) for p in metrics.get("pairs", [])]
    return tests


def load_run(run: Path, cache_dir: str) -> tuple[dict, list[str], dict[str, list[str]]]:
    """(metrics.json, golds, answers per row), both in the evaluation's question order (by id)."""
    metrics = json.loads((run / "evaluate_metrics.json").read_text())
    if not metrics.get("synth"):
        raise SystemExit(f"{run / 'evaluate_metrics.json'}: not a SynthLaMP evaluation (no synth config)")
    synth = SynthConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in metrics["synth"].items()})
    source = LampSource(metrics["task"], None, synth, cache_dir)
    source.prepare()
    examples = sorted((e for e in source.load().examples[metrics["split"]] if e.target is not None),
                      key=lambda e: e.example_id)[: metrics["examples"]]
    answers = {}
    for name in metrics["results"]:
        path = run / "predictions" / f"{file_name(name)}.json"
        by_id = {r["id"]: r["output"] for r in json.loads(path.read_text())["golds"]}
        missing = [e.example_id for e in examples if e.example_id not in by_id]
        if missing:
            raise SystemExit(f"{path}: no answer for {missing[0]} ({len(missing)} questions missing)")
        answers[name] = [by_id[e.example_id] for e in examples]
    return metrics, [e.target for e in examples], answers


def tested(metric, answers: dict[str, list[str]], golds: list[str], tests: list[tuple[str, str]],
           idx: list[int], resamples: int) -> list[tuple[bool, float]]:
    """Per test, on the questions `idx`: (is a > b significant, in that direction?, the paired test's p)."""
    g = [golds[i] for i in idx]
    out = []
    for a, b in tests:
        pa, pb = [answers[a][i] for i in idx], [answers[b][i] for i in idx]
        p = paired_test(metric, pa, pb, g, resamples)
        out.append((metric(pa, g) > metric(pb, g) and p < ALPHA, p))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a results folder with evaluate_metrics.json and predictions/")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 150, 200])
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--resamples", type=int, default=1000, help="per paired test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache_dir", default=".cache/persrag")
    args = parser.parse_args()
    metrics, golds, answers = load_run(Path(args.run), args.cache_dir)
    metric = LampMetricFn(metrics["task"], metric_names(metrics["task"])[0])
    tests = goal_tests(metrics)
    n_all = len(golds)
    rng = random.Random(args.seed)
    print(f"{metrics['task']} {metrics['split']}, {n_all} questions of `{args.run}`; share of subsets on which "
          f"a > b is significant (p < {ALPHA}, {args.resamples} resamples per test); {args.draws} random subsets "
          f"per size (seed {args.seed}), then the first n by id and the other ones\n")
    names = [f"{a} > {b}" for a, b in tests]
    print("| questions | subsets | " + " | ".join(names) + " | all of them |\n|" + "---|" * (len(names) + 3))

    def row(label: str, kind: str, cells: list[str]) -> None:
        print(f"| {label} | {kind} | " + " | ".join(cells) + " |")

    def verdicts(idx: list[int]) -> list[str]:
        results = tested(metric, answers, golds, tests, idx, args.resamples)
        cells = [f"{'yes' if ok else 'no'} (p = {p:.3f})" for ok, p in results]
        return [*cells, "yes" if all(ok for ok, _ in results) else "no"]

    for n in sorted(set(args.sizes)):
        if not 0 < n < n_all:
            raise SystemExit(f"--sizes: {n} is not between 1 and {n_all - 1}")
        counts = [0] * (len(tests) + 1)
        for _ in range(args.draws):
            ok = [o for o, _ in tested(metric, answers, golds, tests, rng.sample(range(n_all), n), args.resamples)]
            for k, o in enumerate([*ok, all(ok)]):
                counts[k] += o
        row(str(n), f"{args.draws} random", [f"{c / args.draws:.0%}" for c in counts])
        row(str(n), "the first n by id", verdicts(list(range(n))))
        row(str(n_all - n), "the other ones", verdicts(list(range(n, n_all))))
    row(str(n_all), "the whole run", verdicts(list(range(n_all))))


if __name__ == "__main__":
    main()
