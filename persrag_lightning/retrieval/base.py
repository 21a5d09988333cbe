"""The one interface every retrieval method implements: queries in, top-k history docs with provenance out."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.records import HistoryDoc, LampDataset, User
from persrag_lightning.data.tasks import get_task


@dataclass(frozen=True)
class Query:
    """Who asks what: the user, the extracted query q and the raw LaMP input (for the prompt)."""

    user_id: str
    query: str
    input: str = ""
    example_id: str = ""


@dataclass(frozen=True)
class RetrievedDoc:
    """A doc chosen for the prompt, with where it came from and how each stage scored it."""

    row: int
    doc_id: str
    owner: str
    user_sim: float = 1.0
    retriever_score: float = math.nan
    reranker_score: float = math.nan
    text: str = ""


class DocStore:
    """Users' histories as corpus rows, with the records needed to render prompts."""

    def __init__(self, dataset: LampDataset, corpus: Corpus | None = None) -> None:
        self.dataset = dataset
        self.corpus = corpus or Corpus.from_dataset(dataset)
        self.user_index = self.corpus.user_index()

    def rows(self, user_id: str, max_history: int | None = None) -> np.ndarray:
        return self.corpus.user_rows(self.user_index[user_id], max_history)

    def owner(self, row: int) -> str:
        return self.corpus.user_ids[int(np.searchsorted(self.corpus.offsets, row, side="right")) - 1]

    def history_doc(self, row: int) -> HistoryDoc:
        owner = self.owner(row)
        return self.dataset.users[owner].docs[row - int(self.corpus.offsets[self.user_index[owner]])]

    def text(self, row: int) -> str:
        return self.corpus.texts[row]

    def add_user(self, user: User) -> np.ndarray:
        """Append a new user's history (oldest first) as new corpus rows; returns the rows."""
        if user.user_id in self.user_index:
            raise ValueError(f"user {user.user_id!r} already exists")
        spec = get_task(self.dataset.task)
        start = len(self.corpus)
        self.dataset.users[user.user_id] = user
        self.corpus.user_ids.append(user.user_id)
        self.corpus.doc_ids.extend(d.doc_id for d in user.docs)
        self.corpus.texts.extend(spec.render_doc(d) for d in user.docs)
        self.corpus.offsets = np.append(self.corpus.offsets, len(self.corpus))
        self.user_index[user.user_id] = len(self.corpus.user_ids) - 1
        return np.arange(start, len(self.corpus))

    def doc(self, row: int, **scores: float) -> RetrievedDoc:
        return RetrievedDoc(row, self.corpus.doc_ids[row], self.owner(row), **scores, text=self.corpus.texts[row])


class Strategy(ABC):
    """A retrieval method of the evaluation (zero-shot, BM25, ..., CFRAG and its ablations)."""

    name: str = "strategy"

    def prepare(self, store: DocStore) -> None:
        """Build whatever the method needs over the store (indexes, embeddings); called once before retrieve."""
        self.store = store

    @abstractmethod
    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        """Top-k docs per query, best first."""
