"""Re-read an evaluation's stored label scores under every calibration and decision rule, without the LLM.

For each row of an evaluation folder that stored `predictions/<row>.labels.json` (`answer_mode: choose`), prints one
line per (calibration, decision): the three most frequent answers with their counts and the task's first metric;
then, per calibration, whether the scores carry anything about the gold at all: the Pearson correlation between
the expected label value under the calibrated distribution and the gold (ordered tasks), or the share of questions
whose gold gets the highest calibrated probability (unordered ones). Prints Markdown; reads files only.

    python benchmarks/reread_labels.py runs/synthlamp-lamp3-quick/select-on-dev
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.stats import LampMetricFn, metric_names
from persrag_lightning.reading.decision import CALIBRATIONS, DECISIONS
from persrag_lightning.reading.label_reading import LabelReading


def signal(reading: LabelReading, golds: list[str]) -> str:
    """How much the calibrated scores know about the gold, with no decision rule in between."""
    probs = np.array(reading.probabilities)
    if get_task(reading.task).kind == "regression":
        expected = probs @ np.array([float(label) for label in reading.labels])
        if expected.std() == 0:
            return "corr(E[label], gold) undefined (constant)"
        return f"corr(E[label], gold) {np.corrcoef(expected, np.array(golds, dtype=float))[0, 1]:.3f}"
    hits = np.mean([reading.labels[int(np.argmax(p))] == g for p, g in zip(probs, golds)])
    return f"gold ranked first {hits:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="an evaluation's out_dir (it holds predictions/)")
    args = parser.parse_args()
    files = sorted((Path(args.out_dir) / "predictions").glob("*.labels.json"))
    if not files:
        raise SystemExit(f"{args.out_dir}/predictions: no *.labels.json (evaluate with answer_mode: choose)")
    for path in files:
        stored = json.loads(path.read_text())
        reading, golds = LabelReading.from_json(stored), [r["gold"] for r in stored["rows"]]
        metric = metric_names(reading.task)[0]
        print(f"\n### {path.name.removesuffix('.labels.json')} ({reading.task}, {len(golds)} questions; golds: "
              + ", ".join(f"{g} {n}" for g, n in Counter(golds).most_common()) + ")\n")
        print(f"| calibration | decision | answers (top 3) | {metric} | scores vs gold |\n|---|---|---|---|---|")
        for calibration in (c for c in CALIBRATIONS if c in reading.terms_by):
            for decision in DECISIONS[1:]:
                try:
                    read = reading.under(calibration, decision)
                except ValueError:
                    continue  # median / mean on unordered labels
                answers = read.answers
                top = ", ".join(f"{a} {n}" for a, n in Counter(answers).most_common(3))
                print(f"| {calibration} | {decision} | {top} | {LampMetricFn(reading.task, metric)(answers, golds):.3f}"
                      f" | {signal(read, golds)} |")


if __name__ == "__main__":
    main()
