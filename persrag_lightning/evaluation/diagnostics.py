"""What a row's retrieval put in its prompts, apart from what the reader made of it: whose docs they
are, whether they hold the answer, what they vote, and (on SynthLaMP) whether they come from the
asker's community; the evaluation adds them as plain columns of the table."""

from __future__ import annotations

import numpy as np

from persrag_lightning.data.records import Example
from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.reader_free import doc_labels, vote
from persrag_lightning.metrics import rouge_scorer
from persrag_lightning.retrieval.base import DocStore, RetrievedDoc

__all__ = ["retrieval_diagnostics", "same_community_chance"]

# generation tasks: the doc field written like the target (`best_doc_rouge1`: the best retrieved one
# against the gold); a LaMP-7 tweet is written like the paraphrase the user would give
TITLE_FIELDS = {"LaMP-4": "title", "LaMP-5": "title", "LaMP-7": "text"}


def retrieval_diagnostics(task: str, store: DocStore, examples: list[Example], retrieved: list[list[RetrievedDoc]],
                          communities: dict[str, int] | None) -> dict[str, float]:
    """Figures that isolate retrieval from the LLM: whose docs were retrieved, and do they hold the
    answer."""
    out: dict[str, float] = {}
    docs = [d for ds in retrieved for d in ds]
    # every row says how many docs its prompts held (ClusterRAG's top-B clusters may hold fewer than
    # k)
    out["docs_per_query"] = float(np.mean([len(ds) for ds in retrieved])) if retrieved else 0.0
    if not docs:
        return out
    out["own_docs"] = float(
        np.mean([d.owner == ex.user_id for ex, ds in zip(examples, retrieved) for d in ds])
    )
    if communities:
        out["same_community_docs"] = float(np.mean([
            communities.get(d.owner) == communities.get(ex.user_id) for ex, ds in zip(examples, retrieved) for d in ds]))
        out["same_community_chance"] = same_community_chance(examples, retrieved, communities)
    # a doc "holds the answer" when its label is the target
    if get_task(task).label_field is not None:
        spec = get_task(task)
        labels = [doc_labels(spec, store, [d.row for d in ds]) for ds in retrieved]  # rank order
        out["answer_in_docs"] = float(
            np.mean([(ex.target or "").strip() in ls for ex, ls in zip(examples, labels)])
        )
        # what the docs say without a reader: the row "<row> docs' vote" (reader_free.py)
        out["label_vote"] = float(
            np.mean([vote(spec, ls) == ex.target for ex, ls in zip(examples, labels)])
        )
    elif task in TITLE_FIELDS:
        scorer, field = rouge_scorer(), TITLE_FIELDS[task]
        out["best_doc_rouge1"] = float(np.mean([
            max((scorer.score(ex.target or "", str(store.history_doc(d.row).fields.get(field, "")))["rouge1"].fmeasure
                 for d in ds), default=0.0) for ex, ds in zip(examples, retrieved)]))
    return out


def same_community_chance(examples: list[Example], retrieved: list[list[RetrievedDoc]],
                          communities: dict[str, int]) -> float:
    """What `same_community_docs` would be if the other users' docs came from random users: own
    share + other users' share × the query user's community's share of the other users (per doc,
    averaged)."""
    sizes = np.bincount(np.array(list(communities.values())))
    share = {c: (sizes[c] - 1) / max(1, len(communities) - 1) for c in range(len(sizes))}
    return float(np.mean([1.0 if d.owner == ex.user_id else share.get(communities.get(ex.user_id, -1), 0.0)
                          for ex, ds in zip(examples, retrieved) for d in ds]))
