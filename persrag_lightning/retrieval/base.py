"""The one interface every retrieval method implements: queries in, top-k history docs with provenance out."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.records import HistoryDoc, LampDataset, User


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
    """Users' histories as corpus rows, with the records needed to render prompts: the one place that maps a
    row to its doc, its owner and its text, for training (feedback) and inference alike."""

    def __init__(self, dataset: LampDataset, corpus: Corpus | None = None) -> None:
        self.dataset = dataset
        self.corpus = corpus or Corpus.from_dataset(dataset)

    def __contains__(self, user_id: str) -> bool:
        return user_id in self.corpus

    def rows(self, user_id: str, max_history: int | None = None) -> np.ndarray:
        return self.corpus.rows_of(user_id, max_history)

    def owner(self, row: int) -> str:
        return self.corpus.owner(row)

    def history_doc(self, row: int) -> HistoryDoc:
        return self.corpus.docs[row]

    def text(self, row: int) -> str:
        return self.corpus.texts[row]

    def add_user(self, user: User) -> np.ndarray:
        """Append a new user's history (oldest first) as new corpus rows; returns the rows."""
        rows = self.corpus.add_user(user)
        self.dataset.users[user.user_id] = user
        return rows

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
