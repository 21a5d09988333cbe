"""A checked log as a table of items, each user's oldest first, with the profile cut of every item.

One entry per (row, user): a row that names co-authors (`user_sep`) gives each of them the item.
Items of one user and one time are ordered by their content (item id, then text, then label), so the
order, the split and the doc ids do not depend on the file's row order; an item's profile cut is how
many of its user's items are dated strictly before it, so items of the same time never see each
other. A user's items with the same text are counted, and with `dedupe` only the oldest is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from persrag_lightning.data.log_files import LogFormatError, read_log
from persrag_lightning.data.log_rows import RowChecks, identifiers, labels, texts, timestamps, user_names
from persrag_lightning.data.tasks import TaskSpec

__all__ = ["LogTable", "check_log"]



class LogOptions(Protocol):
    """What reading a log needs of the converter's options (`data.convert.ConvertOptions`, which
    imports this module)."""

    item: str | None
    user_sep: str | None
    strict: bool
    dedupe: bool
    min_items: int

    @property
    def columns(self) -> dict[str, str]: ...

    @property
    def text_columns(self) -> list[str]: ...

    @property
    def labels_from_log(self) -> bool: ...


@dataclass
class LogTable:
    """The kept items (entries) of a log: one value per entry, and each kept user's entries (oldest
    first) as a slice of `order`."""

    rows: int              # the file's rows
    checks: RowChecks      # which rows were skipped, and why
    users: list[str]
    texts: list[str]
    labels: list[str]
    doc_ids: list[str]
    dates: list[str]
    order: np.ndarray      # entries, users in sorted id order, each user's entries oldest first
    starts: np.ndarray     # where each kept user's entries begin in `order`
    counts: np.ndarray     # how many entries each kept user has
    cuts: np.ndarray       # per position of `order`: the user's entries dated strictly before it
    dropped_users: int
    dropped_items: int     # entries of the dropped users
    repeated: int          # entries whose (user, text) an older entry has
    deduplicated: int      # of those, dropped (`dedupe`)

    @cached_property
    def _slices(self) -> list[tuple[int, int]]:
        return list(zip(self.starts.tolist(), self.counts.tolist()))

    @cached_property
    def _user_rows(self) -> list[list[int]]:
        order = self.order.tolist()
        return [order[s:s + c] for s, c in self._slices]

    def user_rows(self) -> list[list[int]]:
        """Each kept user's entries, oldest first."""
        return self._user_rows

    def user_cuts(self) -> list[list[int]]:
        """Each kept user's profile cuts, in the order of `user_rows`."""
        cuts = self.cuts.tolist()
        return [cuts[s:s + c] for s, c in self._slices]


def check_log(path: Path, options: LogOptions, spec: TaskSpec) -> LogTable:
    """Every value of the named columns checked (data/log_rows.py: bad rows skipped and counted, or
    under `strict` the first one refused), rows made entries, users with too few items dropped, each
    user's items ordered."""
    cols, text_columns = options.columns(), options.text_columns()
    item = [options.item] if options.item else []
    raw = read_log(path, [cols["user"], cols["date"], *text_columns, cols["label"], *item])
    n = len(raw[cols["user"]])
    if n == 0:
        raise LogFormatError(f"{path.name}: no rows")
    checks = RowChecks(path, n)
    names = user_names(checks, raw[cols["user"]], cols["user"], options.user_sep) if options.user_sep else None
    single = identifiers(checks, raw[cols["user"]], "user", cols["user"]) if names is None else None
    ts = timestamps(checks, raw[cols["date"]], cols["date"])
    text = texts(checks, [(c, raw[c]) for c in text_columns])
    label = labels(checks, raw[cols["label"]], cols["label"], spec, options.labels_from_log)
    items = identifiers(checks, raw[options.item], "item", options.item) if options.item else None
    if items is not None:
        _repeated_items(checks, single, names, items, options.item or "")
    checks.refuse(options.strict)
    if names is None and checks.ok.all():  # every row is one entry: no copies
        return Entries(single, ts, text, label, items).table(n, checks, options)  # type: ignore[arg-type]
    src, users = _entries(checks.ok, single, names)
    entries = Entries(users, ts[src], [text[i] for i in src], [label[i] for i in src],
                      [items[i] for i in src] if items is not None else None)
    return entries.table(n, checks, options)


def _repeated_items(checks: RowChecks, single: list[str] | None, names: list[list[str]] | None,
                    items: list[str], column: str) -> None:
    """A user holds an item once: a later row giving one of its users an item again is skipped."""
    first: dict[tuple[str, str], int] = {}
    for i in np.flatnonzero(checks.ok).tolist():
        if names is None:
            key = (single[i], items[i])  # type: ignore[index]
            j = first.setdefault(key, i)
            if j != i:
                checks.bad(i, "repeated item", "item", column, f"user {key[0]!r} already has item {key[1]!r} "
                                                               f"(row {j + 1})")
            continue
        keys = [(u, items[i]) for u in names[i]]
        again = next((k for k in keys if k in first), None)
        if again is not None:
            checks.bad(i, "repeated item", "item", column,
                       f"user {again[0]!r} already has item {again[1]!r} (row {first[again] + 1})")
        else:
            first.update((k, i) for k in keys)


