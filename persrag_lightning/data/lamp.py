"""Reader of the LaMP format (time-based and user-based splits), with errors that name file, record and field; its
writer is lamp_write.py and the conventions both share (splits, file names, dates) are lamp_format.py, all of whose
names are importable from here.

Layout of a data directory: ``{split}_questions.json`` and ``{split}_outputs.json`` for split in train/dev/test
(test outputs optional). Questions: a JSON list of ``{"id", "input", "user_id", "profile": [{"id", "date", ...}]}``
(LaMP's time-based split); a file whose questions have no ``user_id`` (LaMP's user-based split) makes each question
its own user, whose id is the question's id; a file with ``user_id`` on some questions only is refused;
outputs: ``{"task": "LaMP_2", "golds": [{"id", "output"}]}``. Record numbers in messages are 0-based list indices.

Every profile item of a user, over all questions of all splits, becomes one doc of that user (matched by doc id),
so each doc is embedded once; the same doc id with different content (date or a task field) for one user is an
error that names the user, the doc id and both places. Which of those docs a question may *retrieve* is decided
elsewhere (data/histories.py): each Example keeps the ids of its own question's profile for that. Histories are
sorted oldest first, stable on equal dates in first-seen order.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from persrag_lightning.data.errors import LampFormatError
from persrag_lightning.data.folder_task import resolve_task
from persrag_lightning.data.lamp_format import (
    DATE_PATTERN,
    SPLITS,
    format_date,
    json_type_name,
    outputs_path,
    parse_date,
    questions_path,
    task_code,
    task_spec,
)
from persrag_lightning.data.lamp_write import (
    OutputsWriter,
    QuestionsWriter,
    profile_item_json,
    write_lamp,
    write_outputs,
    write_predictions,
    write_questions,
)
from persrag_lightning.data.records import Example, HistoryDoc, LampDataset, User
from persrag_lightning.data.tasks import TaskSpec, get_task

# the reader's own names, then the format's and the writer's (lamp_format.py, lamp_write.py), importable from here
__all__ = ["DATE_PATTERN", "SHARING_FILE", "SPLITS", "LampFormatError", "OutputsWriter", "QuestionsWriter", "format_date",
           "gc_paused", "load_lamp", "outputs_path", "parse_date", "profile_item_json", "questions_path", "read_outputs",
           "read_sharing", "task_spec", "write_lamp", "write_outputs", "write_predictions", "write_questions"]

log = logging.getLogger(__name__)

_FEW = 5  # how many offending ids a mismatch message lists

_parse_date_cached = lru_cache(maxsize=1 << 16)(parse_date)  # dates repeat across a dataset's items


# ------------------------------------------------------------------------------------------ reading

def _where(path: Path, index: int | None = None, rid: str | None = None, field: str | None = None) -> str:
    """Message prefix 'file: record i (id 'x'): field' for whatever of it is known."""
    out = path.name
    if index is not None:
        out += f": record {index}" + (f" (id {rid!r})" if rid is not None else "")
    if field is not None:
        out += f": {field}"
    return out


def _fail(path: Path, msg: str, index: int | None = None, rid: str | None = None,
          field: str | None = None) -> LampFormatError:
    return LampFormatError(f"{_where(path, index, rid, field)}: {msg}")


def _load_json(path: Path) -> Any:
    """json.load with decode errors turned into LampFormatError carrying the decoder's line and column."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise _fail(path, f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise _fail(path, f"not UTF-8 text: {e}") from None
    except OSError as e:
        raise _fail(path, f"cannot read: {e.strerror or e}") from None


def _get(obj: dict, key: str, path: Path, index: int | None, rid: str | None, field: str) -> Any:
    if key not in obj:
        raise _fail(path, "missing field", index, rid, field)
    return obj[key]


