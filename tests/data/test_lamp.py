"""LaMP reader/writer: round trips, user aggregation over splits, and errors that name file, record and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from persrag_lightning.data.lamp import (
    LampFormatError,
    format_date,
    load_lamp,
    parse_date,
    read_outputs,
    write_lamp,
    write_outputs,
    write_predictions,
)
from persrag_lightning.data.synth import SynthConfig, generate_synth_lamp
from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.utils import (
    atomic_open,
    atomic_write_json,
    atomic_write_text,
    file_digest,
    fingerprint,
)

PROMPT = "Which tag does this movie relate to? description: "


def item(doc_id: str, date: str, description: str = "a film", tag: str = "comedy") -> dict:
    return {"id": doc_id, "date": date, "description": description, "tag": tag}


def question(qid: str, user: str, profile: list[dict], text: str = "a new film") -> dict:
    return {"id": qid, "input": PROMPT + text, "user_id": user, "profile": profile}


def dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj), encoding="utf-8")


def write_split(root: Path, split: str, questions: list, golds: dict[str, str] | None = None,
                task: str = "LaMP_2") -> None:
    dump(root / f"{split}_questions.json", questions)
    if golds is None:
        golds = {q["id"]: "comedy" for q in questions if isinstance(q, dict) and "id" in q}
    dump(root / f"{split}_outputs.json", {"task": task, "golds": [{"id": k, "output": v} for k, v in golds.items()]})


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """Two users; u1's dev profile extends (and reorders) the train profile with a newer item."""
    p1 = [item("a", "2012-03-22", "old film"), item("b", "2011-01-02", "older film", "sci-fi")]
    write_split(tmp_path, "train", [question("1", "u1", p1, "space film"),
                                    question("2", "u2", [item("a", "2015-05-05", "u2's own doc a")])])
    p1_dev = [item("b", "2011-01-02", "older film", "sci-fi"), item("c", "2013-07-01", "newest film", "action"),
              item("a", "2012-03-22", "old film")]
    write_split(tmp_path, "dev", [question("3", "u1", p1_dev, "dev film")], {"3": "action"})
    return tmp_path


# -------------------------------------------------------------------------------------------------- reading

def test_synth_round_trip_counts_users_sorted_queries(tmp_path: Path) -> None:
    config = SynthConfig(num_users=12, docs_per_user=(4, 9), seed=3)
    generate_synth_lamp(tmp_path, config)
    ds = load_lamp(tmp_path, "LaMP_2")
    assert ds.task == "LaMP-2"
    assert len(ds.users) == 12 and ds.user_ids()[0] == "u000000"
    assert {s: len(v) for s, v in ds.examples.items()} == {"train": 24, "dev": 12, "test": 12}
    for user in ds.users.values():
        assert 4 <= len(user.docs) <= 9
        assert [d.date for d in user.docs] == sorted(d.date for d in user.docs)
        assert set(user.docs[0].fields) == {"description", "tag"}
    for ex in ds.examples["dev"]:
        assert ex.query and "description:" not in ex.query and ex.input.endswith(ex.query)
        assert ex.target in LAMP2_LABELS and ex.split == "dev" and ex.user_id in ds.users

    # write_lamp -> load_lamp is the identity on the typed records.
    again = load_lamp(write_lamp(tmp_path / "copy", ds), "LaMP-2")
    assert again.users == ds.users and again.examples == ds.examples


def test_users_aggregated_over_splits_and_sorted(tiny: Path) -> None:
    ds = load_lamp(tiny, "LaMP-2")
    u1 = ds.users["u1"]
    assert [d.doc_id for d in u1.docs] == ["b", "a", "c"]  # union of train and dev profiles, oldest first
    assert u1.docs[0].date == (2011, 1, 2) and u1.docs[2].fields == {"description": "newest film", "tag": "action"}
    assert [d.doc_id for d in ds.users["u2"].docs] == ["a"]  # doc ids are per user
    assert [(e.example_id, e.query, e.target) for e in ds.examples["train"]] == [
        ("1", "space film", "comedy"), ("2", "a new film", "comedy")]
    assert ds.examples["dev"][0].target == "action"
    assert "test" not in ds.examples
    assert set(load_lamp(tiny, "2", splits=("train",)).examples) == {"train"}