def _entries(
    ok: np.ndarray, single: list[str] | None, names: list[list[str]] | None
) -> tuple[list[int], list[str]]:
    """The kept rows as entries: (source row, user) each, a row with co-authors once per named
    user."""
    rows = np.flatnonzero(ok).tolist()
    if names is None:
        assert single is not None
        return rows, [single[i] for i in rows]
    return [i for i in rows for _ in names[i]], [u for i in rows for u in names[i]]


# an odd 64-bit constant: spreads user codes over the hash bits
_MIX = np.int64(-7046029254386353131)


@dataclass
class Entries:
    """The kept rows' values per entry, before they are ordered."""

    users: list[str]
    ts: np.ndarray
    texts: list[str]
    labels: list[str]
    items: list[str] | None

    def table(self, rows: int, checks: RowChecks, options: LogOptions) -> LogTable:
        """Ordered per user (oldest first, same times by content), repeated texts counted (`dedupe`:
        dropped), users with fewer than `min_items` dropped."""
        codes_of = {u: k for k, u in enumerate(sorted(set(self.users)))}
        codes = np.fromiter(
            (codes_of[u] for u in self.users), dtype=np.int64, count=len(self.users)
        )
        order = self._by_content(np.lexsort((np.arange(len(codes)), self.ts, codes)), codes)
        first = self._first_texts(order, codes)
        repeated = int((~first).sum())
        if options.dedupe:
            order = order[first]
        counts_all = np.bincount(codes[order], minlength=len(codes_of))
        starts_all = np.concatenate([[0], np.cumsum(counts_all)[:-1]])
        keep = counts_all >= options.min_items
        if not keep.any():
            raise LogFormatError(
                f"{checks.path.name}: no user has {options.min_items} items (--min_items); the "
                f"most any user has is {int(counts_all.max())}"
            )
        cuts = _cuts(order, codes, self.ts, starts_all)
        starts, counts = starts_all[keep], counts_all[keep]
        return LogTable(rows, checks, self.users, self.texts, self.labels, self._doc_ids(order, starts, counts),
                        _date_strings(self.ts), order, starts, counts, cuts, int((~keep).sum()),
                        int(counts_all[~keep].sum()), repeated, repeated if options.dedupe else 0)

    def _content_key(self, e: int) -> tuple[str, str, str]:
        return (self.items[e] if self.items is not None else "", self.texts[e], self.labels[e])

    def _by_content(self, order: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """`order` with each run of one user's same-time entries sorted by content (item, text,
        label)."""
        c, t = codes[order], self.ts[order]
        same = (c[1:] == c[:-1]) & (t[1:] == t[:-1])
        if not same.any():
            return order
        order = order.copy()
        starts = np.flatnonzero(np.concatenate([[True], ~same]))
        ends = np.append(starts[1:], len(order))
        for a, b in zip(starts[ends - starts > 1].tolist(), ends[ends - starts > 1].tolist()):
            order[a:b] = sorted(order[a:b].tolist(), key=self._content_key)
        return order

    def _first_texts(self, order: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """Per position of `order`: whether no older entry of the user has the same text. Entries
        are grouped by a hash of (user, text), and only groups of several are compared text by
        text."""
        n = len(order)
        c = codes[order]
        keys = np.fromiter(map(hash, self.texts), dtype=np.int64, count=len(self.texts))[order] ^ (
            c * _MIX
        )
        by = np.argsort(keys, kind="stable")  # a group's positions stay oldest first
        sorted_keys = keys[by]
        starts = np.flatnonzero(np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]]))
        ends = np.append(starts[1:], n)
        first = np.ones(n, dtype=bool)
        for a, b in zip(starts[ends - starts > 1].tolist(), ends[ends - starts > 1].tolist()):
            seen: set[tuple[int, str]] = set()
            for pos in by[a:b].tolist():
                key = (int(c[pos]), self.texts[order[pos]])
                first[pos] = key not in seen
                seen.add(key)
        return first

    def _doc_ids(self, order: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> list[str]:
        """Doc id of each kept entry: `{user}-{item}` with an item column, else `{user}-{position}`
        (oldest first)."""
        ids = [""] * len(self.users)
        width = len(str(max(int(counts.max(initial=1)) - 1, 0)))
        for start, count in zip(starts.tolist(), counts.tolist()):
            for pos, e in enumerate(order[start:start + count].tolist()):
                suffix = self.items[e] if self.items is not None else f"{pos:0{width}d}"
                ids[e] = f"{self.users[e]}-{suffix}"
        return ids


def _cuts(order: np.ndarray, codes: np.ndarray, ts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per position of `order`: how many of the user's entries come before the first of its time
    (those dated strictly before it)."""
    c, t = codes[order], ts[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (c[1:] != c[:-1]) | (t[1:] != t[:-1])
    run_start = np.maximum.accumulate(np.where(new, np.arange(len(order)), 0))
    return run_start - starts[c]


def _date_strings(ts: np.ndarray) -> list[str]:
    """LaMP dates ('-'-separated integers): YYYY-MM-DD when every item is at midnight UTC, else with
    the time of day (YYYY-MM-DD-HH-MM-SS), so the file keeps the order the split was made in."""
    iso = ts.astype("datetime64[s]").astype(str)
    if not (ts % 86400).any():
        return [s[:10] for s in iso.tolist()]
    return [s.replace("T", "-").replace(":", "-") for s in iso.tolist()]
