"""A user's log file (CSV, TSV, JSON Lines, a JSON list, Parquet; any of them gzipped) read into the
columns a conversion names.

Files are taken as they are published: a gzipped file (`.json.gz`, `.csv.gz`, or any name) is read
directly, and JSON is recognised by its content whatever the extension, so Amazon's `.json` files,
which hold JSON Lines, read as JSON Lines. Rows are numbered from 1 in messages: data rows of a CSV
(the header is not a row), lines of a JSON Lines file, elements of a JSON list, rows of a Parquet
file. pyarrow reads every format fast; where it refuses a JSON Lines file, the file is read again
line by line, so the message names the line.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from persrag_lightning.data.lamp import LampFormatError, gc_paused

__all__ = ["FORMATS", "LogFormatError", "read_log"]


class LogFormatError(LampFormatError):
    """A bad log or bad conversion options: the message names the file, the row and the column (exit
    code 2)."""


FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json",
           ".parquet": "parquet", ".pq": "parquet"}
_GZIP = b"\x1f\x8b"  # the first two bytes of every gzip file


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == _GZIP


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")  # type: ignore[return-value]


def _log_format(path: Path) -> str:
    """The format: a JSON list or JSON Lines by the file's content (`[` or one object per line)
    whatever its name, else by the extension (a gzipped `.csv.gz` reads as CSV)."""
    sniffed = _sniff_json(path)
    if sniffed is not None:
        return sniffed
    suffixes = [s.lower() for s in path.suffixes]
    for s in reversed(suffixes):
        if s in FORMATS and FORMATS[s] not in ("json", "jsonl"):
            return FORMATS[s]
    if any(FORMATS.get(s) in ("json", "jsonl") for s in suffixes):
        # named JSON but neither a list nor JSON Lines: the JSON reader names what it found
        return "json"
    raise LogFormatError(
        f"{path.name}: unknown log format; expected one of {', '.join(sorted(FORMATS))} (or JSON "
        "by its content), optionally gzipped"
    )


def _sniff_json(path: Path) -> str | None:
    """"json" for a file that starts with `[`, "jsonl" for one whose first line is a JSON object,
    else None."""
    try:
        with _open_binary(path) as f:
            first = f.readline().lstrip(b"\xef\xbb\xbf").strip()
    except (OSError, EOFError) as e:
        raise LogFormatError(f"{path.name}: cannot read: {e}") from None
    if first.startswith(b"["):
        return "json"
    if first.startswith(b"{"):
        try:
            return "jsonl" if isinstance(json.loads(first), dict) else "json"
        except (json.JSONDecodeError, UnicodeDecodeError):
            # an object over several lines: the JSON reader says it is not a list of rows
            return "json"
    return None


def read_log(path: str | Path, columns: Sequence[str]) -> dict[str, list[Any]]:
    """The named columns of a log, as Python lists of the file's values (None where a value is
    missing)."""
    path = Path(path)
    if not path.is_file():
        raise LogFormatError(f"{path}: no such file")
    kind = _log_format(path)
    wanted = list(dict.fromkeys(columns))
    with gc_paused():
        if kind in ("csv", "tsv"):
            return _read_csv(path, wanted, "\t" if kind == "tsv" else ",")
        if kind == "parquet":
            return _read_parquet(path, wanted)
        if kind == "jsonl":
            return _read_jsonl(path, wanted)
        return _read_json(path, wanted)


def _missing(path: Path, have: Sequence[str], wanted: Sequence[str]) -> None:
    absent = [c for c in wanted if c not in have]
    if absent:
        raise LogFormatError(
            f"{path.name}: no column {absent[0]!r}; the file has {', '.join(map(repr, have))}"
        )


def _read_csv(path: Path, wanted: list[str], delimiter: str) -> dict[str, list[Any]]:
    import pyarrow as pa
    from pyarrow import csv

    parse = csv.ParseOptions(delimiter=delimiter)
    compression = "gzip" if _is_gzip(path) else None
    try:
        with csv.open_csv(
            pa.input_stream(path, compression=compression), parse_options=parse
        ) as reader:
            _missing(path, reader.schema.names, wanted)
        # every column as text: user ids like "007" stay themselves, and each value is checked below
        table = csv.read_csv(pa.input_stream(path, compression=compression), parse_options=parse,
                             convert_options=csv.ConvertOptions(include_columns=wanted,
                                                                column_types={c: pa.string() for c in wanted},
                                                                strings_can_be_null=False))
    except (pa.ArrowInvalid, UnicodeDecodeError, OSError) as e:
        raise LogFormatError(f"{path.name}: not a readable CSV file: {e}") from None
    return {c: table.column(c).to_pylist() for c in wanted}


def _read_parquet(path: Path, wanted: list[str]) -> dict[str, list[Any]]:
    import pyarrow as pa
    from pyarrow import parquet

    try:
        _missing(path, parquet.read_schema(path).names, wanted)
        table = parquet.read_table(path, columns=wanted)
    except (pa.ArrowInvalid, OSError) as e:
        raise LogFormatError(f"{path.name}: not a readable Parquet file: {e}") from None
    return {c: _values(table.column(c)) for c in wanted}


def _values(column: Any) -> list[Any]:
    """A pyarrow column as Python values; typed dates and timestamps become Unix seconds (naive ones
    are UTC)."""
    import pyarrow as pa

    if pa.types.is_date(column.type):
        column = column.cast(pa.timestamp("s"))
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.timestamp("s", tz=column.type.tz), safe=False).cast(pa.int64())
    return column.to_pylist()


def _read_jsonl(path: Path, wanted: list[str]) -> dict[str, list[Any]]:
    """pyarrow's reader, fast; a line it refuses (or values whose type changes) is found again line
    by line, so the message names it."""
    import pyarrow as pa
    from pyarrow import json as pa_json

    try:
        table = pa_json.read_json(
            pa.input_stream(path, compression="gzip" if _is_gzip(path) else None)
        )
        _missing(path, table.column_names, wanted)
        return {c: _values(table.column(c)) for c in wanted}
    except pa.ArrowInvalid:
        pass
    columns: dict[str, list[Any]] = {c: [] for c in wanted}
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                raise LogFormatError(
                    f"{path.name}: row {n}: an empty line (JSON Lines holds one object per line)"
                )
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise LogFormatError(
                    f"{path.name}: row {n}: malformed JSON at column {e.colno}: {e.msg}"
                ) from None
            _add_record(path, n, record, columns)
    return _checked_columns(path, columns)


def _read_json(path: Path, wanted: list[str]) -> dict[str, list[Any]]:
    try:
        with _open_text(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise LogFormatError(
            f"{path.name}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    if not isinstance(data, list):
        raise LogFormatError(f"{path.name}: top level: expected a JSON list of row objects, got "
                             f"{type(data).__name__}")
    columns: dict[str, list[Any]] = {c: [] for c in wanted}
    for n, record in enumerate(data, 1):
        _add_record(path, n, record, columns)
    return _checked_columns(path, columns)


def _open_text(path: Path) -> IO[str]:
    """UTF-8 text of a file, gzipped or not (a byte-order mark is skipped)."""
    if _is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="strict")  # type: ignore[return-value]
    return open(path, encoding="utf-8-sig", errors="strict")


def _add_record(path: Path, n: int, record: Any, columns: dict[str, list[Any]]) -> None:
    if not isinstance(record, dict):
        raise LogFormatError(
            f"{path.name}: row {n}: expected an object, got {type(record).__name__}"
        )
    for c, values in columns.items():
        values.append(record.get(c, _ABSENT))


_ABSENT = object()  # a key the record lacks (a column no row has is refused as a missing column)


def _checked_columns(path: Path, columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    for c, values in columns.items():
        if values and all(v is _ABSENT for v in values):
            _missing(path, [k for k in columns if k != c], [c])
        columns[c] = [None if v is _ABSENT else v for v in values]
    return columns