def test_ties_keep_first_seen_order_and_int_ids(tmp_path: Path) -> None:
    profile = [item("z", "2020-01-01"), item("y", "2020-01-01"), {**item("x", "2019-12-31"), "id": 7}]
    write_split(tmp_path, "train", [{**question("1", "u", profile), "id": 1, "user_id": 42}], {"1": "comedy"})
    ds = load_lamp(tmp_path, "LaMP-2")
    assert [d.doc_id for d in ds.users["42"].docs] == ["7", "z", "y"]
    assert ds.examples["train"][0].example_id == "1"


def test_test_split_without_outputs_has_no_targets(tiny: Path) -> None:
    dump(tiny / "test_questions.json", [question("9", "u2", [item("a", "2015-05-05", "u2's own doc a")])])
    ds = load_lamp(tiny, "LaMP-2")
    assert [(e.example_id, e.target) for e in ds.examples["test"]] == [("9", None)]


def test_dates_parse_and_format() -> None:
    assert parse_date("2016-03-27") == (2016, 3, 27) and parse_date("2012") == (2012,)
    assert format_date((2016, 3, 7)) == "2016-03-07" and parse_date(format_date((5, 1, 2))) == (5, 1, 2)
    for bad in ("2012/03/22", "2012-03-", "", " 2012-03-22", "2012-x-01"):
        with pytest.raises(ValueError):
            parse_date(bad)


# --------------------------------------------------------------------------------------------------- errors

def expect_error(root: Path, *parts: str, task: str = "LaMP-2") -> str:
    with pytest.raises(LampFormatError) as info:
        load_lamp(root, task)
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


GOOD = [item("a", "2012-03-22")]


@pytest.mark.parametrize("field", ["id", "input", "user_id", "profile"])
def test_missing_question_field(tmp_path: Path, field: str) -> None:
    q = question("5", "u1", GOOD)
    del q[field]
    write_split(tmp_path, "train", [question("4", "u1", GOOD), q], {"4": "comedy", "5": "comedy"})
    record = "record 1" if field == "id" else "record 1 (id '5')"
    # without user_id, record 1 reads as LaMP's user-based split inside a time-based file (tests/data/test_convert.py)
    missing = "missing here but present in record 0" if field == "user_id" else "missing field"
    expect_error(tmp_path, "train_questions.json", record, f"{field}: {missing}")


@pytest.mark.parametrize("field", ["id", "date", "description", "tag"])
def test_missing_profile_field(tmp_path: Path, field: str) -> None:
    bad = item("b", "2012-03-23")
    del bad[field]
    write_split(tmp_path, "train", [question("7", "u1", [*GOOD, bad])])
    expect_error(tmp_path, "train_questions.json: record 0 (id '7'): profile[1].", f"{field}: missing field")


def test_bad_date_names_file_record_field(tmp_path: Path) -> None:
    write_split(tmp_path, "train", [question("1", "u1", GOOD)])
    write_split(tmp_path, "dev", [question("2", "u2", GOOD), question("310", "u3", [*GOOD, *GOOD, *GOOD,
                                                                                    item("q", "2012/03/22")])])
    msg = expect_error(tmp_path)
    assert msg == ("dev_questions.json: record 1 (id '310'): profile[3].date: expected '-'-separated integers, "
                   "got '2012/03/22'")


def test_malformed_json_reports_line_and_column(tmp_path: Path) -> None:
    (tmp_path / "train_questions.json").write_text('[\n  {"id": "1",\n  "input" "x"}\n]')
    expect_error(tmp_path, "train_questions.json", "malformed JSON at line 3 column")


def test_top_level_not_a_list(tmp_path: Path) -> None:
    dump(tmp_path / "train_questions.json", {"id": "1"})
    expect_error(tmp_path, "train_questions.json", "top level", "expected a JSON list")


def test_unknown_task(tiny: Path) -> None:
    expect_error(tiny, "task", "unknown task 'LaMP-9'", "known tasks", task="LaMP-9")


def test_empty_profile(tmp_path: Path) -> None:
    write_split(tmp_path, "train", [question("1", "u1", GOOD), question("2", "u1", [])])
    expect_error(tmp_path, "train_questions.json: record 1 (id '2'): profile: empty profile")


