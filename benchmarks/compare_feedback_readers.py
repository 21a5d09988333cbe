"""Does the chain learn more from the reader that reads? Two runs of the same data whose retriever and reranker were
trained on different feedback (e.g. run A's labelled by the trained reader, run B's by the LLM), both read by the
same reader on the same questions: CFRAG in the reranked and in the first stage's order of each run, with paired
tests (A against B per order) and 95 % intervals. Dev by default: it is a choice of recipe, not a report.

    python benchmarks/compare_feedback_readers.py checkpoints/magazines-lamp3-quick checkpoints/magazines-llm-quick \
        --reader checkpoints/magazines-lamp3-quick/reader --data_dir magazines --task LaMP-3

The runs' own pipeline.json say which reader labelled their feedback; prints the evaluation's table, asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from persrag_lightning.evaluation.evaluate import Evaluation
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.retrieval.cfrag import CFRAG


def feedback_reader(run: Path) -> str:
    """Who labelled a run's feedback stages, from its pipeline.json (`llm` when it names none)."""
    record = run / "pipeline.json"
    return json.loads(record.read_text()).get("reader", "llm") if record.is_file() else "llm"


def chains(run: Path, label: str, cache_dir: str) -> list[CFRAG]:
    """The run's main chain in its two orders, named by whose feedback trained it."""
    common = {"user_encoder": str(run / "user_encoder"), "retriever": str(run / "retriever"), "cache_dir": cache_dir}
    return [CFRAG(**common, reranker=str(run / "reranker"), name=f"CFRAG reranked ({label})"),
            CFRAG(**common, reranker=None, name=f"CFRAG first-stage order ({label})")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="a run folder (checkpoints/<run>)")
    parser.add_argument("b", type=Path, help="the other run folder, same data")
    parser.add_argument("--reader", required=True, help="the reader of every row: `llm` or a trained reader export")
    parser.add_argument("--data_dir", default=None, help="the runs' LaMP folder (None: the embedded SynthLaMP)")
    parser.add_argument("--task", default="LaMP-2")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--max_examples", type=int, default=None)
    parser.add_argument("--cache_dir", default=".cache/persrag")
    parser.add_argument("--out_dir", default="runs/compare-feedback-readers")
    args = parser.parse_args()
    label_a, label_b = (f"{feedback_reader(r)} feedback, {r.name}" for r in (args.a, args.b))
    rows = chains(args.a, label_a, args.cache_dir) + chains(args.b, label_b, args.cache_dir)
    pairs = [[rows[0].name, rows[2].name], [rows[1].name, rows[3].name]]
    evaluation = Evaluation(task=args.task, data_dir=args.data_dir, cache_dir=args.cache_dir, split=args.split,
                            llm=LLMConfig(answer_mode="choose"), reader=args.reader, max_examples=args.max_examples,
                            out_dir=args.out_dir, reference=rows[0].name, pairs=pairs, reader_free=False)
    print(f"reader: {args.reader}; a = {args.a} ({label_a}); b = {args.b} ({label_b}); split {args.split}\n")
    print(evaluation.evaluate(rows).table)


if __name__ == "__main__":
    main()
