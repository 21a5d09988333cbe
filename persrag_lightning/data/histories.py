"""Users' histories: which corpus rows a query may see (the history rules, `visible_histories`), and
the user encoder's input format (doc-table id sequences: 0 pads, 1 is the [mask] token, corpus row r
is id r + 2)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.records import LampDataset

__all__ = ["FIRST_DOC_ID", "MASK_ID", "MAX_HISTORY", "PAD_ID", "corpus_doc_ids", "history_ids",
           "pad_histories", "visible_histories"]

PAD_ID = 0
MASK_ID = 1
FIRST_DOC_ID = 2  # doc-table row of corpus row r is r + FIRST_DOC_ID


def history_ids(rows: np.ndarray) -> np.ndarray:
    """Corpus rows → doc-table ids."""
    return rows + FIRST_DOC_ID


def pad_histories(histories: list[np.ndarray]) -> torch.Tensor:
    """Right-pad doc-table id sequences with PAD_ID into a [B, L] tensor (L ≥ 1)."""
    length = max(1, max((len(h) for h in histories), default=1))
    out = torch.full((len(histories), length), PAD_ID, dtype=torch.long)
    for i, h in enumerate(histories):
        out[i, :len(h)] = torch.as_tensor(h, dtype=torch.long)
    return out


# ---- which docs a query may see (docs/data/history-rules.md) -------------------------------------

MAX_HISTORY = 100  # the official code keeps a user's 100 most recent docs
# the official code builds the collaborative pool from these, never from test
POOL_SPLITS = ("train", "dev")


@dataclass(frozen=True)
class VisibleHistories:
    """Corpus rows a query may retrieve, by the rules of `visible_histories`."""

    # example id → rows of its own question's profile (own item dropped), last 100
    own: dict[str, np.ndarray]
    pool: dict[str, np.ndarray]  # user id → rows of the user's collaborative pool, last 100
    # user id → id of the question whose profile is the pool ("" = all the user's docs)
    pool_source: dict[str, str]


def visible_histories(
    dataset: LampDataset, corpus: Corpus, max_history: int = MAX_HISTORY
) -> VisibleHistories:
    """The history rules, in one place (docs/data/history-rules.md):

    1. an example's own-user docs are exactly its question's profile, at most the `max_history` most
       recent, never the example's own item (a profile item whose id is the example's id) and never
       another question's profile of the same user — a later question's profile can hold an earlier
       question's item with its label;
    2. another user's docs (the collaborative pool, also what the user encoder trains on) are the
       profile of that user's earliest train or dev question (train before dev, then the profile's
       latest date, then its size): never a test profile, never a later profile; a user whose
       questions are all in test has no pool (no one retrieves their docs; they still retrieve from
       others); a user without any question (a docstore or a user added at serving time) pools all
       their docs; a user with `share: false` (`dataset.private`) has no pool.
    A query never receives a doc whose id equals its example id, from anyone (DocStore.rows enforces
    it).
    """
    own: dict[str, np.ndarray] = {}
    earliest: dict[str, tuple] = {}
    asked: set[str] = set()
    for split, examples in dataset.examples.items():
        for ex in examples:
            asked.add(ex.user_id)
            if not ex.profile or ex.user_id not in corpus:
                continue
            rows = _profile_rows(corpus, ex.user_id, ex.profile)
            own[ex.example_id] = _recent(
                rows[corpus_doc_ids(corpus, rows) != ex.example_id], max_history
            )
            if split in POOL_SPLITS:
                dates = [corpus.docs[r].date for r in rows]
                key = (POOL_SPLITS.index(split), max(dates, default=()), len(rows), ex.example_id)
                if ex.user_id not in earliest or key < earliest[ex.user_id][0]:
                    earliest[ex.user_id] = (key, rows, ex.example_id)
    pool: dict[str, np.ndarray] = {}
    source: dict[str, str] = {}
    for uid in corpus.user_ids:
        if uid in dataset.private:
            continue
        if uid in earliest:
            pool[uid], source[uid] = _recent(earliest[uid][1], max_history), earliest[uid][2]
        elif uid not in asked:
            pool[uid], source[uid] = corpus.rows_of(uid, max_history), ""
    return VisibleHistories(own, pool, source)


def corpus_doc_ids(corpus: Corpus, rows: np.ndarray) -> np.ndarray:
    return np.array([corpus.doc_ids[r] for r in rows], dtype=object)


def _profile_rows(corpus: Corpus, user_id: str, profile: tuple[str, ...]) -> np.ndarray:
    """Rows of the profile's doc ids among the user's docs, oldest first (the corpus order)."""
    user_rows = corpus.rows_of(user_id)
    wanted = set(profile)
    return np.array([r for r in user_rows if corpus.doc_ids[r] in wanted], dtype=np.int64)


def _recent(rows: np.ndarray, n: int | None) -> np.ndarray:
    return rows if n is None else rows[max(0, len(rows) - n):]
