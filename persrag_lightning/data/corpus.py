"""The corpus of all history docs as rows of one table: row r is (owner user, doc id, rendered text)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from persrag_lightning.data.records import LampDataset
from persrag_lightning.data.tasks import get_task


@dataclass
class Corpus:
    """Users in sorted-id order, each user's docs oldest first; `offsets[i]:offsets[i+1]` are user i's rows."""

    user_ids: list[str]
    offsets: np.ndarray
    doc_ids: list[str]
    texts: list[str]

    @classmethod
    def from_dataset(cls, dataset: LampDataset) -> Corpus:
        spec = get_task(dataset.task)
        user_ids = dataset.user_ids()
        offsets = np.zeros(len(user_ids) + 1, dtype=np.int64)
        doc_ids: list[str] = []
        texts: list[str] = []
        for i, uid in enumerate(user_ids):
            for doc in dataset.users[uid].docs:
                doc_ids.append(doc.doc_id)
                texts.append(spec.render_doc(doc))
            offsets[i + 1] = len(texts)
        return cls(user_ids, offsets, doc_ids, texts)

    def __len__(self) -> int:
        return len(self.texts)

    def user_index(self) -> dict[str, int]:
        return {uid: i for i, uid in enumerate(self.user_ids)}

    def user_rows(self, i: int, max_history: int | None = None) -> np.ndarray:
        """Row ids of user i's docs, oldest first, keeping only the `max_history` most recent."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if max_history is not None:
            start = max(start, end - max_history)
        return np.arange(start, end, dtype=np.int64)

    def digest(self) -> str:
        """Content hash of the corpus (owners, ids and texts in order): the data part of cache fingerprints."""
        h = hashlib.sha256()
        for i, uid in enumerate(self.user_ids):
            h.update(f"\x00u{uid}\x00".encode())
            for r in range(int(self.offsets[i]), int(self.offsets[i + 1])):
                h.update(self.doc_ids[r].encode() + b"\x01" + self.texts[r].encode() + b"\x02")
        return h.hexdigest()
