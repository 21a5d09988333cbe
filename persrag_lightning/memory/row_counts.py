"""Rows per user of one LanceDB table, kept between the table's commits.

A chat asked LanceDB three times how many rows its user has: eviction's trigger on the memories,
and the trim of the user's turns after each of the two turns it logs. A filtered `count_rows`
scans the `user_id` column of every fragment, and a bank holds hundreds of fragments between two
compactions, so each count cost milliseconds, where reading the table's version costs a tenth of
that or less (benchmarks/profile_chat_bank.py, docs/serving/chat-service.md). `RowCounts` keeps
the counts and moves them with the store's own commits. They are valid at one version of the table
only: the bank is opened with strong read consistency, so a commit by another process, or one this
process made without telling `RowCounts` (a compaction), shows as a version it did not expect, and
the counts are read again.

They are read for every user at once, in one scan of the `user_id` column (the scan a filtered
count makes anyway): after a compaction each user's first chat counted its rows again, one
`count_rows` per user and table, a scan each.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["RowCounts", "user_column"]


def user_column(table, column: str = "user_id") -> pa.ChunkedArray:
    """Every row's user of `table`, read in one scan of that column alone."""
    return table.search().select([column]).limit(None).to_arrow()[column]


class RowCounts:
    """Rows per user of `table` (users by its `column`) at the version they were counted at (see the
    module's docstring). The caller serialises access (MemoryStore's lock of that table)."""

    def __init__(self, table, column: str = "user_id") -> None:
        self.table, self.column = table, column
        self._version: int | None = None
        self._counts: dict[str, int] | None = None  # every user's, None: to be read

    def get(self, user_id: str) -> int:
        """The rows of `user_id`: the kept count while the table is at the version it was kept at,
        else every user's read again in one scan (kept from then on)."""
        version = self.table.version
        if self._counts is None or version != self._version:
            self._counts, self._version = self._count_all(), version
        return self._counts.get(user_id, 0)

    def committed(self, user_id: str, delta: int) -> None:
        """After one commit of this process that changed only `user_id`'s rows, by `delta`: the
        counts move with it when it was the only commit since they were kept; otherwise they are
        dropped (read again on the next `get`)."""
        version = self.table.version
        if self._counts is not None and self._version is not None and version == self._version + 1:
            self._counts[user_id] = self._counts.get(user_id, 0) + delta
        else:
            self._counts = None
        self._version = version

    def _count_all(self) -> dict[str, int]:
        """Every user's rows now, from one scan of the user column (no user's id reaches SQL)."""
        users = user_column(self.table, self.column)
        if not len(users):
            return {}
        return {row["values"]: row["counts"] for row in pc.value_counts(users).to_pylist()}
