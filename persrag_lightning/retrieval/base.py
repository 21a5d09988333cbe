"""The one interface every retrieval method implements: queries in, top-k history docs with
provenance out."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import numpy as np

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.histories import MAX_HISTORY, corpus_doc_ids, visible_histories
from persrag_lightning.data.records import HistoryDoc, LampDataset, ReadDoc, ReadDocs, User
from persrag_lightning.data.tasks import get_task
from persrag_lightning.utils import bundle_digest

__all__ = ["DocStore", "Query", "RetrievedDoc", "Strategy", "cache_value"]


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
    # "doc": a corpus row; "memory": a memory of the bank (row -1, doc_id = memory id)
    source: str = "doc"


_NO_ROWS = np.zeros(0, dtype=np.int64)


class DocStore:
    """Users' histories as corpus rows, with the records needed to render prompts: the one place
    that maps a row to its doc, its owner and its text, for training (feedback) and inference
    alike."""

    def __init__(self, dataset: LampDataset, corpus: Corpus | None = None) -> None:
        self.dataset = dataset
        self.corpus = corpus or Corpus.from_dataset(dataset)
        self.visible = visible_histories(dataset, self.corpus)
        self._row_labels: np.ndarray | None = None  # row_labels' memo

    def __contains__(self, user_id: str) -> bool:
        return user_id in self.corpus

    def rows(
        self, user_id: str, max_history: int | None = None, query: Query | None = None
    ) -> np.ndarray:
        """Rows of `user_id`'s docs that `query` may see (data/histories.py): its own question's
        profile when the user is the query's, the user's collaborative pool otherwise; never a doc
        whose id is the query's example id. Without a query: the pool (what the user encoder and
        MEAN user vectors read)."""
        if query is not None and user_id == query.user_id and query.example_id in self.visible.own:
            rows = self.visible.own[query.example_id]
        else:
            rows = self.visible.pool.get(user_id, _NO_ROWS)
        if query is not None and query.example_id:
            rows = rows[corpus_doc_ids(self.corpus, rows) != query.example_id]
        return rows if max_history is None else rows[max(0, len(rows) - max_history):]

    def shares(self, user_id: str) -> bool:
        """False for a user with `share: false`: never a neighbour, docs never in another user's
        prompt."""
        return user_id not in self.dataset.private

    def shared_neighbours(
        self, user_id: str, ranked: list[tuple[str, float]], m: int
    ) -> list[tuple[str, float]]:
        """The first m of a similarity ranking without private users (the query user itself always
        stays) and without users removed from the store: the one filter every neighbour list goes
        through."""
        return [(u, s) for u, s in ranked if u == user_id or (self.shares(u) and u in self)][:m]

    def set_share(self, user_id: str, share: bool) -> None:
        """Switch a user's sharing at serving time: private users lose their collaborative pool at
        once."""
        if share:
            self.dataset.private.discard(user_id)
            rows = self.corpus.rows_of(user_id)
            self.visible.pool[user_id] = rows[max(0, len(rows) - MAX_HISTORY):]
        else:
            self.dataset.private.add(user_id)
            self.visible.pool.pop(user_id, None)

    def remove_user(self, user_id: str) -> None:
        """Forget a user at serving time: out of the corpus' user map, no pool, texts and records
        blanked (row numbers of other users stay valid for the retriever's vectors)."""
        rows = self.corpus.remove_user(user_id)
        self.dataset.users.pop(user_id, None)
        self.dataset.private.discard(user_id)
        self.visible.pool.pop(user_id, None)
        self.visible.pool_source.pop(user_id, None)
        for r in rows:
            self.corpus.texts[r] = ""
            self.corpus.docs[r] = HistoryDoc(self.corpus.doc_ids[r], self.corpus.docs[r].date, {})
        self._row_labels = None

    def pool_users(self) -> list[str]:
        """Users whose docs others may retrieve (every user with a collaborative pool), in corpus
        order."""
        return [u for u in self.corpus.user_ids if len(self.visible.pool.get(u, _NO_ROWS))]

    def owner(self, row: int) -> str:
        return self.corpus.owner(row)

    def history_doc(self, row: int) -> HistoryDoc:
        """The corpus doc of `row`; a negative row (a memory, `source="memory"`, has none) is an
        error, never Python's wrap-around to the last doc."""
        if row < 0:
            raise ValueError(
                f"row {row} is not a corpus row (memories have no history doc; render them with "
                "their text, as retrieval/memory.py does)"
            )
        return self.corpus.docs[row]

    def text(self, row: int) -> str:
        return self.corpus.texts[row]

    # ---- what a reader reads: docs with their provenance, the asker's label habit -----------------

    def row_labels(self) -> np.ndarray:
        """Each corpus row's label index + 1 (0: none), kept in step with rows added at serving
        time (a removed user's rows are blank: label 0)."""
        labels = self._row_labels
        if labels is None or len(labels) != len(self.corpus.docs):
            spec = get_task(self.dataset.task)
            labels = np.array([spec.doc_label(d) for d in self.corpus.docs], dtype=np.int64)
            self._row_labels = labels
        return labels

    def label_counts(self, user_id: str, query: Query) -> tuple[int, ...]:
        """How often `user_id` gave each label over the rows `query` may see of them (`rows`):
        the asker's prior, a neighbour's habit; empty for a task without labels."""
        labels = get_task(self.dataset.task).labels
        if not labels:
            return ()
        seen = self.row_labels()[self.rows(user_id, query=query)]
        return tuple(int(c) for c in np.bincount(seen, minlength=len(labels) + 1)[1:])

    def read_docs(self, query: Query, retrieved: list[RetrievedDoc]) -> ReadDocs:
        """The docs a reader reads for `query`, in rank order, each with its provenance (owner,
        own or a neighbour's, user similarity, rank, the owner's label habit), and the asker's
        label habit: the one hand-over from retrieval to reading (evaluation, feedback, serving
        and the reader's training data)."""
        habits: dict[str, tuple[int, ...]] = {}

        def habit(user_id: str) -> tuple[int, ...]:
            if user_id not in habits:
                habits[user_id] = self.label_counts(user_id, query)
            return habits[user_id]

        docs = []
        for rank, d in enumerate(retrieved):
            doc = self.history_doc(d.row)
            own = d.owner == query.user_id
            docs.append(ReadDoc(doc.doc_id, doc.date, doc.fields, d.owner, own,
                                1.0 if own else float(d.user_sim), rank, habit(d.owner)))
        return ReadDocs(docs, habit(query.user_id))

    def add_user(self, user: User) -> np.ndarray:
        """Append a new user's history (oldest first) as new corpus rows; returns the rows."""
        rows = self.corpus.add_user(user)
        self.dataset.users[user.user_id] = user
        if self.shares(user.user_id):
            self.visible.pool[user.user_id] = rows[max(0, len(rows) - MAX_HISTORY):]
        self.visible.pool_source[user.user_id] = ""
        return rows

    def doc(self, row: int, **scores: float) -> RetrievedDoc:
        return RetrievedDoc(
            row, self.corpus.doc_ids[row], self.owner(row), **scores, text=self.corpus.texts[row]
        )


class Strategy(ABC):
    """A retrieval method of the evaluation (zero-shot, BM25, ..., CFRAG and its ablations)."""

    name: str = "strategy"
    # The prompt budget its prompts are built with: None = CFRAG's builder
    # (llm/prompts.build_prompt's even split); γ = ClusterRAG's Eq. 3 (seed 002), the query's
    # largest share of the prompt's tokens.
    prompt_gamma: float | None = None

    def prepare(self, store: DocStore) -> None:
        """Build whatever the method needs over the store (indexes, embeddings); called once before
        retrieve."""
        self.store = store

    @abstractmethod
    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        """Top-k docs per query, best first."""

    # Optional hooks, with what a strategy that retrieves for itself needs: a wrapper (a "+ tuned
    # generator" row) overrides the first four, a strategy whose constructor settings do not say
    # what it retrieves the last.

    def bind(self, by_name: dict[str, Strategy]) -> None:
        """Given every strategy of the config by name, before any retrieves: a wrapper takes the one
        it names."""

    @property
    def wrapped_name(self) -> str | None:
        """The name of the config's strategy whose docs this one answers, or None: it retrieves for
        itself."""
        return None

    @property
    def wrapped(self) -> Strategy | None:
        """That strategy, once bound (`bind`); None for a strategy that retrieves for itself."""
        return None

    @property
    def answering_model(self) -> str | None:
        """The exported generator folder that answers this strategy's prompts, or None: the
        evaluation's LLM."""
        return None

    def cache_config(self) -> dict | None:
        """What identifies this strategy's retrievals in the caches, where its constructor's
        settings do not (None: they do; retrieval/strategies.py's `strategy_config` reads them;
        `cache_value` turns a setting into what a key holds)."""
        return None

    def use_reranker_runtime(self, runtime: str) -> None:
        """Run this strategy's cross-encoder in `runtime` unless its settings name one
        (strategies.py's `set_reranker_runtime`, before any retrieval: the runtime is part of the
        cache key); no-op without one."""

    def warm(self) -> None:
        """Make now, once prepared, what a served query would otherwise wait for (a runtime's
        compiled shapes); serving calls it at load. No-op by default."""


def cache_value(value: object) -> object:
    """A setting as a cache key holds it: an exported bundle (a folder with config.json) or a cohort
    export by the digest of its files, a settings object by its fields, a plain value as it is; None
    for anything else (models and indexes a strategy loaded: what they hold is named by the settings
    that loaded them)."""
    if isinstance(value, str) and any(
        (Path(value) / name).is_file() for name in ("config.json", "cohorts.json")
    ):
        return {"bundle": bundle_digest(value)}
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return None
