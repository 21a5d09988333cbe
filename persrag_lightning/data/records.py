"""Typed records of the LaMP world: dated history docs, users, and (user, query, target)
examples."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Example", "HistoryDoc", "LampDataset", "ReadDoc", "ReadDocs", "User"]


@dataclass(frozen=True)
class HistoryDoc:
    """One profile item of a user; `fields` holds the task's profile fields (e.g. description,
    tag)."""

    doc_id: str
    date: tuple[int, ...]
    fields: dict[str, str]



@dataclass(frozen=True)
class ReadDoc(HistoryDoc):
    """A history doc as a reader reads it: the doc and its provenance, which no hand-over drops
    (evaluation, feedback, serving and the reader's training data build it in one place,
    `DocStore.read_docs`).

    Args:
        owner: the user whose history holds the doc.
        own: whether the owner is the asking user (False: a neighbour's doc, the collaborative path).
        user_sim: the owner's similarity to the asking user (1.0 for the asker's own docs).
        rank: the doc's place in the retrieval, from 0.
        owner_labels: how often the owner gave each label of the task, counted over the owner's
            history visible to this question (the history rules), so a neighbour's label can be
            read against its author's habit; empty for a task without labels.
    """

    owner: str = ""
    own: bool = True
    user_sim: float = 1.0
    rank: int = 0
    owner_labels: tuple[int, ...] = ()


class ReadDocs(tuple):
    """A question's docs in rank order, with the asking user's label habit: how often the user
    gave each label over their whole visible history (the reader's prior), not only the k docs."""

    asker_labels: tuple[int, ...]

    def __new__(cls, docs=(), asker_labels: tuple[int, ...] = ()):
        obj = super().__new__(cls, docs)
        obj.asker_labels = tuple(asker_labels)
        return obj

    def __getnewargs__(self):  # pickled (DataLoader workers, subprocesses) with the habit
        return tuple(self), self.asker_labels


@dataclass
class User:
    """A user and their chronologically ordered history (oldest first)."""

    user_id: str
    docs: list[HistoryDoc]

    def recent(self, n: int) -> list[HistoryDoc]:
        """The n most recent docs, still oldest first (the official code keeps the last 100)."""
        return self.docs[-n:] if n > 0 else []


@dataclass(frozen=True)
class Example:
    """One question of a split: user u, raw input, extracted query q, target y (None on unlabeled
    test) and the doc ids of its own question's profile (what this question may retrieve from its
    user; see data/histories.py)."""

    example_id: str
    user_id: str
    input: str
    query: str
    target: str | None
    split: str
    profile: tuple[str, ...] = ()


@dataclass
class LampDataset:
    """A LaMP task's users (aggregated over splits) and its examples per split."""

    task: str
    users: dict[str, User]
    examples: dict[str, list[Example]] = field(default_factory=dict)
    # users with `share: false`: never a neighbour, their docs never in another user's prompt
    # (histories.py)
    private: set[str] = field(default_factory=set)

    def user_ids(self) -> list[str]:
        """Users in a stable order (sorted ids) so row i of every table means the same user."""
        return sorted(self.users)
