"""PersonaBench reader: one community folder -> people with their session documents and scored
questions.

The document text and the ground truth follow the benchmark's own evaluation script
(`scripts/evaluation/retrieval_and_generation.py` + `eval.py` of SalesforceAIResearch/personabench),
because the reference figures (README of the data folder) are only reproducible with exactly that
serialisation: each session entry, with its `segment_id` and `session` keys removed at every depth,
dumped by `json.dumps` with `separators=(",", ":")` and ASCII escapes; documents in the order
conversations (per target, per session), user-AI interactions, purchases (the order decides ties of
the exact search).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PersonaBenchCommunity", "PersonaBenchFormatError", "PersonaQuestion",
           "load_personabench"]

SOURCES = ("conversation", "user_ai_interaction", "purchase_history")
EXCLUDED_KEYS = ("segment_id", "session")
SUBJECTIVE = "Subjective"


class PersonaBenchFormatError(ValueError):
    """Incomplete or malformed PersonaBench folder; the message names the file, the record and the
    field."""


@dataclass(frozen=True)
class PersonaDoc:
    """One retrievable document: a session entry as the benchmark serialises it, with its segment
    id."""

    segment_id: str
    source: str  # one of SOURCES
    text: str


@dataclass(frozen=True)
class PersonaQuestion:
    """A non-subjective question; `gt_alternatives[j]` lists the segment ids that each support
    answer item j."""

    q_id: str
    person: str
    question: str
    answer: str  # the answer as JSON text (answers are strings, numbers or lists of dicts)
    qtype: str
    difficulty: str
    gt_alternatives: tuple[tuple[str, ...], ...]

    @property
    def category(self) -> str:
        """The benchmark's reporting bucket: difficulty only splits Preference questions."""
        difficulty = self.difficulty if self.qtype == "Preference" else "easy"
        return "_".join(self.qtype.split(" ") + difficulty.split(" "))


@dataclass(frozen=True)
class Person:
    """Someone with private data: their own documents (the only ones they search) and their
    questions."""

    name: str
    docs: tuple[PersonaDoc, ...]
    questions: tuple[PersonaQuestion, ...]

    @property
    def texts(self) -> list[str]:
        return [d.text for d in self.docs]

    @property
    def segment_ids(self) -> list[str]:
        return [d.segment_id for d in self.docs]


@dataclass(frozen=True)
class PersonaBenchCommunity:
    """A community folder at one noise level; `skipped_subjective` counts the questions the protocol
    drops."""

    root: Path
    noise: str
    people: tuple[Person, ...]
    skipped_subjective: int

    @property
    def questions(self) -> list[PersonaQuestion]:
        return [q for p in self.people for q in p.questions]

    def person(self, name: str) -> Person:
        for p in self.people:
            if p.name == name:
                return p
        raise KeyError(name)


# ------------------------------------------------------------------------------------------ helpers

def _where(path: Path, record: str | None, field: str | None) -> str:
    out = str(path)
    if record is not None:
        out += f": record {record}"
    if field is not None:
        out += f": field {field!r}"
    return out


def _fail(
    path: Path, msg: str, record: str | None = None, field: str | None = None
) -> PersonaBenchFormatError:
    return PersonaBenchFormatError(f"{_where(path, record, field)}: {msg}")


