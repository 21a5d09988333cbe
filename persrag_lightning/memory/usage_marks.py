"""Recalls' usage marks, kept in the process and written to the memories table together.

A recall adds 1 to the usage count of each row it returns and sets the row's `last_used_at`
(eviction keeps the rows used more: seed §3.4). Written at once, that is an `update` commit per
chat, about a quarter of a chat's work in the bank (benchmarks/probe_bank_upkeep.py,
docs/serving/chat-service.md). `UsageMarks` keeps the marks of up to `every` recalls and writes them
in ONE commit: it reads the rows' stored counts, then merges on `id`, updating only the rows still
there, so a row deleted meanwhile is never written back (marks another process wrote to the same
rows between that read and the merge are overwritten).

Until the write, the store adds the kept marks to the rows it reads, so this process, eviction
included, sees each recall at once. A search reads without the store's lock, so one that races a
write can miss the marks just written (nothing decides by a search's counts); the listing eviction
reads holds the lock. Another process sees the marks after the write, which the store also makes at
each compaction, at a server's shutdown and as a process that never closed its bank ends. A process
killed before the write loses the marks it kept: usage counts are eviction's statistic, not the
user's data, and every row stays whole. The caller serialises access (MemoryStore's lock).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import operator
import sys
import weakref
from collections.abc import Callable, Iterable

import pyarrow as pa

from persrag_lightning.memory.records import Memory

__all__ = ["UsageMarks"]


class UsageMarks:
    """Marks of up to `every` recalls of `table`'s rows (see the module's docstring); `where(user_id,
    ids)` is the typed filter of one user's rows with those ids (the store's `user_filter`)."""

    def __init__(self, table, where: Callable[..., object], every: int) -> None:
        self.table, self.where, self.every = table, where, every
        self._marks: dict[str, dict[str, tuple[int, float]]] = {}  # user -> id -> (recalls, last at)
        self._recalls = 0
        atexit.register(_write_at_exit, weakref.ref(self))

    def mark(self, user_id: str, ids: Iterable[str], now: float) -> bool:
        """Keep one recall's marks of `user_id`'s rows `ids` at time `now`; True when `every`
        recalls are kept and they are due to be written."""
        marks = self._marks.setdefault(user_id, {})
        for memory_id in ids:
            marks[memory_id] = (marks.get(memory_id, (0, now))[0] + 1, now)
        self._recalls += 1
        return self._recalls >= self.every

    def apply(self, memory: Memory) -> Memory:
        """`memory` as read from the table, with the marks kept for it added."""
        kept = self._marks.get(memory.user_id, {}).get(memory.id)
        if kept is None:
            return memory
        return dataclasses.replace(memory, usage_count=memory.usage_count + kept[0],
                                   last_used_at=max(memory.last_used_at, kept[1]))

    def forget(self, user_id: str, ids: Iterable[str] | None = None) -> None:
        """Drop the marks kept for `user_id`'s rows `ids` (None: all of the user's): they are
        deleted."""
        if ids is None:
            self._marks.pop(user_id, None)
            return
        marks = self._marks.get(user_id, {})
        for memory_id in ids:
            marks.pop(memory_id, None)

    def write(self) -> int:
        """Write every kept mark in one commit (none when nothing is kept); returns rows updated."""
        marks = {user: rows for user, rows in self._marks.items() if rows}
        updated = self._write(marks) if marks else 0
        self._marks, self._recalls = {}, 0  # after the write: a failed one keeps them
        return updated

    def _write(self, marks: dict[str, dict[str, tuple[int, float]]]) -> int:
        columns = ["id", "usage_count", "last_used_at"]
        found = functools.reduce(operator.or_, (self.where(user, ids=rows) for user, rows in marks.items()))
        stored = self.table.search().where(found).select([*columns, "user_id"]).limit(None).to_list()
        if not stored:  # every marked row was deleted meanwhile
            return 0
        kept = [marks[r["user_id"]][r["id"]] for r in stored]
        update = pa.Table.from_pydict(
            {"id": [r["id"] for r in stored],
             "usage_count": [r["usage_count"] + k[0] for r, k in zip(stored, kept, strict=True)],
             "last_used_at": [max(r["last_used_at"], k[1]) for r, k in zip(stored, kept, strict=True)]},
            schema=pa.schema([self.table.schema.field(name) for name in columns]))
        return int(self.table.merge_insert("id").when_matched_update_all().execute(update).num_updated_rows)


def _write_at_exit(ref: weakref.ref[UsageMarks]) -> None:
    """The marks a process kept when it ends without having written them (an evaluation's recalls)."""
    marks = ref()
    if marks is None or not any(marks._marks.values()):
        return
    try:
        marks.write()
    except Exception as err:  # noqa: BLE001 - at exit: say so, do not raise (the bank's folder may be gone)
        print(f"memory bank: the usage marks of {marks._recalls} recalls were not written at exit: {err}",
              file=sys.stderr)