def test_question_and_gold_ids_must_match(tmp_path: Path) -> None:
    write_split(tmp_path, "train", [question(str(i), "u1", GOOD) for i in range(4)],
                {"0": "comedy", "1": "comedy", "9": "comedy"})
    expect_error(tmp_path, "train_outputs.json: golds:", "2 question id(s) of train_questions.json have no gold: "
                 "'2', '3'", "1 gold id(s) match no question", "'9'")


def test_outputs_task_must_match(tmp_path: Path) -> None:
    write_split(tmp_path, "train", [question("1", "u1", GOOD)], task="LaMP_3")
    expect_error(tmp_path, "train_outputs.json: task: file is for 'LaMP_3', expected 'LaMP_2'")


def test_duplicate_question_ids(tmp_path: Path) -> None:
    write_split(tmp_path, "train", [question("1", "u1", GOOD), question("2", "u1", GOOD), question("1", "u2", GOOD)])
    expect_error(tmp_path, "train_questions.json: record 2 (id '1'): id: duplicate question id (first at record 0)")


@pytest.mark.parametrize("bad_id", [1.5, None, ["1"], True])
def test_ids_must_be_str_or_int(tmp_path: Path, bad_id: object) -> None:
    write_split(tmp_path, "train", [question("1", "u1", [{**GOOD[0], "id": bad_id}])], {"1": "comedy"})
    expect_error(tmp_path, "train_questions.json: record 0 (id '1'): profile[0].id: expected a string or integer id")


def test_conflicting_doc_copies_name_user_doc_and_both_files(tiny: Path) -> None:
    p1_dev = [item("a", "2012-03-22", "old film", "romance")]
    write_split(tiny, "dev", [question("3", "u1", p1_dev)])
    expect_error(tiny, "dev_questions.json: record 0 (id '3'): profile[0]", "user 'u1' doc 'a'",
                 "train_questions.json: record 0 (id '1'): profile[0]", "tag: 'comedy' there, 'romance' here")


def test_missing_train_or_dev_outputs(tiny: Path) -> None:
    (tiny / "dev_outputs.json").unlink()
    expect_error(tiny, "dev_outputs.json: missing")
    (tiny / "train_questions.json").unlink()
    expect_error(tiny, "train_questions.json: missing", "train split is required")


# --------------------------------------------------------------------------------------------------- writing

def test_write_predictions_round_trip(tmp_path: Path) -> None:
    preds = {"1": "sci-fi", "2": "true story", "3": "ünïcode \"quoted\""}
    path = write_predictions(tmp_path / "out" / "preds.json", "LaMP-2", preds)
    assert json.loads(path.read_text())["task"] == "LaMP_2"
    assert read_outputs(path, "LaMP_2") == preds
    assert read_outputs(write_outputs(tmp_path / "empty.json", "LaMP-5", {}), "LaMP-5") == {}
    with pytest.raises(LampFormatError, match="task: file is for 'LaMP_2', expected 'LaMP_5'"):
        read_outputs(path, "LaMP-5")
    with pytest.raises(LampFormatError, match="preds.json: record 1 .id '2'.: output"):
        write_predictions(tmp_path / "out" / "preds.json", "LaMP-2", {"1": "a", "2": 3})  # type: ignore[dict-item]
    assert read_outputs(path, "LaMP_2") == preds  # the failed write left the old file as it was
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["preds.json"]


# ---------------------------------------------------------------------------------------------------- utils

def test_atomic_write_leaves_no_partial_file(tmp_path: Path) -> None:
    path = atomic_write_json(tmp_path / "a.json", {"x": 1})
    before = path.read_bytes()
    with pytest.raises(TypeError):
        atomic_write_json(path, {"x": object()})
    with pytest.raises(RuntimeError), atomic_open(path) as f:
        f.write('{"half": ')
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_fingerprint_and_file_digest(tmp_path: Path) -> None:
    assert fingerprint({"b": 1, "a": [1, 2]}, "x") == fingerprint({"a": [1, 2], "b": 1}, "x")
    assert fingerprint((1, 2)) == fingerprint([1, 2]) != fingerprint([2, 1])
    assert len(fingerprint(Path("p"), SynthConfig())) == 16
    path = atomic_write_text(tmp_path / "f.txt", "hello")
    assert file_digest(path, chunk_size=2) == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