def _as_id(value: Any, path: Path, index: int | None, rid: str | None, field: str) -> str:
    """Ids must be str or int (some dumps use ints); ints become their decimal string."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise _fail(path, f"expected a string or integer id, got {json_type_name(value)} {value!r}", index, rid, field)


def _as_text(value: Any, path: Path, index: int | None, rid: str | None, field: str) -> str:
    """Text fields must be strings; numbers (LaMP-3 scores in some dumps) are kept as their string."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise _fail(path, f"expected a string, got {json_type_name(value)}", index, rid, field)


class _UserAggregator:
    """Collects each user's docs over all questions of all splits, checking that repeated doc ids agree."""

    def __init__(self) -> None:
        # user_id -> doc_id -> (doc, (file, record index, record id, profile index) of its first copy, raw item)
        self.docs: dict[str, dict[str, tuple[HistoryDoc, tuple[Path, int, str, int], dict]]] = {}

    def add(self, user_id: str, doc: HistoryDoc, origin: tuple[Path, int, str, int], raw: dict) -> None:
        """Keep the first copy of each doc id; a later copy with other content is an error naming both places."""
        docs = self.docs.setdefault(user_id, {})
        known = docs.get(doc.doc_id)
        if known is None:
            docs[doc.doc_id] = (doc, origin, raw)
        elif known[0] != doc:
            first, (fpath, fi, fid, fj), _ = known
            diff = "date" if first.date != doc.date else next(
                f for f in sorted(set(first.fields) | set(doc.fields)) if first.fields.get(f) != doc.fields.get(f))
            old = format_date(first.date) if diff == "date" else first.fields.get(diff)
            new = format_date(doc.date) if diff == "date" else doc.fields.get(diff)
            path, i, rid, j = origin
            raise _fail(path, f"user {user_id!r} doc {doc.doc_id!r} differs from its copy in "
                              f"{_where(fpath, fi, fid, f'profile[{fj}]')} ({diff}: {old!r} there, {new!r} here)",
                        i, rid, f"profile[{j}]")

    def users(self) -> dict[str, User]:
        """Histories oldest first; sorted() is stable, so equal dates keep first-seen order."""
        return {uid: User(uid, sorted((d for d, _, _ in docs.values()), key=lambda d: d.date))
                for uid, docs in self.docs.items()}


def _profile_item(path: Path, i: int, qid: str, j: int, item: Any, spec: TaskSpec) -> HistoryDoc:
    """Validate one profile item into a HistoryDoc (task fields only); the common all-strings case is fast."""
    if type(item) is dict:
        did, raw_date = item.get("id"), item.get("date")
        if type(did) is str and type(raw_date) is str:
            values = [item.get(f) for f in spec.profile_fields]
            if all(type(v) is str for v in values):
                try:
                    return HistoryDoc(did, _parse_date_cached(raw_date), dict(zip(spec.profile_fields, values)))
                except ValueError:
                    pass
    return _profile_item_checked(path, i, qid, j, item, spec)


def _profile_item_checked(path: Path, i: int, qid: str, j: int, item: Any, spec: TaskSpec) -> HistoryDoc:
    """The slow path of _profile_item: every check spelled out, with the message that names the field."""
    at = f"profile[{j}]"
    if not isinstance(item, dict):
        raise _fail(path, f"expected an object, got {json_type_name(item)}", i, qid, at)
    did = _as_id(_get(item, "id", path, i, qid, f"{at}.id"), path, i, qid, f"{at}.id")
    try:
        date = parse_date(_get(item, "date", path, i, qid, f"{at}.date"))
    except ValueError as e:
        raise _fail(path, str(e), i, qid, f"{at}.date") from None
    fields = {f: _as_text(_get(item, f, path, i, qid, f"{at}.{f}"), path, i, qid, f"{at}.{f}")
              for f in spec.profile_fields}
    return HistoryDoc(did, date, fields)


