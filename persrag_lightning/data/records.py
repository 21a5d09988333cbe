"""Typed records of the LaMP world: dated history docs, users, and (user, query, target)
examples."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Example", "HistoryDoc", "LampDataset", "User"]


@dataclass(frozen=True)
class HistoryDoc:
    """One profile item of a user; `fields` holds the task's profile fields (e.g. description,
    tag)."""

    doc_id: str
    date: tuple[int, ...]
    fields: dict[str, str]


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
