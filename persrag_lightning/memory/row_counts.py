"""Rows per user of one LanceDB table, kept between the table's commits.

A chat asked LanceDB three times how many rows its user has: eviction's trigger on the memories,
and the trim of the user's turns after each of the two turns it logs. A filtered `count_rows`
scans the `user_id` column of every fragment, and a bank holds hundreds of fragments between two
compactions, so each count cost milliseconds, where reading the table's version costs a tenth of
that or less (benchmarks/profile_chat_bank.py, docs/serving/chat-service.md). `RowCounts` keeps
the counts it has read and moves them with the store's own commits. They are valid at one version
of the table only: the bank is opened with strong read consistency, so a commit by another
process, or one this process made without telling `RowCounts`, shows as a version it did not
expect, and every count is read again from the table.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["RowCounts"]


class RowCounts:
    """Rows per user of `table` at the version they were counted at (see the module's docstring);
    `where(user_id)` is the SQL filter of one user's rows. The caller serialises access
    (MemoryStore's lock)."""

    def __init__(self, table, where: Callable[[str], str]) -> None:
        self.table, self.where = table, where
        self._version: int | None = None
        self._counts: dict[str, int] = {}

    def get(self, user_id: str) -> int:
        """The rows of `user_id`: the kept count while the table is at the version it was kept at,
        else a `count_rows` of the table (kept from then on)."""
        version = self.table.version
        if version != self._version:
            self._counts.clear()
            self._version = version
        if user_id not in self._counts:
            self._counts[user_id] = int(self.table.count_rows(self.where(user_id)))
        return self._counts[user_id]

    def committed(self, user_id: str, delta: int) -> None:
        """After one commit of this process that changed only `user_id`'s rows, by `delta`: the
        counts move with it when it was the only commit since they were kept; otherwise they are
        dropped (read again on their next `get`)."""
        version = self.table.version
        if self._version is not None and version == self._version + 1:
            if user_id in self._counts:
                self._counts[user_id] += delta
        else:
            self._counts.clear()
        self._version = version
