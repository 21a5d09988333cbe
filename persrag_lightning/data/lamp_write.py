"""The writer of the LaMP format (its reader is lamp.py): questions and outputs files streamed record by
record and written atomically, byte for byte what json.dumps would write."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING

from persrag_lightning.data.errors import LampFormatError
from persrag_lightning.data.lamp_format import (
    format_date,
    json_type_name,
    outputs_path,
    questions_path,
    task_code,
    task_spec,
)
from persrag_lightning.data.records import Example, HistoryDoc, LampDataset, User
from persrag_lightning.data.tasks import TaskSpec
from persrag_lightning.utils import atomic_open

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["OutputsWriter", "QuestionsWriter", "profile_item_json", "write_lamp", "write_outputs", "write_predictions",
           "write_questions"]

_json_str = json.encoder.encode_basestring  # json.dumps(s, ensure_ascii=False) of a str, without the dumps machinery


def profile_item_json(doc_id: str, date: str, fields: Mapping[str, str]) -> str:
    """One profile item as JSON text: id, date, then the task fields (json.dumps's bytes, built from strings)."""
    if type(doc_id) is str and type(date) is str and "id" not in fields and "date" not in fields and all(
            type(v) is str for v in fields.values()):
        return ('{"id": ' + _json_str(doc_id) + ', "date": ' + _json_str(date)
                + "".join(", " + _json_str(k) + ": " + _json_str(v) for k, v in fields.items()) + "}")
    return json.dumps({"id": doc_id, "date": date, **fields}, ensure_ascii=False)


def _profile_json(docs: Iterable[HistoryDoc], spec: TaskSpec) -> str:
    """A whole profile list as JSON text, computed once per user and reused by all their questions."""
    items = [profile_item_json(d.doc_id, format_date(d.date), {f: d.fields[f] for f in spec.profile_fields
                                                                if f in d.fields}) for d in docs]
    return "[" + ", ".join(items) + "]"


class QuestionsWriter:
    """Streams question records into a questions file; it appears (atomically) only when the block succeeds."""

    def __init__(self, path: str | Path, task: str | TaskSpec) -> None:
        self.path = Path(path)
        self.spec = task_spec(task)
        self._cm = atomic_open(self.path)
        self._f: IO[str] | None = None
        self._count = 0
        self._cache: tuple[User, str] | None = None  # the last user and their profile JSON

    def __enter__(self) -> Self:
        self._f = self._cm.__enter__()
        self._f.write("[")
        return self

    def __exit__(self, *exc: object) -> bool | None:
        if exc[0] is None:
            assert self._f is not None
            self._f.write("\n]\n" if self._count else "]\n")
        return self._cm.__exit__(*exc)

    def write_record(self, example_id: str, input: str, user_id: str, profile: str) -> None:
        """Append one record whose profile is already JSON text (see _profile_json)."""
        assert self._f is not None, "use QuestionsWriter as a context manager"
        self._f.write(("\n" if self._count == 0 else ",\n") + '{"id": ' + _json_str(example_id) + ', "input": '
                      + _json_str(input) + ', "user_id": ' + _json_str(user_id) + ', "profile": ' + profile + "}")
        self._count += 1

    def write(self, example: Example, user: User) -> None:
        """Append an example; its profile is the user's full history (every doc dates before the question)."""
        if not user.docs:
            raise LampFormatError(f"{self.path.name}: record {self._count} (id {example.example_id!r}): profile: "
                                  f"user {user.user_id!r} has no history docs")
        if self._cache is None or self._cache[0] is not user:
            self._cache = (user, _profile_json(user.docs, self.spec))
        self.write_record(example.example_id, example.input, user.user_id, self._cache[1])


class OutputsWriter:
    """Streams {"task", "golds"} records; atomic like QuestionsWriter. Used for golds and predictions alike."""

    def __init__(self, path: str | Path, task: str | TaskSpec) -> None:
        self.path = Path(path)
        self.code = task_code(task)
        self._cm = atomic_open(self.path)
        self._f: IO[str] | None = None
        self._count = 0

    def __enter__(self) -> Self:
        self._f = self._cm.__enter__()
        self._f.write('{"task": ' + json.dumps(self.code) + ', "golds": [')
        return self

    def __exit__(self, *exc: object) -> bool | None:
        if exc[0] is None:
            assert self._f is not None
            self._f.write("\n]}\n" if self._count else "]}\n")
        return self._cm.__exit__(*exc)

    def write(self, example_id: str, output: str) -> None:
        """Append one {"id", "output"}; non-string ids or outputs are refused rather than coerced silently."""
        assert self._f is not None, "use OutputsWriter as a context manager"
        if not isinstance(example_id, str) or not isinstance(output, str):
            raise LampFormatError(f"{self.path.name}: record {self._count} (id {example_id!r}): output: expected "
                                  f"string id and output, got {json_type_name(example_id)} and {json_type_name(output)}")
        self._f.write(("\n" if self._count == 0 else ",\n") + '{"id": ' + _json_str(example_id) + ', "output": '
                      + _json_str(output) + "}")
        self._count += 1


def write_outputs(path: str | Path, task: str | TaskSpec,
                  golds: Mapping[str, str] | Iterable[tuple[str, str]]) -> Path:
    """Write an outputs file ({id: output} or (id, output) pairs, in the given order) atomically."""
    pairs = golds.items() if isinstance(golds, Mapping) else golds
    with OutputsWriter(path, task) as w:
        for example_id, output in pairs:
            w.write(example_id, output)
    return Path(path)


def write_predictions(path: str | Path, task: str | TaskSpec, predictions: Mapping[str, str]) -> Path:
    """Predictions use the outputs shape, so the official evaluator and read_outputs read them as-is."""
    return write_outputs(path, task, predictions)


def write_questions(path: str | Path, task: str | TaskSpec, examples: Iterable[Example],
                    users: Mapping[str, User]) -> Path:
    """Write a questions file atomically; each record's profile is its user's full history."""
    with QuestionsWriter(path, task) as w:
        for ex in examples:
            user = users.get(ex.user_id)
            if user is None:
                raise LampFormatError(f"{Path(path).name}: record {w._count} (id {ex.example_id!r}): user_id: "
                                      f"unknown user {ex.user_id!r}")
            w.write(ex, user)
    return Path(path)


def write_lamp(data_dir: str | Path, dataset: LampDataset) -> Path:
    """Write every split of a LampDataset (questions, and outputs where targets are known) into `data_dir`."""
    for split, examples in dataset.examples.items():
        write_questions(questions_path(data_dir, split), dataset.task, examples, dataset.users)
        if all(ex.target is not None for ex in examples):
            write_outputs(outputs_path(data_dir, split), dataset.task,
                          [(ex.example_id, ex.target) for ex in examples])  # type: ignore[misc]
    return Path(data_dir)
