"""Two memory evaluations (`persrag evaluate --config evaluate_memory.yaml`, each with its own `out_dir`) compared
question by question: for each strategy both answered, the share of answers holding the planted fact in each run,
the questions only one run's answer holds it for, how many answers are the same text, and the two-sided paired
sign-flip p of the difference (evaluation/stats.sign_flip_test). The runs must have asked the same questions
(the same run_dir, users, facts and seed); a run that differs is refused. Asserts nothing.

    python benchmarks/compare_memory_answers.py runs/memory_float32 runs/memory_bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from persrag_lightning.evaluation.stats import sign_flip_test


def answers(out_dir: Path) -> dict[str, list[dict]]:
    """A run's answers.jsonl, per strategy in the run's order."""
    path = out_dir / "answers.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no answers; run the memory evaluation with this code first")
    per: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        per.setdefault(row["strategy"], []).append(row)
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the first run's out_dir")
    ap.add_argument("b", type=Path, help="the second run's out_dir")
    args = ap.parse_args()
    a, b = answers(args.a), answers(args.b)
    print(f"A: {args.a}; B: {args.b}\n")
    print("| strategy | questions | A holds the fact | B holds the fact | only A | only B | same answer text | "
          "paired p (sign flip) |\n|---|---|---|---|---|---|---|---|")
    for name in (s for s in a if s in b):
        asked = [(r["user_id"], r["question"]) for r in a[name]]
        if asked != [(r["user_id"], r["question"]) for r in b[name]]:
            raise SystemExit(f"{name}: the two runs asked different questions; compare runs of one configuration")
        ha = np.array([r["hit"] for r in a[name]], dtype=float)
        hb = np.array([r["hit"] for r in b[name]], dtype=float)
        same = sum(x["answer"] == y["answer"] for x, y in zip(a[name], b[name]))
        print(f"| {name} | {len(ha)} | {ha.mean():.3f} | {hb.mean():.3f} | {int(((ha == 1) & (hb == 0)).sum())} | "
              f"{int(((ha == 0) & (hb == 1)).sum())} | {same} | {sign_flip_test(ha - hb):.3f} |")


if __name__ == "__main__":
    main()