def _read_questions(path: Path, spec: TaskSpec,
                    users: _UserAggregator) -> tuple[list[tuple[str, str, str, tuple[str, ...]]], bool | None]:
    """Validate a questions file, feed its profiles to `users`; returns (id, user_id, input, profile doc ids) per
    record, and whether the file is time-based (its questions carry user_id; None for an empty file)."""
    data = _load_json(path)
    if not isinstance(data, list):
        raise _fail(path, f"top level: expected a JSON list of questions, got {json_type_name(data)}")
    out: list[tuple[str, str, str, tuple[str, ...]]] = []
    first_index: dict[str, int] = {}
    time_based = bool(data) and isinstance(data[0], dict) and "user_id" in data[0]
    if data and not time_based:
        log.warning("%s has no user_id: each of its %d questions is its own user (LaMP's user-based split)",
                    path.name, len(data))
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise _fail(path, f"expected an object, got {json_type_name(rec)}", i)
        qid = _as_id(_get(rec, "id", path, i, None, "id"), path, i, None, "id")
        if qid in first_index:
            raise _fail(path, f"duplicate question id (first at record {first_index[qid]})", i, qid, "id")
        first_index[qid] = i
        text = _get(rec, "input", path, i, qid, "input")
        if not isinstance(text, str):
            raise _fail(path, f"expected a string, got {json_type_name(text)}", i, qid, "input")
        if ("user_id" in rec) != time_based:
            raise _fail(path, f"{'missing' if time_based else 'present'} here but "
                              f"{'present' if time_based else 'missing'} in record 0: every question of a file has "
                              "user_id (time-based split) or none has (user-based split)", i, qid, "user_id")
        uid = _as_id(rec["user_id"], path, i, qid, "user_id") if time_based else qid
        profile = _get(rec, "profile", path, i, qid, "profile")
        if not isinstance(profile, list):
            raise _fail(path, f"expected a list of profile items, got {json_type_name(profile)}", i, qid, "profile")
        if not profile:
            raise _fail(path, "empty profile", i, qid, "profile")
        known = users.docs.get(uid, {})
        ids = []
        for j, item in enumerate(profile):
            # Fast path: later questions repeat the user's profile; an identical raw copy needs no checks.
            prev = known.get(item.get("id")) if type(item) is dict and type(item.get("id")) is str else None
            if prev is not None and prev[2] == item:
                ids.append(prev[0].doc_id)
                continue
            doc = _profile_item(path, i, qid, j, item, spec)
            users.add(uid, doc, (path, i, qid, j), item)
            ids.append(doc.doc_id)
        out.append((qid, uid, text, tuple(ids)))
    return out, time_based if data else None


def read_outputs(path: str | Path, task: str | TaskSpec) -> dict[str, str]:
    """Golds (or predictions) file -> {id: output}; its `task` must be the task asked for."""
    path = Path(path)
    spec = task_spec(task)
    data = _load_json(path)
    if not isinstance(data, dict):
        raise _fail(path, f"top level: expected an object with 'task' and 'golds', got {json_type_name(data)}")
    if "task" not in data:
        raise _fail(path, "missing field", field="task")
    try:
        file_task = get_task(data["task"]).name
    except ValueError:
        file_task = None
    if file_task != spec.name:
        raise _fail(path, f"file is for {data['task']!r}, expected {task_code(spec)!r}", field="task")
    golds = data.get("golds")
    if golds is None:
        raise _fail(path, "missing field", field="golds")
    if not isinstance(golds, list):
        raise _fail(path, f"expected a list, got {json_type_name(golds)}", field="golds")
    out: dict[str, str] = {}
    first_index: dict[str, int] = {}
    for i, rec in enumerate(golds):
        if not isinstance(rec, dict):
            raise _fail(path, f"golds: expected an object, got {json_type_name(rec)}", i)
        gid = _as_id(_get(rec, "id", path, i, None, "id"), path, i, None, "id")
        if gid in first_index:
            raise _fail(path, f"duplicate gold id (first at record {first_index[gid]})", i, gid, "id")
        first_index[gid] = i
        out[gid] = _as_text(_get(rec, "output", path, i, gid, "output"), path, i, gid, "output")
    return out


