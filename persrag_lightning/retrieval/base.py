"""The one interface every retrieval method implements: queries in, top-k history docs with provenance out."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.records import HistoryDoc, LampDataset


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

    def doc(self, row: int, **scores: float) -> RetrievedDoc:
        return RetrievedDoc(row, self.corpus.doc_ids[row], self.owner(row), **scores)


class Strategy(ABC):
    """A retrieval method of the evaluation (zero-shot, BM25, ..., CFRAG and its ablations)."""

    name: str = "strategy"

    def prepare(self, store: DocStore) -> None:
        """Build whatever the method needs over the store (indexes, embeddings); called once before retrieve."""
        self.store = store

    @abstractmethod
    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        """Top-k docs per query, best first."""
