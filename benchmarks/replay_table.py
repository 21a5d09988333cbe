"""Replay a run's table through serving: `CFRAGPipeline.from_pretrained(run)`, every choice left to the run's record
(the docs' order, the reader, its decision, the float32 GEMM paths), answers the test questions of the record's
table, and each answer is compared with the reference row's prediction in the evaluation's output. Serving runs with
the evaluation's exact runtimes here (fp32 query encoder, the table's reranker runtime, docs tokenised per pair
unless `--cache_doc_tokens`), each question seeing its own profile as the evaluation's does; what differs from the
table is then what serving decides otherwise. Prints how many answers equal the table's, the GEMM paths served and
the first questions that differ.

Run from the folder the main job ran in (its `checkpoints/` and `runs/`), e.g. beside the pipeline's paths and then
on torch's, to see what the paths change:

    python benchmarks/replay_table.py --run checkpoints/synthlamp-quick
    PERSRAG_GEMM=torch python benchmarks/replay_table.py --run checkpoints/synthlamp-quick

`--query_runtime auto` encodes the questions as serving does by default (OpenVINO where installed) in place of
the evaluation's fp32; where answers then differ, the served answers' metric is printed beside the table's, with
intervals and the paired test.

`--row` replays another configuration the dev choice could have taken (a row of the table, by its name in
evaluate_cfrag.yaml), served with that configuration's order, m and gate (`record.CONFIGURATIONS`) in place of the
record's, e.g. `--row "CFRAG (split reranker)"` on a `--preset quick-split` run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def table_evaluation(run: Path, row: str | None):
    """The record's test-table evaluation reading one row alone (the reference row, or `row` by its config name),
    and the row's table name."""
    from persrag_lightning.pipeline.runs import EvaluationRun
    from persrag_lightning.record import RECORD, TABLE

    record = json.loads((run / RECORD).read_text())
    table = EvaluationRun(**[e for e in record["evaluations"] if e.get("purpose") == TABLE][-1])
    if row is not None:
        table.only = [row]
        return table, table.names.get(row, row)
    table.only = [record["chosen_on_dev"]]
    return table, record.get("reference_row") or record["chosen_on_dev"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the run's export folder (checkpoints/<run_name>)")
    ap.add_argument("--shown", type=int, default=10, help="differing questions listed")
    ap.add_argument("--row", default=None, help="a configuration of the dev choice to replay in place of the "
                                                "record's (its name in evaluate_cfrag.yaml); default: the record's")
    ap.add_argument("--cache_doc_tokens", action="store_true",
                    help="serving's doc cache in place of the evaluation's per-pair tokens: docs tokenised once, a "
                         "split reranker's doc states computed for the whole store at load (serving's default)")
    ap.add_argument("--query_runtime", default="fp32",
                    help="the query encoder's runtime: fp32 (the evaluation's, default) or auto (serving's default: "
                         "OpenVINO where installed), to score what serving serves")
    ap.add_argument("--cache_dir", default=None, help="serving's cache (embeddings of the docs made on this "
                                                      "process's paths when empty); default: the evaluation's")
    args = ap.parse_args()
    from persrag_lightning.commands.evaluate import for_run
    from persrag_lightning.data.lamp import read_outputs
    from persrag_lightning.evaluation.arguments import evaluate_parser
    from persrag_lightning.pipeline.command import LocalRunner
    from persrag_lightning.record import CONFIGURATIONS
    from persrag_lightning.retrieval.base import DocStore
    from persrag_lightning.retrieval.strategies import file_name
    from persrag_lightning.serving import CFRAGPipeline

    run = Path(args.run)
    if args.row is not None and args.row not in CONFIGURATIONS:
        ap.error(f"--row {args.row!r}: not a configuration the dev choice takes; one of {', '.join(CONFIGURATIONS)}")
    table, row = table_evaluation(run, args.row)
    configuration = {} if args.row is None else vars(CONFIGURATIONS[args.row])
    cfg = for_run(LocalRunner().evaluation_config(table))
    evaluator = evaluate_parser().instantiate_classes(cfg).evaluation
    settings = cfg.evaluation.init_args
    out_dir = Path(settings.out_dir)
    predictions = read_outputs(out_dir / "predictions" / f"{file_name(row)}.json", evaluator.task)
    dataset = evaluator.source.load()
    examples = sorted((e for e in dataset.examples[settings.split] if e.example_id in predictions),
                      key=lambda e: e.example_id)
    pipe = CFRAGPipeline.from_pretrained(run, cache_dir=args.cache_dir or settings.cache_dir,
                                         query_runtime=args.query_runtime,
                                         reranker_runtime=settings.reranker_runtime,
                                         cache_doc_tokens=args.cache_doc_tokens,
                                         **configuration)
    replay = CFRAGPipeline(pipe.strategy, DocStore(dataset), pipe.llm_config, pipe.k, reader=pipe.reader_spec)
    start = time.perf_counter()
    answers = replay.generate_batch([e.user_id for e in examples], [e.input for e in examples],
                                    example_ids=[e.example_id for e in examples])
    seconds = time.perf_counter() - start
    differ = [(e.example_id, predictions[e.example_id], a.answer) for e, a in zip(examples, answers)
              if a.answer != predictions[e.example_id]]
    same = len(examples) - len(differ)
    print(f"\nrun {run}; table row {row!r} ({out_dir / 'predictions'}); PERSRAG_GEMM="
          f"{os.environ.get('PERSRAG_GEMM', '(unset)')}; cache {args.cache_dir or settings.cache_dir}\n{pipe.serves}\n")
    print("| questions | served answers equal to the table's | share | seconds |\n|---|---|---|---|")
    print(f"| {len(examples)} of {len(predictions)} predicted | {same} | {same / max(len(examples), 1):.3f} | "
          f"{seconds:.1f} |")
    for example_id, table_answer, served in differ[: args.shown]:
        print(f"- {example_id}: table {table_answer!r}, served {served!r}")
    if differ and all(e.target is not None for e in examples):  # the served answers' own metric beside the table's
        from persrag_lightning.evaluation.report import summarise

        golds = [e.target for e in examples]
        summary = summarise(evaluator.task, {"table": [predictions[e.example_id] for e in examples],
                                             "served": [a.answer for a in answers]}, golds, reference="table")
        print("\n" + summary.table(pipe.llm_config.answer_mode, settings.split))


if __name__ == "__main__":
    main()
