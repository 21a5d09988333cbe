"""Profile items read as questions: a labelled item of a train question's profile is a question the
user answered before, read with the same user's strictly older items (`older_profile_questions`,
`profile_item`), and, with `mix_items`, also the way CFRAG reads a question: with its first stage's
docs, most of them neighbours' (`collaborative_items`).

Read only the first way, the reader learns from the asker's own docs alone, and the prompts it
reads at test are mostly neighbours' docs (CFRAG's first stage over stage 1's similar users): a mix
strategy's train questions are a few percent of its examples. With `mix_items` each profile item is
read a second time with the mix strategy's own first stage (its top-m users, each user's top docs by
its retriever, merged by score; `retrieval/candidates.py`), over the docs each of those users had
dated strictly before the item, so the reader learns to read a neighbour's doc, its similarity and
its author's habit on as many questions as it learns the asker's own.

History rules: the users and their docs are those the train question the profile belongs to may see
(`DocStore.rows`); the item itself and every doc dated on or after it are left out, and every
habit (the asker's and each author's) counts only the labels dated before the item.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from persrag_lightning.data.records import Example, HistoryDoc, ReadDoc
from persrag_lightning.data.tasks import TaskSpec
from persrag_lightning.models.reader_inputs import ReaderQuestion, doc_text, reader_doc
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.candidates import CandidateSource

__all__ = ["collaborative_items", "older_profile_questions", "profile_item"]


def older_profile_questions(spec, user_docs: list[HistoryDoc], skip: set[str], k: int, vectors,
                            ) -> list[tuple[HistoryDoc, list[HistoryDoc]]]:
    """Each labelled item of a user's profile (`user_docs`, oldest first) as a question, with the k
    items of the same profile most similar to it (cosine of `vectors(text)`) among those dated
    strictly before it; items in `skip` (questions of any split, or items already read as a
    question) are never questions here, but stay another item's older docs.

    Args:
        spec: the task's spec (its label field and label list).
        user_docs: one user's profile items, oldest first.
        skip: ids of the items that are not to be questions.
        k: docs read with each question.
        vectors: the frozen encoder, text → unit vector.
    """
    out = []
    texts = [doc_text(spec, d) for d in user_docs]
    matrix = vectors(texts) if texts else None
    for i, doc in enumerate(user_docs):
        if doc.doc_id in skip or spec.doc_label(doc) == 0:
            continue
        older = [j for j in range(i) if user_docs[j].date < doc.date]
        if older:
            sims = (matrix[older] @ matrix[i]).tolist()
            ranked = [older[j] for j in sorted(range(len(older)), key=lambda j: -sims[j])][:k]
        else:
            ranked = []
        out.append((doc, [user_docs[j] for j in ranked]))
    return out


def profile_item(spec, user_id: str, user_docs: list[HistoryDoc], doc: HistoryDoc,
                 older: list[HistoryDoc]) -> ReaderQuestion:
    """A profile item read as a question: its older items are the asker's own, and the asker's
    habit counts the items dated strictly before it (what the user had labelled by then)."""
    n = len(spec.labels)
    habit = [0] * n
    for d in user_docs:
        if d.date < doc.date and (label := spec.doc_label(d)) > 0:
            habit[label - 1] += 1
    docs = [ReadDoc(d.doc_id, d.date, d.fields, user_id, True, 1.0, r, tuple(habit)) for r, d in enumerate(older)]
    return ReaderQuestion(doc_text(spec, doc), tuple(reader_doc(spec, d) for d in docs), tuple(habit))


class _Pool:
    """One user's docs a train question may see, with their dates and labels (index + 1; 0: none)."""

    def __init__(self, spec: TaskSpec, store: DocStore, owner: str, sim: float, query: Query) -> None:
        self.owner, self.sim = owner, sim
        self.rows = store.rows(owner, query=query)
        self.docs = [store.history_doc(int(r)) for r in self.rows]
        self.labels = np.array([spec.doc_label(d) for d in self.docs], dtype=np.int64)

    def before(self, item: HistoryDoc) -> np.ndarray:
        """Positions of the docs dated strictly before `item` (never the item itself)."""
        return np.array([i for i, d in enumerate(self.docs) if d.date < item.date and d.doc_id != item.doc_id],
                        dtype=np.int64)

    def habit(self, older: np.ndarray, n_labels: int) -> tuple[int, ...]:
        """How often the user gave each label over `older` docs."""
        seen = self.labels[older]
        return tuple(int(c) for c in np.bincount(seen[seen > 0], minlength=n_labels + 1)[1:])


def collaborative_items(spec: TaskSpec, store: DocStore, source: CandidateSource, example: Example,
                        items: Sequence[HistoryDoc], k: int) -> list[ReaderQuestion]:
    """Each of `items` (profile items of `example`'s user) read with the first k of `source`'s
    candidates over the docs dated before it, in first-stage order, with their provenance.

    Args:
        spec: the task's spec.
        store: the doc store `source` retrieves from.
        source: a CFRAG strategy's first stage (prepared).
        example: the train question whose profile holds the items (its user, and what it may see).
        items: the profile items to read, each a question.
        k: docs read with each item.
    """
    if not items:
        return []
    query = Query(example.user_id, example.query, example.input, example.example_id)
    pools = [_Pool(spec, store, owner, sim, query) for owner, sim in source.similar_users(example.user_id)
             if owner == example.user_id or store.shares(owner)]
    e_u = source.user_embedding(example.user_id)
    if e_u is not None:
        e_u = source.retriever.tuned_user_embedding(example.user_id, e_u)
    vectors = source.retriever.query_vectors([doc_text(spec, item) for item in items])
    n_labels = len(spec.labels)
    out = []
    for item, vector in zip(items, vectors):
        candidates: list[tuple[float, _Pool, int, tuple[int, ...]]] = []
        asker: tuple[int, ...] = (0,) * n_labels
        for pool in pools:
            older = pool.before(item)
            habit = pool.habit(older, n_labels)
            if pool.owner == example.user_id:
                asker = habit
            if not len(older):
                continue
            scores = source.retriever.score(vector, pool.rows[older], e_u)
            top = torch.topk(scores, min(source.k_per_user, len(older)))
            candidates += [(float(s), pool, int(older[i]), habit) for s, i in zip(top.values, top.indices)]
        # first-stage order: by score, ties in candidate order (retrieval/cfrag_inference.first_stage_order)
        ranked = sorted(candidates, key=lambda c: -c[0])[:k]
        docs = [ReadDoc(d.doc_id, d.date, d.fields, pool.owner, pool.owner == example.user_id,
                        1.0 if pool.owner == example.user_id else pool.sim, rank, habit)
                for rank, (_, pool, i, habit) in enumerate(ranked) for d in [pool.docs[i]]]
        out.append(ReaderQuestion(doc_text(spec, item), tuple(reader_doc(spec, d) for d in docs), asker))
    return out
