"""What the reader stage stores and trains on: one question as the reader reads it, with its gold
label and its origin (`ReaderExample`, kept as JSON in the stage's cache), and a batch of them as
tensors (`ReaderTrainBatch`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from persrag_lightning.models.reader_inputs import ReaderBatch, ReaderDoc, ReaderQuestion

__all__ = ["ReaderExample", "ReaderTrainBatch"]


@dataclass(frozen=True)
class ReaderExample:
    """One question as the reader trains on it: its id, what it reads (`ReaderQuestion`: text,
    docs with labels and provenance, the asker's habit), the gold label's index, and where it comes
    from (`question` of a split, or `profile` item)."""

    example_id: str
    read: ReaderQuestion
    target: int
    origin: str = "question"

    def to_json(self) -> dict:
        return {"id": self.example_id, "text": self.read.text, "habit": list(self.read.habit),
                "docs": [[d.text, d.label, d.own, d.user_sim, list(d.habit)] for d in self.read.docs],
                "target": self.target, "origin": self.origin}

    @classmethod
    def from_json(cls, row: dict) -> ReaderExample:
        docs = tuple(ReaderDoc(t, int(lab), bool(own), float(sim), tuple(habit))
                     for t, lab, own, sim, habit in row["docs"])
        return cls(row["id"], ReaderQuestion(row["text"], docs, tuple(row["habit"])), row["target"], row["origin"])


@dataclass
class ReaderTrainBatch:
    batch: ReaderBatch
    targets: torch.Tensor  # [B] label index

    def __len__(self) -> int:
        return len(self.targets)
