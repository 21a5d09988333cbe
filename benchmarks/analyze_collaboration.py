"""Where collaborative retrieval helps and where it hurts, on SynthLaMP: the evaluation's answers and retrieved docs
split by the generator's latent truth (is the question about a kind of film the user has tagged before?), or, with
`--groups history`, by the asker's visible history (thirds of the questions, as the table's breakdown cuts them).

    python benchmarks/analyze_collaboration.py --run_name synthlamp-quick [--groups history]

Reads what `persrag evaluate` cached (predictions and retrieved rows of each strategy, runs/<run>/evaluate/cache)
and the SynthLaMP config of the evaluation (metrics.json); no model and no LLM runs. Columns, per question group:
the reader's accuracy, `label_vote` (accuracy of the most frequent tag among the 5 retrieved docs: what the docs say,
without a reader), `answer_in_docs`; then, for all questions, own and same-community shares of the docs; with
`--groups history`, per group: the own docs' share, the share of neighbours' docs from the asker's community, and
how often an own doc and a neighbour's doc carries the gold tag.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig, iter_synth_users, load_communities
from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.breakdown import history_groups
from persrag_lightning.evaluation.reader_free import vote
from persrag_lightning.retrieval.base import DocStore
from persrag_lightning.retrieval.strategies import file_name


def latest_cache(cache: Path, name: str) -> dict:
    files = sorted(cache.glob(f"{file_name(name)}-*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no cached evaluation of {name!r} in {cache}; run `persrag evaluate` first")
    return json.loads(files[-1].read_text())


def share(flags: list[bool]) -> str:
    return f"{np.mean(flags):.3f}" if flags else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_name", default="synthlamp-quick")
    parser.add_argument("--cache_dir", default=".cache/persrag")
    parser.add_argument("--groups", choices=("kind", "history"), default="kind",
                        help="kind: seen / unseen kind of film; history: thirds by the asker's visible history")
    args = parser.parse_args()
    out = Path("runs") / args.run_name / "evaluate"
    metrics = json.loads((out / "metrics.json").read_text())
    synth = SynthConfig(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in metrics.get("synth", {}).items()}) if metrics.get("synth") else None
    if synth is None:
        raise SystemExit("this analysis needs a SynthLaMP evaluation (metrics.json has no synth config)")
    source = LampSource(metrics["task"], None, synth, args.cache_dir)
    dataset = source.load()
    store = DocStore(dataset)
    examples = sorted((e for e in dataset.examples[metrics["split"]] if e.target is not None),
                      key=lambda e: e.example_id)[: metrics["examples"]]
    unseen = {q.example_id: q.unseen for u in iter_synth_users(synth) for q in u.questions}
    communities = load_communities(source.data_dir) or {}
    never_tagged = sum(unseen[e.example_id] for e in examples)
    groups = {"all": [True] * len(examples), "seen kind": [not unseen[e.example_id] for e in examples],
              "unseen kind": [unseen[e.example_id] for e in examples]}
    if args.groups == "history":
        sizes = [len(e.profile) for e in examples]
        groups = {f"{min(sizes[i] for i in part)}-{max(sizes[i] for i in part)} docs": [i in set(part.tolist())
                                                                                      for i in range(len(examples))]
                  for part in history_groups(sizes, 3)}
    print(f"{metrics['task']} {metrics['split']}, {len(examples)} questions "
          f"({never_tagged} about a kind of film the user never tagged), answer mode "
          f"{metrics['answer_mode']}\n")
    per_group = ("accuracy", "label_vote", "answer_in_docs") + (
        ("own_docs", "same_community of neighbours' docs", "gold in own docs", "gold in neighbours' docs")
        if args.groups == "history" else ())
    header = ["method"] + [f"{m} ({g})" for g in groups for m in per_group]
    header += ["own_docs", "same_community_docs"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in metrics["results"]:
        if not list((out / "cache").glob(f"{file_name(name)}-*.json")):
            continue  # a reader-free row: no LLM answers to split
        cached = latest_cache(out / "cache", name)
        rows = []
        for e, pred, docs in zip(examples, cached["predictions"], cached["rows"]):
            tags = [store.history_doc(r).fields.get("tag", "") for r in docs]
            owners = [store.owner(r) for r in docs]
            own = [o == e.user_id for o in owners]
            theirs = [i for i, mine in enumerate(own) if not mine]
            rows.append((pred == e.target, vote(get_task("LaMP-2"), tags) == e.target, e.target in tags, own,
                         [communities.get(o) == communities.get(e.user_id) for o in owners],
                         [communities.get(owners[i]) == communities.get(e.user_id) for i in theirs],
                         [t == e.target for t, mine in zip(tags, own) if mine],
                         [tags[i] == e.target for i in theirs]))
        cells = [name]
        for mask in groups.values():
            sel = [r for r, keep in zip(rows, mask) if keep]
            cells += [f"{np.mean([r[i] for r in sel]):.3f}" for i in range(3)]
            if args.groups == "history":  # shares over the group's docs
                cells += [share([x for r in sel for x in r[i]]) for i in (3, 5, 6, 7)]
        cells += [share([x for r in rows for x in r[i]]) for i in (3, 4)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
