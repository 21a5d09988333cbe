"""The corpus of all history docs as rows of one table: row r is (owner user, doc id, rendered text,
record)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from persrag_lightning.data.records import HistoryDoc, LampDataset, User
from persrag_lightning.data.tasks import get_task

__all__ = ["Corpus"]


@dataclass
class Corpus:
    """Users in sorted-id order, each user's docs oldest first; `offsets[i]:offsets[i+1]` are user
    i's rows.

    `docs[r]` is row r's record (what prompts render) and `texts[r]` its rendered text (what
    encoders embed); `user_position(u)` is u's position i in `user_ids` (the row range's index, not
    a table row of any model).
    """

    user_ids: list[str]
    offsets: np.ndarray
    doc_ids: list[str]
    texts: list[str]
    docs: list[HistoryDoc] = field(default_factory=list)
    task: str = ""

    def __post_init__(self) -> None:
        self._positions = {uid: i for i, uid in enumerate(self.user_ids)}

    @classmethod
    def from_dataset(cls, dataset: LampDataset) -> Corpus:
        spec = get_task(dataset.task)
        user_ids = dataset.user_ids()
        offsets = np.zeros(len(user_ids) + 1, dtype=np.int64)
        docs: list[HistoryDoc] = []
        for i, uid in enumerate(user_ids):
            docs += dataset.users[uid].docs
            offsets[i + 1] = len(docs)
        return cls(user_ids, offsets, [d.doc_id for d in docs], [spec.render_doc(d) for d in docs], docs,
                   spec.name)

    def __len__(self) -> int:
        return len(self.texts)

    def __contains__(self, user_id: str) -> bool:
        return user_id in self._positions

    @property
    def num_users(self) -> int:
        """Users present (removed users excluded, unlike `user_ids`, which keeps their
        placeholders)."""
        return len(self._positions)

    def user_position(self, user_id: str) -> int:
        """Position of `user_id` in `user_ids`; KeyError names the user."""
        try:
            return self._positions[user_id]
        except KeyError:
            raise KeyError(f"unknown user {user_id!r}") from None

    def user_rows(self, i: int, max_history: int | None = None) -> np.ndarray:
        """Row ids of user i's docs, oldest first, keeping only the `max_history` most recent."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if max_history is not None:
            start = max(start, end - max_history)
        return np.arange(start, end, dtype=np.int64)

    def rows_of(self, user_id: str, max_history: int | None = None) -> np.ndarray:
        return self.user_rows(self.user_position(user_id), max_history)

    def owner(self, row: int) -> str:
        return self.user_ids[int(np.searchsorted(self.offsets, row, side="right")) - 1]

    def add_user(self, user: User) -> np.ndarray:
        """Append a new user's history (oldest first) as new rows; returns the rows."""
        if user.user_id in self._positions:
            raise ValueError(f"user {user.user_id!r} already exists")
        spec = get_task(self.task)
        start = len(self)
        self.user_ids.append(user.user_id)
        self._positions[user.user_id] = len(self.user_ids) - 1
        self.docs.extend(user.docs)
        self.doc_ids.extend(d.doc_id for d in user.docs)
        self.texts.extend(spec.render_doc(d) for d in user.docs)
        self.offsets = np.append(self.offsets, len(self))
        return np.arange(start, len(self))

    def remove_user(self, user_id: str) -> np.ndarray:
        """Drop a user from the id map (serving's deletion); their rows stay as blank placeholders
        so that every other row number, and the vectors indexed by it, stay valid. Returns the
        user's rows."""
        i = self.user_position(user_id)
        rows = self.user_rows(i)
        del self._positions[user_id]
        self.user_ids[i] = f"\x00deleted-{i}"  # keeps offsets aligned; no real id contains NUL
        return rows

    def digest(self) -> str:
        """Content hash of the corpus (owners, ids and texts in order): the data part of cache
        fingerprints."""
        h = hashlib.sha256()
        for i, uid in enumerate(self.user_ids):
            h.update(f"\x00u{uid}\x00".encode())
            for r in range(int(self.offsets[i]), int(self.offsets[i + 1])):
                h.update(self.doc_ids[r].encode() + b"\x01" + self.texts[r].encode() + b"\x02")
        return h.hexdigest()
