"""A user's interaction log (CSV, JSON Lines, JSON or Parquet) → a LaMP folder in CFRAG's time-based layout.

One log row is one item a user produced: a review with its star rating, a post with its tag, an article with its
headline. `convert_log` reads the columns the options name, checks every value (a bad one stops the conversion
with the file, the row and the column), and writes, per user, items oldest first:

- the latest item is the user's **test** question, the one before it **dev**, the `train_per_user` before those
  **train** questions (the question's text comes from the item's text column through the task's LaMP prompt, its
  gold is the item's label);
- each question's **profile** is the user's items strictly older than it, so no question sees its own item or a
  later one; a question's id is its item's doc id, which the history rules (data/histories.py) also keep out of
  every retrieval;
- users with fewer than `min_items` items are dropped (counted); `max_test_users` / `max_dev_users` keep a seeded
  random subset of users' test / dev questions (the others keep their train questions only).

Rows are numbered from 1 in messages: data rows of a CSV (the header is not a row), lines of a JSON Lines file,
elements of a JSON list, rows of a Parquet file. The output folder appears whole or not at all, and the same log
with the same options gives byte-identical files (docs/data/your-own-data.md).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from persrag_lightning.data.lamp import (
    OutputsWriter,
    QuestionsWriter,
    gc_paused,
    outputs_path,
    profile_item_json,
    questions_path,
    task_spec,
)
from persrag_lightning.data.log_files import LogFormatError, read_log
from persrag_lightning.data.synth_text import LAMP2_PROMPT, LAMP3_PROMPT, LAMP4_PROMPT, LAMP5_PROMPT
from persrag_lightning.data.tasks import TaskSpec
from persrag_lightning.utils import atomic_directory, atomic_write_json

MANIFEST = "convert.json"
TEXT = "{text}"  # where a question's template puts the item's text


@dataclass(frozen=True)
class TaskLayout:
    """How a log item becomes a LaMP item of one task: which profile field holds the text column, which the label
    column (the question's gold), and LaMP's prompt before the text."""

    text_field: str
    label_field: str
    template: str
    marker: str  # the words after which the task's query extraction (data/tasks.py) reads the text


LAYOUTS: dict[str, TaskLayout] = {
    "LaMP-2": TaskLayout("description", "tag", LAMP2_PROMPT + TEXT, "description:"),
    "LaMP-3": TaskLayout("text", "score", LAMP3_PROMPT + TEXT, "review:"),
    "LaMP-4": TaskLayout("text", "title", LAMP4_PROMPT + TEXT, "article:"),
    "LaMP-5": TaskLayout("abstract", "title", LAMP5_PROMPT + TEXT, "paper:"),
}
# LaMP-1 (a choice between two references) and LaMP-7 (a tweet from its paraphrase) ask questions a log of single
# items does not hold.


@dataclass(frozen=True)
class ConvertOptions:
    """What `persrag data convert` reads and how it splits; column options name the log's columns."""

    task: str
    user: str
    date: str
    text: str
    label: str
    item: str | None = None
    min_items: int = 5            # the k-core convention of review data: a user needs a history to personalize
    train_per_user: int = 2       # train questions per user, before the dev and test items (SynthLaMP has 2)
    max_test_users: int | None = None  # a seeded random subset of test users (a 2-core main job reads 300)
    max_dev_users: int | None = None
    seed: int = 0
    template: str | None = None   # the question's input; `{text}` is replaced by the item's text

    def check(self) -> TaskLayout:
        """The task's layout, with the options' combination checked (one line each, exit code 2)."""
        spec = task_spec(self.task)
        if spec.name not in LAYOUTS:
            raise LogFormatError(f"--task: {spec.name} cannot be made from a log of single items; convert to one of "
                                 f"{', '.join(LAYOUTS)}")
        if self.train_per_user < 1:
            raise LogFormatError(f"--train_per_user: must be at least 1, got {self.train_per_user}")
        need = self.train_per_user + 3  # test, dev, the train questions, and one item in the oldest profile
        if self.min_items < need:
            raise LogFormatError(f"--min_items: {self.min_items} is too few for --train_per_user "
                                 f"{self.train_per_user}: a user needs {need} items (test, dev, "
                                 f"{self.train_per_user} train, one profile item before them)")
        for name in ("max_test_users", "max_dev_users"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LogFormatError(f"--{name}: must be at least 1, got {value}")
        layout = LAYOUTS[spec.name]
        if self.template is not None:
            if self.template.count(TEXT) != 1:
                raise LogFormatError(f"--template: must hold {TEXT} exactly once, got {self.template!r}")
            probe = "an item's own words"
            if spec.extract_query(self.template.replace(TEXT, probe)) != probe:
                raise LogFormatError(f"--template: {spec.name} reads the query after {layout.marker!r}; end the "
                                     f"template with {layout.marker} {TEXT}, got {self.template!r}")
            layout = TaskLayout(layout.text_field, layout.label_field, self.template, layout.marker)
        return layout

    def columns(self) -> dict[str, str]:
        """Option name → the log column it names."""
        out = {"user": self.user, "date": self.date, "text": self.text, "label": self.label}
        if self.item is not None:
            out["item"] = self.item
        return out


# ---------------------------------------------------------------------------------------------------- checking

_NUMBER = re.compile(r"[+-]?[0-9]+(?:\.[0-9]*)?")


def _fail(path: Path, row: int, option: str, column: str, msg: str) -> LogFormatError:
    return LogFormatError(f"{path.name}: row {row + 1}: column {column!r} (--{option}): {msg}")


def parse_timestamp(value: Any) -> int:
    """Seconds since the epoch (UTC) of an ISO 8601 date or date-time (naive = UTC) or of Unix seconds (a number
    or its text); ValueError for text it cannot read, TypeError for other values."""
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
        raise ValueError(f"cannot read {value!r} as an ISO date (2016-03-27, 2016-03-27T10:05:00Z) or Unix "
                         "seconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return math.floor(moment.timestamp())


def _timestamps(path: Path, values: list[Any], column: str) -> np.ndarray:
    """Seconds of every row: pyarrow's ISO parser over the whole column when it reads every value alike (naive
    date-times, or all with an offset), else parse_timestamp row by row, which names the row it cannot read."""
    fast = _arrow_timestamps(values)
    if fast is not None:
        return fast
    seen: dict[Any, int] = {}
    out = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        try:
            ts = seen.get(v) if isinstance(v, str) else None
            if ts is None:
                ts = parse_timestamp(v) if v is not None else None
                if ts is None:
                    raise ValueError("missing value")
                if isinstance(v, str):
                    seen[v] = ts
            out[i] = ts
        except (ValueError, TypeError, OverflowError) as e:
            raise _fail(path, i, "date", column, str(e)) from None
    return out


def _arrow_timestamps(values: list[Any]) -> np.ndarray | None:
    import pyarrow as pa

    try:
        column = pa.array(values, type=pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    if column.null_count:
        return None
    for kind in (pa.timestamp("s"), pa.timestamp("s", tz="UTC")):  # naive values are UTC, as parse_timestamp reads
        try:
            return column.cast(kind).cast(pa.int64()).to_numpy()
        except pa.ArrowInvalid:
            continue
    return None


def _identifiers(path: Path, values: list[Any], option: str, column: str) -> list[str]:
    out = []
    for i, v in enumerate(values):
        if type(v) is not str:
            if isinstance(v, int) and not isinstance(v, bool):
                v = str(v)
            elif v is None:
                raise _fail(path, i, option, column, "missing value")
            else:
                raise _fail(path, i, option, column, f"expected a string or integer id, got {type(v).__name__}")
        if not v.strip():
            raise _fail(path, i, option, column, "empty id")
        out.append(v)
    return out


def _texts(path: Path, values: list[Any], option: str, column: str) -> list[str]:
    for i, v in enumerate(values):
        if type(v) is not str or not v.strip():
            raise _fail(path, i, option, column, "missing value" if v is None else
                        f"expected text, got {type(v).__name__}" if not isinstance(v, str) else "empty text")
    return values


def _labels(path: Path, values: list[Any], column: str, spec: TaskSpec) -> list[str]:
    """Each label as the task's own spelling: LaMP-3's scores 1–5 ("4", 4, 4.0 → "4"), LaMP-2's tags; the
    generation tasks' labels are texts."""
    if spec.labels is None:
        return _texts(path, values, "label", column)
    allowed = set(spec.labels)
    out = []
    memo: dict[Any, str] = {}
    for i, v in enumerate(values):
        label = memo.get(v) if isinstance(v, (str, int, float)) else None
        if label is None:
            label = _label(v, spec)
            if label not in allowed:
                shown = "missing value" if v is None else f"{v!r} is not a {spec.name} label"
                raise _fail(path, i, "label", column, f"{shown} (expected one of {', '.join(spec.labels)})")
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


# ------------------------------------------------------------------------------------------------------ layout

@dataclass
class Conversion:
    """What a conversion kept, dropped and wrote (printed by `persrag data convert`, stored as convert.json)."""

    task: str
    rows: int
    users: int
    items: int
    dropped_users: int
    dropped_rows: int
    questions: dict[str, int]
    items_per_user: dict[str, float]
    labels: dict[str, int] = field(default_factory=dict)  # label → items (label tasks)
    baseline: dict[str, Any] = field(default_factory=dict)  # the majority label of train, scored on test

    def summary(self) -> str:
        """The lines a researcher checks first."""
        q = self.items_per_user
        lines = [(f"{self.task}: {self.rows} rows → {self.users} users, {self.items} items "
                  f"(dropped {self.dropped_users} users with too few items: {self.dropped_rows} rows)"),
                 ("items per user: min {min:.0f}, 25 % {p25:.0f}, median {p50:.0f}, 75 % {p75:.0f}, "
                  "max {max:.0f}").format(**q),
                 "questions: " + ", ".join(f"{s} {n}" for s, n in self.questions.items())]
        if self.labels:
            total = sum(self.labels.values())
            lines.append("labels: " + ", ".join(f"{k!r} {100 * n / total:.1f} %" for k, n in
                                                sorted(self.labels.items(), key=lambda kv: (-kv[1], kv[0]))))
        if self.baseline:
            b = self.baseline
            scores = ", ".join(f"{k} {v:.3f}" for k, v in b["test"].items())
            lines.append(f"test, majority label of train ({b['label']!r}), no reader: {scores}")
        return "\n".join(lines)


def _doc_ids(users: list[str], items: list[str] | None, order: np.ndarray, starts: np.ndarray,
             counts: np.ndarray) -> list[str]:
    """Doc id of each row: `{user}-{item}` with an item column, else `{user}-{position}` (oldest first)."""
    ids = [""] * len(users)
    width = len(str(max(int(counts.max(initial=1)) - 1, 0)))
    for start, count in zip(starts.tolist(), counts.tolist()):
        for pos, row in enumerate(order[start:start + count].tolist()):
            suffix = items[row] if items is not None else f"{pos:0{width}d}"
            ids[row] = f"{users[row]}-{suffix}"
    return ids


def _check_duplicates(path: Path, users: list[str], items: list[str], column: str) -> None:
    first: dict[tuple[str, str], int] = {}
    for i, key in enumerate(zip(users, items)):
        j = first.setdefault(key, i)
        if j != i:
            raise _fail(path, i, "item", column, f"user {key[0]!r} already has item {key[1]!r} (row {j + 1})")


def _split_rows(counts: np.ndarray, options: ConvertOptions) -> tuple[np.ndarray, np.ndarray]:
    """Which kept users (by index) ask a test and a dev question: all, or a seeded random subset of each."""
    n = len(counts)
    order = np.random.default_rng(options.seed).permutation(n)
    test = np.zeros(n, dtype=bool)
    dev = np.zeros(n, dtype=bool)
    test[order[:options.max_test_users or n]] = True
    dev[order[:options.max_dev_users or n]] = True
    return test, dev


def _date_strings(ts: np.ndarray) -> list[str]:
    """LaMP dates ('-'-separated integers): YYYY-MM-DD when every item is at midnight UTC, else with the time of
    day (YYYY-MM-DD-HH-MM-SS), so the file keeps the order the split was made in."""
    iso = ts.astype("datetime64[s]").astype(str)
    if not (ts % 86400).any():
        return [s[:10] for s in iso.tolist()]
    return [s.replace("T", "-").replace(":", "-") for s in iso.tolist()]


@dataclass
class LogRows:
    """A checked log: one value per row, and each kept user's rows (oldest first) as a slice of `order`."""

    users: list[str]
    texts: list[str]
    labels: list[str]
    doc_ids: list[str]
    dates: list[str]
    order: np.ndarray   # row indices, users in sorted id order, each user's rows oldest first
    starts: np.ndarray  # where each kept user's rows begin in `order`
    counts: np.ndarray  # how many rows each kept user has
    dropped_users: int

    def user_rows(self) -> list[list[int]]:
        return [self.order[s:s + c].tolist() for s, c in zip(self.starts.tolist(), self.counts.tolist())]


def check_log(path: Path, options: ConvertOptions, spec: TaskSpec) -> LogRows:
    """Every value of the named columns checked (a bad one raises LogFormatError naming the row and the column),
    users with too few items dropped, and each kept user's rows ordered by time (equal times: the file's order)."""
    cols = options.columns()
    raw = read_log(path, list(cols.values()))
    n = len(raw[cols["user"]])
    if n == 0:
        raise LogFormatError(f"{path.name}: no rows")
    users = _identifiers(path, raw[cols["user"]], "user", cols["user"])
    ts = _timestamps(path, raw[cols["date"]], cols["date"])
    texts = _texts(path, raw[cols["text"]], "text", cols["text"])
    labels = _labels(path, raw[cols["label"]], cols["label"], spec)
    items = _identifiers(path, raw[cols["item"]], "item", cols["item"]) if "item" in cols else None
    if items is not None:
        _check_duplicates(path, users, items, cols["item"])
    codes_of = {u: k for k, u in enumerate(sorted(set(users)))}
    codes = np.fromiter((codes_of[u] for u in users), dtype=np.int64, count=n)
    order = np.lexsort((np.arange(n), ts, codes))
    counts = np.bincount(codes, minlength=len(codes_of))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    keep = counts >= options.min_items
    if not keep.any():
        raise LogFormatError(f"{path.name}: no user has {options.min_items} items (--min_items); the most any user "
                             f"has is {int(counts.max())}")
    starts, counts = starts[keep], counts[keep]
    return LogRows(users, texts, labels, _doc_ids(users, items, order, starts, counts), _date_strings(ts), order,
                   starts, counts, int((~keep).sum()))


def convert_log(log: str | Path, out: str | Path, options: ConvertOptions, overwrite: bool = False) -> Conversion:
    """Check the whole log, then write the LaMP folder `out` (atomically) with its manifest convert.json."""
    path, out = Path(log), Path(out)
    layout = options.check()
    spec = task_spec(options.task)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LogFormatError(f"--out: {out} exists and is not empty; pass --overwrite to replace it")
    rows = check_log(path, options, spec)
    with atomic_directory(out) as tmp, gc_paused():
        questions, train_labels, test_golds = write_questions(tmp, rows, options, spec, layout)
        kept = [r for user in rows.user_rows() for r in user]
        conversion = Conversion(
            spec.name, len(rows.users), len(rows.counts), len(kept), rows.dropped_users, len(rows.users) - len(kept),
            questions, {k: float(v) for k, v in zip(("min", "p25", "p50", "p75", "max"),
                                                    np.percentile(rows.counts, [0, 25, 50, 75, 100]))},
            labels=dict(Counter(rows.labels[r] for r in kept)) if spec.labels else {},
            baseline=_majority_baseline(spec, train_labels, test_golds))
        atomic_write_json(tmp / MANIFEST, {"source": path.name, "sha256": _digest(path), "options": asdict(options),
                                           "conversion": asdict(conversion)})
    return conversion


def write_questions(folder: Path, rows: LogRows, options: ConvertOptions, spec: TaskSpec,
                    layout: TaskLayout) -> tuple[dict[str, int], Counter[str], list[str]]:
    """Each kept user's questions into the split files of `folder`: (questions per split, train labels, test
    golds)."""
    questions = {"train": 0, "dev": 0, "test": 0}
    train_labels: Counter[str] = Counter()
    test_golds: list[str] = []
    asks_test, asks_dev = _split_rows(rows.counts, options)
    with ExitStack() as stack:
        qw = {s: stack.enter_context(QuestionsWriter(questions_path(folder, s), spec)) for s in questions}
        ow = {s: stack.enter_context(OutputsWriter(outputs_path(folder, s), spec)) for s in questions}
        for u, user in enumerate(rows.user_rows()):
            docs = [profile_item_json(rows.doc_ids[r], rows.dates[r],
                                      _fields(spec, layout, rows.texts[r], rows.labels[r])) for r in user]
            count = len(user)
            plan = [(p, "train") for p in range(count - 2 - options.train_per_user, count - 2)]
            plan += [(count - 2, "dev")] * bool(asks_dev[u]) + [(count - 1, "test")] * bool(asks_test[u])
            for p, split in plan:
                r = user[p]
                qw[split].write_record(rows.doc_ids[r], layout.template.replace(TEXT, rows.texts[r]), rows.users[r],
                                       "[" + ", ".join(docs[:p]) + "]")
                ow[split].write(rows.doc_ids[r], rows.labels[r])
                questions[split] += 1
                if split == "train":
                    train_labels[rows.labels[r]] += 1
                elif split == "test":
                    test_golds.append(rows.labels[r])
    return questions, train_labels, test_golds


def _fields(spec: TaskSpec, layout: TaskLayout, text: str, label: str) -> dict[str, str]:
    values = {layout.text_field: text, layout.label_field: label}
    return {f: values[f] for f in spec.profile_fields}


def _majority_baseline(spec: TaskSpec, train: Counter[str], test: list[str]) -> dict[str, Any]:
    """The reader-free floor every LLM row must beat: train's most frequent label answered to every test question
    (ties: the label listed first by the task)."""
    if spec.labels is None or not train or not test:
        return {}
    label = max(spec.labels, key=lambda lab: (train[lab], -spec.labels.index(lab)))
    scores = {"accuracy": float(np.mean([g == label for g in test]))}
    if spec.kind == "regression":
        errors = np.array([float(g) - float(label) for g in test])
        scores.update(mae=float(np.abs(errors).mean()), rmse=float(np.sqrt((errors ** 2).mean())))
    return {"label": label, "test": scores}


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
