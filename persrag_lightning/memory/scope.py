"""One user's rows: the ids the memory bank accepts and `user_filter`, the single place where a user
id becomes a predicate: a validated value wrapped in LanceDB's typed expression (`col == lit`),
which LanceDB renders as an escaped literal (quotes doubled), never text pasted into a filter
string. Every table access of the store (memory/store.py) goes through it.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Sequence

try:
    from lancedb.expr import col, lit
except ImportError as err:  # the main job's install leaves it out
    raise ImportError(
        f'the memory bank needs lancedb ({err}): pip install -e ".[memory]"'
    ) from None

__all__ = ["MAX_ID_CHARS", "InvalidIdError", "user_filter", "validate_id"]

MAX_ID_CHARS = 256


class InvalidIdError(ValueError):
    """A user, session or memory id that cannot be stored (wrong type, empty, too long, control
    characters)."""


def validate_id(value: object, what: str = "user_id") -> str:
    """Ids are opaque strings, but never empty, huge or carrying control characters (NUL breaks some
    parsers)."""
    if not isinstance(value, str):
        raise InvalidIdError(f"{what} must be a string, got {type(value).__name__}")
    if not value or len(value) > MAX_ID_CHARS:
        raise InvalidIdError(f"{what} must have 1 to {MAX_ID_CHARS} characters, got {len(value)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidIdError(f"{what} {value!r} contains control characters")
    try:
        value.encode("utf-8")
    # a lone surrogate ("\ud800" in JSON): no literal LanceDB (or a file) can hold
    except UnicodeEncodeError:
        raise InvalidIdError(
            f"{what} {value!r} is not valid Unicode text (a lone surrogate)"
        ) from None
    return value


def user_filter(user_id: str, *, ids: Iterable[str] | None = None, session_id: str | None = None,
                others_in_fragments: Sequence[int] | None = None):
    """THE predicate helper: `user_id = <literal> [AND id IN (...)] [AND session_id = ...]`, as a
    typed LanceDB expression whose literals LanceDB escapes itself; every table access goes through
    it. `others_in_fragments` (a purge): instead, the rows of those LanceDB fragments that are *not*
    the user's (row id = fragment << 32 | offset, LanceDB's default row ids)."""
    expr = col("user_id") == lit(validate_id(user_id))
    if ids is not None:
        id_list = [validate_id(i, "memory id") for i in ids]
        expr = expr & col("id").isin([lit(i) for i in id_list])
    if session_id is not None:
        expr = expr & (col("session_id") == lit(validate_id(session_id, "session_id")))
    if others_in_fragments is not None:
        ranges = [(col("_rowid") >= lit(int(f) << 32)) & (col("_rowid") < lit((int(f) + 1) << 32))
                  for f in others_in_fragments]
        return functools.reduce(operator.or_, ranges) & ~expr
    return expr
