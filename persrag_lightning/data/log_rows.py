"""The values of a log's columns checked row by row. A bad value (an empty cell, an unreadable date,
a label outside the task's set) marks its row skipped under a reason, counted with the first row
numbers; under `--strict` the first bad row refuses the whole log instead, in one line naming the
file, the row and the column."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from persrag_lightning.data.log_files import LogFormatError
from persrag_lightning.data.tasks import TaskSpec

__all__ = ["RowChecks", "describe", "identifiers", "labels", "texts", "timestamps", "user_names"]

FIRST_ROWS = 5  # row numbers a skip reason lists
MOST = 0.5  # a log that would lose more than this share of its rows is refused, not converted


@dataclass
class Reason:
    """One reason rows were skipped: how many, the first row numbers (from 1), and the first row's
    full message."""

    rows: int = 0
    first: list[int] = field(default_factory=list)
    message: str = ""


class RowChecks:
    """Which rows of a log are usable, and why the others are not (each row counts under its first
    bad column)."""

    def __init__(self, path: Path, rows: int) -> None:
        self.path = path
        self.ok = np.ones(rows, dtype=bool)
        self.reasons: dict[str, Reason] = {}

    def bad(self, row: int, reason: str, option: str, column: str, detail: str) -> None:
        if not self.ok[row]:
            return
        self.ok[row] = False
        r = self.reasons.setdefault(reason, Reason())
        r.rows += 1
        if len(r.first) < FIRST_ROWS:
            r.first.append(row + 1)
        if not r.message:
            r.message = f"{self.path.name}: row {row + 1}: column {column!r} (--{option}): {detail}"

    @property
    def skipped(self) -> int:
        return int((~self.ok).sum())

    def report(self) -> dict[str, dict[str, Any]]:
        """reason → {"rows", "first_rows"}, most frequent first (convert.json's `skipped`)."""
        ranked = sorted(self.reasons.items(), key=lambda kv: (-kv[1].rows, kv[1].first[0]))
        return {k: {"rows": r.rows, "first_rows": list(r.first)} for k, r in ranked}

    def refuse(self, strict: bool) -> None:
        """--strict: the first bad row's message; any mode: a log that would lose most of its rows,
        in one line."""
        if not self.reasons:
            return
        if strict:
            raise LogFormatError(min(self.reasons.values(), key=lambda r: r.first[0]).message)
        total = len(self.ok)
        if self.skipped > MOST * total:
            raise LogFormatError(
                f"{self.path.name}: {self.skipped} of {total} rows would be skipped "
                f"({describe(self.report())}); nothing was written: check the column options "
                f"against the file, e.g. the first bad row: {self.first_message()}"
            )

    def first_message(self) -> str:
        return min(self.reasons.values(), key=lambda r: r.first[0]).message.split(": ", 1)[1]


def describe(report: dict[str, dict[str, Any]]) -> str:
    """`missing text 7 (rows 6, 11, …)`, reasons joined by `; `."""
    parts = []
    for reason, r in report.items():
        rows = ", ".join(map(str, r["first_rows"])) + (
            ", …" if r["rows"] > len(r["first_rows"]) else ""
        )
        parts.append(f"{reason} {r['rows']} (row{'s' if r['rows'] > 1 else ''} {rows})")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------- values

_NUMBER = re.compile(r"[+-]?[0-9]+(?:\.[0-9]*)?")


def parse_timestamp(value: Any) -> int:
    """Seconds since the epoch (UTC) of an ISO 8601 date or date-time (naive = UTC) or of Unix
    seconds (a number or its text); ValueError for text it cannot read, TypeError for other
    values."""
    if isinstance(value, bool):
        raise TypeError(f"expected an ISO date or Unix seconds, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"expected an ISO date or Unix seconds, got {value!r}")
        return math.floor(value)
    if not isinstance(value, str):
        raise TypeError(f"expected an ISO date or Unix seconds, got {type(value).__name__}")
    text = value.strip()
    if _NUMBER.fullmatch(text):
        return math.floor(float(text))
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise ValueError(
            f"cannot read {value!r} as an ISO date (2016-03-27, 2016-03-27T10:05:00Z) or Unix "
            "seconds"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return math.floor(moment.timestamp())


def timestamps(checks: RowChecks, values: list[Any], column: str) -> np.ndarray:
    """Seconds of every row (0 where skipped): pyarrow's ISO parser over the whole column when it
    reads every value alike (naive date-times, or all with an offset), else parse_timestamp row by
    row."""
    fast = _arrow_timestamps(values)
    if fast is not None:
        return fast
    seen: dict[Any, int] = {}
    out = np.zeros(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        if v is None or (isinstance(v, str) and not v.strip()):
            checks.bad(
                i, "missing date", "date", column, "missing value" if v is None else "empty date"
            )
            continue
        ts = seen.get(v) if isinstance(v, str) else None
        if ts is None:
            try:
                ts = parse_timestamp(v)
            except (ValueError, TypeError, OverflowError) as e:
                checks.bad(i, "unreadable date", "date", column, str(e))
                continue
            if isinstance(v, str):
                seen[v] = ts
        out[i] = ts
    return out


def _arrow_timestamps(values: list[Any]) -> np.ndarray | None:
    import pyarrow as pa

    try:
        column = pa.array(values, type=pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    if column.null_count:
        return None
    # naive values are UTC, as parse_timestamp reads
    for kind in (pa.timestamp("s"), pa.timestamp("s", tz="UTC")):
        try:
            return column.cast(kind).cast(pa.int64()).to_numpy()
        except pa.ArrowInvalid:
            continue
    return None


def identifiers(checks: RowChecks, values: list[Any], option: str, column: str) -> list[str]:
    """Each row's id as text (integers as their digits; "" where skipped)."""
    out = []
    for i, v in enumerate(values):
        if type(v) is not str:
            if isinstance(v, int) and not isinstance(v, bool):
                v = str(v)
            else:
                if v is None:
                    checks.bad(i, f"missing {option}", option, column, "missing value")
                else:
                    checks.bad(i, f"{option} not an id", option, column,
                               f"expected a string or integer id, got {type(v).__name__}")
                out.append("")
                continue
        if not v.strip():
            checks.bad(i, f"missing {option}", option, column, "empty id")
            v = ""
        out.append(v)
    return out


def user_names(checks: RowChecks, values: list[Any], column: str, sep: str) -> list[list[str]]:
    """Each row's users when one cell may name several (`--user_sep`): the names split on `sep`,
    trimmed, each once, in the cell's order; a cell with no name skips its row."""
    ids = identifiers(checks, values, "user", column)
    out = []
    for i, v in enumerate(ids):
        names = list(dict.fromkeys(n.strip() for n in v.split(sep) if n.strip())) if v else []
        if v and not names:
            checks.bad(i, "missing user", "user", column, f"no name between the separators {sep!r}")
        out.append(names)
    return out


def texts(checks: RowChecks, columns: Sequence[tuple[str, list[Any]]]) -> list[str]:
    """Each row's text: one column's value as it is, or several columns' non-empty values joined as
    sentences in the order named (`_join_parts`); a row whose every named cell is empty is
    skipped."""
    if len(columns) == 1:
        column, values = columns[0]
        for i, v in enumerate(values):
            if type(v) is not str or not v.strip():
                _bad_text(checks, i, column, v)
        return values
    names = " + ".join(c for c, _ in columns)
    out = []
    for i, row in enumerate(zip(*(values for _, values in columns))):
        wrong = next((v for v in row if v is not None and type(v) is not str), None)
        parts = [v.strip() for v in row if type(v) is str and v.strip()]
        if wrong is not None or not parts:
            _bad_text(checks, i, names, wrong if wrong is not None else next((v for v in row if v is not None), None))
        out.append(_join_parts(parts))
    return out


def _join_parts(parts: Sequence[str]) -> str:
    """Texts of several columns as one: a headline and its description read as two sentences ("A
    headline. Its description."), so a part that ends without punctuation gets a period."""
    return " ".join(
        p if i == len(parts) - 1 or p[-1] in ".!?;:…" else p + "." for i, p in enumerate(parts)
    )


def _bad_text(checks: RowChecks, row: int, column: str, value: Any) -> None:
    if value is None:
        checks.bad(row, "missing text", "text", column, "missing value")
    elif isinstance(value, str):
        checks.bad(row, "missing text", "text", column, "empty text")
    else:
        checks.bad(
            row, "text not text", "text", column, f"expected text, got {type(value).__name__}"
        )


def labels(
    checks: RowChecks, values: list[Any], column: str, spec: TaskSpec, open_set: bool
) -> list[str]:
    """Each row's label in the task's own spelling: LaMP-3's scores 1–5 ("4", 4, 4.0 → "4"),
    LaMP-2's tags, a label task's values as they are (`open_set`: any non-empty text or integer,
    trimmed); the generation tasks' labels are texts."""
    if open_set:
        out = identifiers(checks, values, "label", column)
        return [v.strip() for v in out]
    if spec.labels is None:
        return texts(checks, [(column, values)])
    allowed = set(spec.labels)
    out = []
    memo: dict[Any, str] = {}
    for i, v in enumerate(values):
        label = memo.get(v) if isinstance(v, (str, int, float)) else None
        if label is None:
            label = _label(v, spec)
            if label not in allowed:
                if v is None or (isinstance(v, str) and not v.strip()):
                    checks.bad(i, "missing label", "label", column, f"missing value (expected one of "
                                                                    f"{', '.join(spec.labels)})")
                else:
                    checks.bad(i, "label outside the task's set", "label", column,
                               f"{v!r} is not a {spec.name} label (expected one of {', '.join(spec.labels)})")
                out.append("")
                continue
            if isinstance(v, (str, int, float)):
                memo[v] = label
        out.append(label)
    return out


def _label(value: Any, spec: TaskSpec) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    text = value.strip() if isinstance(value, str) else value
    if spec.name == "LaMP-3":
        try:
            number = float(text)
        except (TypeError, ValueError):
            return None
        return str(int(number)) if number.is_integer() else None
    return text if isinstance(text, str) else None