def _load(path: Path) -> Any:
    """json.load with a missing file or bad JSON reported as PersonaBenchFormatError naming the
    file."""
    if not path.is_file():
        raise _fail(path, "missing file (an incomplete PersonaBench community folder?)")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise _fail(path, f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot read: {e}") from None


def _typename(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _get(obj: Any, key: str, path: Path, record: str, expected: type | tuple[type, ...]) -> Any:
    """obj[key] with the type checked; errors say which file, record and field."""
    if not isinstance(obj, dict):
        raise _fail(path, f"expected an object, got {_typename(obj)}", record)
    if key not in obj:
        raise _fail(path, "missing field", record, key)
    value = obj[key]
    if not isinstance(value, expected) or isinstance(value, bool):
        names = expected.__name__ if isinstance(expected, type) else " or ".join(t.__name__ for t in expected)
        raise _fail(path, f"expected {names}, got {_typename(value)}", record, key)
    return value


def _list(value: Any, path: Path, what: str) -> list:
    if not isinstance(value, list):
        raise _fail(path, f"expected a JSON list of {what}, got {_typename(value)}")
    return value


def _remove_key(obj: Any, key: str) -> Any:
    """Drop `key` from every dict at every depth (the benchmark removes ids recursively, not just at
    the top)."""
    if isinstance(obj, dict):
        return {k: _remove_key(v, key) for k, v in obj.items() if k != key}
    if isinstance(obj, list):
        return [_remove_key(v, key) for v in obj]
    return obj


def document_text(entry: dict, exclude: tuple[str, ...] = EXCLUDED_KEYS) -> str:
    """A session entry as the benchmark embeds it: compact JSON (no spaces, ASCII escapes) without
    id keys."""
    for key in exclude:
        entry = _remove_key(entry, key)
    return json.dumps(entry, separators=(",", ":"))


def _segment_id(entry: Any, path: Path, record: str) -> str:
    value = _get(entry, "segment_id", path, record, (str, int))
    return str(value)


def _by_name(rows: list, path: Path) -> dict[str, list]:
    """`[{"Name", "Data": [...]}]` -> name -> Data list, with duplicates and bad rows reported."""
    out: dict[str, list] = {}
    for i, row in enumerate(rows):
        record = f"{i}"
        name = _get(row, "Name", path, record, str)
        data = _get(row, "Data", path, f"{i} (Name {name!r})", list)
        if name in out:
            raise _fail(path, f"person {name!r} appears twice", f"{i} (Name {name!r})", "Name")
        out[name] = data
    return out


def _conversation_docs(data: list, path: Path, name: str) -> Iterator[PersonaDoc]:
    for i, group in enumerate(data):
        record = f"{name!r} Data[{i}]"
        conversations = _get(group, "Conversations", path, record, list)
        for j, entry in enumerate(conversations):
            rec = f"{record}.Conversations[{j}]"
            sid = _segment_id(entry, path, rec)
            _get(entry, "conversation", path, rec, list)
            yield PersonaDoc(sid, "conversation", document_text(entry))


def _flat_docs(data: list, path: Path, name: str, source: str) -> Iterator[PersonaDoc]:
    for i, entry in enumerate(data):
        rec = f"{name!r} Data[{i}]"
        sid = _segment_id(entry, path, rec)
        _get(entry, source, path, rec, list)
        yield PersonaDoc(sid, source, document_text(entry))


def _alternatives(value: Any, path: Path, record: str) -> tuple[tuple[str, ...], ...]:
    """`{answer_item: [segment ids]}` -> one tuple of alternatives per answer item (insertion order
    kept)."""
    if not isinstance(value, dict) or not value:
        raise _fail(path, f"expected a non-empty object {{answer item: [segment ids]}}, got {_typename(value)}",
                    record, "segment_id")
    out = []
    for item, ids in value.items():
        if not isinstance(ids, list) or not ids or not all(isinstance(s, (str, int)) for s in ids):
            raise _fail(path, f"answer item {item!r}: expected a non-empty list of segment ids", record,
                        "segment_id")
        out.append(tuple(str(s) for s in ids))
    return tuple(out)


# ------------------------------------------------------------------------------------------ loading

def _ground_truth(gt_rows: list, gt_path: Path) -> dict[str, tuple[tuple[str, ...], ...]]:
    """q_id → its alternatives of ground-truth segment ids; a duplicate q_id is an error."""
    gt: dict[str, tuple[tuple[str, ...], ...]] = {}
    for i, row in enumerate(gt_rows):
        q_id = str(_get(row, "q_id", gt_path, str(i), (str, int)))
        if q_id in gt:
            raise _fail(gt_path, "duplicate q_id", f"{i} (q_id {q_id!r})", "q_id")
        gt[q_id] = _alternatives(row.get("segment_id"), gt_path, f"{i} (q_id {q_id!r})")
    return gt


def _questions(row: dict, where: str, name: str, own_ids: set[str], gt: dict, eval_path: Path, gt_path: Path,
               check_ground_truth: bool) -> tuple[list[PersonaQuestion], int]:
    """A person's objective questions (with their ground truth) and how many subjective ones were
    skipped."""
    info = _get(row, "Eval_Info", eval_path, where, dict)
    qa = _get(info, "qa", eval_path, f"{where}.Eval_Info", list)
    questions: list[PersonaQuestion] = []
    skipped = 0
    for j, q in enumerate(qa):
        rec = f"{where}.Eval_Info.qa[{j}]"
        q_id = str(_get(q, "q_id", eval_path, rec, (str, int)))
        rec = f"{rec} (q_id {q_id!r})"
        qtype = _get(q, "type", eval_path, rec, str)
        text = _get(q, "question", eval_path, rec, str)
        if qtype == SUBJECTIVE:
            skipped += 1
            continue
        difficulty = _get(q, "difficulty", eval_path, rec, str)
        if q_id not in gt:
            raise _fail(gt_path, f"no ground truth for question q_id {q_id!r} of {name!r}", f"q_id {q_id!r}",
                        "segment_id")
        alternatives = gt[q_id]
        if check_ground_truth:
            missing = sorted({s for alt in alternatives for s in alt} - own_ids)
            if missing:
                raise _fail(gt_path, f"segment ids {missing[:5]} are not documents of {name!r}",
                            f"q_id {q_id!r}", "segment_id")
        questions.append(PersonaQuestion(q_id, name, text, json.dumps(q.get("answer")), qtype, difficulty,
                                         alternatives))
    return questions, skipped


def _person_docs(name: str, data: dict[str, dict[str, list]], paths: dict[str, Path]) -> list[PersonaDoc]:
    """A person's documents from every private source: conversations, then interactions with an AI,
    then purchases; a person missing from one of the files while in another is an error."""
    for source, p in paths.items():
        if name not in data[source]:
            raise _fail(p, f"person {name!r} has private data in other files but none here", None, "Name")
    return (list(_conversation_docs(data["conversation"][name], paths["conversation"], name))
            + list(_flat_docs(data["user_ai_interaction"][name], paths["user_ai_interaction"], name,
                              "user_ai_interaction"))
            + list(_flat_docs(data["purchase_history"][name], paths["purchase_history"], name,
                              "purchase_history")))


def load_personabench(data_dir: str | Path, noise: str = "0.0", check_ground_truth: bool = True
                      ) -> PersonaBenchCommunity:
    """Read a community folder (layout in the data README); people are those with private data, in
    the order of `eval_info_all.json`, as the benchmark evaluates them. Subjective questions are
    skipped (and counted).

    With `check_ground_truth`, a ground-truth segment id that is not one of the person's documents
    is an error: the question could never be answered, and a silent zero would only lower the score.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise PersonaBenchFormatError(
            f"{root}: not a folder (expected a PersonaBench community folder)"
        )
    eval_path = root / "eval_info" / "eval_info_all.json"
    gt_path = root / "eval_info" / f"qa_gt_context_all_noise_{noise}.json"
    private = root / "private_data" / f"noise_{noise}"
    paths = {source: private / f"{source}_data_all.json" for source in SOURCES}

    eval_rows = _list(_load(eval_path), eval_path, "people")
    gt_rows = _list(_load(gt_path), gt_path, "questions")
    data = {source: _by_name(_list(_load(p), p, "people"), p) for source, p in paths.items()}

    gt = _ground_truth(gt_rows, gt_path)

    names_with_data = (
        set(data["conversation"]) | set(data["user_ai_interaction"]) | set(data["purchase_history"])
    )
    people: list[Person] = []
    skipped = 0
    seen: set[str] = set()
    for i, row in enumerate(eval_rows):
        name = _get(row, "Name", eval_path, str(i), str)
        if name not in names_with_data:
            # people without private data have no documents to search (the benchmark skips them too)
            continue
        if name in seen:
            raise _fail(eval_path, f"person {name!r} appears twice", f"{i} (Name {name!r})", "Name")
        seen.add(name)
        docs = _person_docs(name, data, paths)
        own_ids = {d.segment_id for d in docs}
        questions, subjective = _questions(
            row, f"{i} (Name {name!r})", name, own_ids, gt, eval_path, gt_path, check_ground_truth
        )
        skipped += subjective
        people.append(Person(name, tuple(docs), tuple(questions)))
    if not people:
        raise _fail(eval_path, "no person listed here has private data under " + str(private))
    return PersonaBenchCommunity(root, noise, tuple(people), skipped)