def _few(ids: Iterable[str]) -> str:
    ids = sorted(ids)
    return ", ".join(repr(x) for x in ids[:_FEW]) + (f", ... ({len(ids)} in all)" if len(ids) > _FEW else "")


def _check_ids(qpath: Path, opath: Path, question_ids: list[str], golds: Mapping[str, str]) -> None:
    """Every question needs exactly one gold and vice versa; list a few offenders of each kind."""
    qids = set(question_ids)
    missing, extra = qids - golds.keys(), golds.keys() - qids
    if missing or extra:
        parts = [f"{len(missing)} question id(s) of {qpath.name} have no gold: {_few(missing)}"] if missing else []
        if extra:
            parts.append(f"{len(extra)} gold id(s) match no question of {qpath.name}: {_few(extra)}")
        raise _fail(opath, "; ".join(parts), field="golds")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building millions of acyclic objects (json.load, records): faster,
    as its passes over them would free nothing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_lamp(data_dir: str | Path, task: str, splits: Iterable[str] = SPLITS) -> LampDataset:
    """The requested splits present in `data_dir` (train required) as a LampDataset; a converted
    folder's task comes from its convert.json (data/folder_task.py)."""
    with gc_paused():
        return _load_lamp(Path(data_dir), task, splits)


def _load_lamp(data_dir: Path, task: str, splits: Iterable[str]) -> LampDataset:
    try:
        spec = task_spec(task if isinstance(task, TaskSpec) else resolve_task(task, data_dir))
    except LampFormatError as e:
        raise LampFormatError(f"{data_dir}: {e}") from None
    wanted = list(dict.fromkeys(splits))
    for split in wanted:
        if split not in SPLITS:
            raise LampFormatError(f"{data_dir}: splits: unknown split {split!r}; expected one of {SPLITS}")
    users = _UserAggregator()
    examples: dict[str, list[Example]] = {}
    layouts: dict[bool, Path] = {}  # time-based? → the first questions file of that layout
    for split in wanted:
        qpath, opath = questions_path(data_dir, split), outputs_path(data_dir, split)
        if not qpath.is_file():
            if split == "train":
                raise LampFormatError(f"{qpath.name}: missing in {data_dir} (the train split is required)")
            continue
        records, time_based = _read_questions(qpath, spec, users)
        if time_based is not None:
            layouts.setdefault(time_based, qpath)
        if len(layouts) > 1:  # a question id would be a user id in one file and could meet a real one in another
            raise LampFormatError(f"{qpath.name}: user_id: {layouts[True].name} has user_id (time-based split) and "
                                  f"{layouts[False].name} has none (user-based split); a folder holds one split")
        golds: Mapping[str, str] | None = None
        if opath.is_file():
            golds = read_outputs(opath, spec)
            _check_ids(qpath, opath, [r[0] for r in records], golds)
        elif split != "test":
            raise LampFormatError(f"{opath.name}: missing in {data_dir} (needed for the golds of {qpath.name})")
        examples[split] = [Example(qid, uid, text, spec.extract_query(text), golds[qid] if golds is not None else None,
                                   split, profile) for qid, uid, text, profile in records]
    if not examples:
        raise LampFormatError(f"{data_dir}: none of the splits {wanted} has a questions file")
    return LampDataset(spec.name, users.users(), examples, read_sharing(data_dir))


SHARING_FILE = "sharing.json"


def read_sharing(data_dir: Path) -> set[str]:
    """Users with `share: false` from `<data_dir>/sharing.json` ({"user id": false, ...}); none without the file."""
    path = Path(data_dir) / SHARING_FILE
    if not path.is_file():
        return set()
    obj = _load_json(path)
    if not isinstance(obj, dict) or not all(isinstance(v, bool) for v in obj.values()):
        raise LampFormatError(f"{path.name}: expected an object of user id → true/false (share), got {json_type_name(obj)}")
    return {str(u) for u, share in obj.items() if not share}
