"""`persrag data convert`: a log (CSV, JSON Lines, JSON, Parquet) → a LaMP folder in CFRAG's time-based layout, and
LaMP's own user-based questions files."""

from __future__ import annotations

import csv
import json
import logging
import random
from datetime import datetime, timezone
from pathlib import Path

import pytest

from persrag_lightning.cli import main
from persrag_lightning.data.convert import ConvertOptions, LogFormatError, convert_log
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.histories import visible_histories
from persrag_lightning.data.lamp import LampFormatError, format_date, load_lamp, parse_date, questions_path
from persrag_lightning.data.log_rows import parse_timestamp
from persrag_lightning.data.synth import SynthConfig, generate_synth_lamp

COLUMNS = ["reviewer", "time", "review", "stars", "asin"]
OPTIONS = ConvertOptions(task="LaMP-3", user="reviewer", date="time", text="review", label="stars", item="asin")
LAMP_FILES = [f"{s}_{k}.json" for s in ("train", "dev", "test") for k in ("questions", "outputs")]


def review_log(root: Path, num_users: int = 24, seed: int = 1) -> list[dict]:
    """A review log made from SynthLaMP LaMP-3 users: one row per history item (its text, score and date)."""
    folder = generate_synth_lamp(root / "synth", SynthConfig(task="LaMP-3", num_users=num_users, seed=seed))
    dataset = load_lamp(folder, "LaMP-3")
    return [{"reviewer": u.user_id, "time": format_date(d.date), "review": d.fields["text"],
             "stars": d.fields["score"], "asin": "B" + d.doc_id.split("-")[1]}
            for u in dataset.users.values() for d in u.docs]


def write_log(path: Path, rows: list[dict]) -> Path:
    """The rows in the format of `path`'s extension."""
    if path.suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        from pyarrow import parquet

        parquet.write_table(pa.Table.from_pylist(rows), path)
    return path


def lamp_bytes(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in LAMP_FILES}


def convert(tmp_path: Path, rows: list[dict], name: str = "log.csv", **options) -> tuple[Path, object]:
    out = tmp_path / f"lamp-{name}"
    options = ConvertOptions(**{**OPTIONS.__dict__, **options})
    return out, convert_log(write_log(tmp_path / name, rows), out, options)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    return review_log(tmp_path_factory.mktemp("log"))


def test_every_format_gives_the_same_folder_and_the_same_log_the_same_bytes(tmp_path, rows):
    """CSV (all text), JSON Lines (ints, Unix seconds), a JSON list and Parquet: byte-identical LaMP files; shuffled
    rows too (no two items of a user share a time), and converting again changes no byte."""
    typed = [{**r, "stars": int(r["stars"]),
              "time": int(datetime(*parse_date(r["time"]), tzinfo=timezone.utc).timestamp())} for r in rows]
    shuffled = random.Random(0).sample(rows, len(rows))
    folders = [convert(tmp_path, rows, "log.csv")[0], convert(tmp_path, typed, "log.jsonl")[0],
               convert(tmp_path, shuffled, "log.json")[0], convert(tmp_path, typed, "log.parquet")[0]]
    first = lamp_bytes(folders[0])
    assert all(lamp_bytes(f) == first for f in folders[1:])
    again = tmp_path / "again"
    convert_log(tmp_path / "log.csv", again, OPTIONS)
    assert lamp_bytes(again) == first
    assert (again / "convert.json").read_bytes() == (folders[0] / "convert.json").read_bytes()


def test_the_latest_item_is_test_the_one_before_dev_and_profiles_hold_only_older_items(tmp_path, rows):
    out, conversion = convert(tmp_path, rows)
    dataset = load_lamp(out, "LaMP-3")
    by_user: dict[str, list[dict]] = {}
    for r in rows:
        by_user.setdefault(r["reviewer"], []).append(r)
    assert conversion.questions == {"train": 2 * len(by_user), "dev": len(by_user), "test": len(by_user)}
    questions = {s: {q["id"]: q for q in json.loads(questions_path(out, s).read_text())} for s in dataset.examples}
    for user, items in by_user.items():
        items.sort(key=lambda r: r["time"])
        ids = [f"{user}-{r['asin']}" for r in items]
        split_of = {e.example_id: e.split for s in dataset.examples.values() for e in s if e.user_id == user}
        assert split_of == {ids[-1]: "test", ids[-2]: "dev", ids[-3]: "train", ids[-4]: "train"}
        for qid, split in split_of.items():
            position = ids.index(qid)
            profile = questions[split][qid]["profile"]
            assert [p["id"] for p in profile] == ids[:position]  # strictly older, oldest first, never itself
            assert questions[split][qid]["input"].endswith("review: " + items[position]["review"])
    golds = {e.example_id: e.target for e in dataset.examples["test"]}
    assert golds == {f"{u}-{max(items, key=lambda r: r['time'])['asin']}": max(items, key=lambda r: r["time"])["stars"]
                     for u, items in by_user.items()}
    histories = visible_histories(dataset, Corpus.from_dataset(dataset))
    test_items = set(golds)
    pooled = {Corpus.from_dataset(dataset).doc_ids[r] for rows_ in histories.pool.values() for r in rows_}
    assert not pooled & test_items and not pooled & {e.example_id for e in dataset.examples["dev"]}


def test_users_with_too_few_items_are_dropped_and_counted_and_caps_draw_seeded_users(tmp_path, rows):
    few = [r for r in rows if r["reviewer"] != "u000003"] + [
        {"reviewer": "newcomer", "time": f"2020-01-0{d}", "review": f"day {d} was fine", "stars": "4",
         "asin": f"N{d}"} for d in range(1, 5)]
    out, conversion = convert(tmp_path, few, max_test_users=5, max_dev_users=3)
    assert (conversion.dropped_users, conversion.dropped_rows) == (1, 4)
    assert conversion.questions == {"train": 2 * 23, "dev": 3, "test": 5}
    tested = {e.user_id for e in load_lamp(out, "LaMP-3").examples["test"]}
    again, _ = convert(tmp_path, few, "again.csv", max_test_users=5, max_dev_users=3)
    assert tested == {e.user_id for e in load_lamp(again, "LaMP-3").examples["test"]}  # the seed decides
    other, _ = convert(tmp_path, few, "other.csv", max_test_users=5, max_dev_users=3, seed=1)
    assert tested != {e.user_id for e in load_lamp(other, "LaMP-3").examples["test"]}
    assert {e.user_id for e in load_lamp(out, "LaMP-3").examples["dev"]} <= tested  # one seeded order for both


def test_the_summary_states_the_distribution_and_the_majority_baseline_on_test(tmp_path):
    """Two users, six reviews each: train's majority is "5"; the test golds are "5" and "1"."""
    rows = [{"reviewer": u, "time": f"2021-03-0{d}", "review": f"{u} review {d}", "stars": s, "asin": f"{u}{d}"}
            for u, stars in (("a", "555555"), ("b", "214551")) for d, s in zip(range(1, 7), stars)]
    _, conversion = convert(tmp_path, rows)
    assert conversion.baseline == {"label": "5", "test": {"accuracy": 0.5, "mae": 2.0, "rmse": pytest.approx(8 ** .5)}}
    assert conversion.items_per_user["p50"] == 6 and conversion.labels == {"5": 8, "2": 1, "1": 2, "4": 1}
    assert "test, majority label of train ('5'), no reader: accuracy 0.500, mae 2.000" in conversion.summary()


def test_dates_as_iso_date_times_or_unix_seconds_keep_the_time_of_day():
    assert parse_timestamp("2016-03-27") == parse_timestamp(1459036800) == parse_timestamp("1459036800")
    assert parse_timestamp("2016-03-27T10:05:00Z") == parse_timestamp("2016-03-27 12:05:00+02:00") == 1459073100
    assert parse_timestamp(1459073100.9) == 1459073100
    with pytest.raises(ValueError, match="cannot read 'yesterday'"):
        parse_timestamp("yesterday")


def test_a_log_with_times_of_day_writes_them_into_lamp_dates(tmp_path):
    rows = [{"reviewer": "a", "time": f"2021-03-01T0{h}:30:00", "review": f"hour {h}", "stars": "3", "asin": str(h)}
            for h in range(5)]
    out, _ = convert(tmp_path, rows)
    test = json.loads(questions_path(out, "test").read_text())[0]
    assert [p["date"] for p in test["profile"]][:2] == ["2021-03-01-00-30-00", "2021-03-01-01-30-00"]
    assert load_lamp(out, "LaMP-3").examples["test"][0].example_id == "a-4"


BAD = [  # (edit of the rows, option overrides, what the one line must say)
    (lambda rows: [{k: v for k, v in r.items() if k != "stars"} for r in rows], {}, "log.csv: no column 'stars'"),
    (lambda rows: [*rows[:7], {**rows[7], "time": "last tuesday"}, *rows[8:]], {"strict": True},
     "log.csv: row 8: column 'time' (--date): cannot read 'last tuesday'"),
    (lambda rows: [*rows[:2], {**rows[2], "stars": "6"}, *rows[3:]], {"strict": True},
     "log.csv: row 3: column 'stars' (--label): '6' is not a LaMP-3 label"),
    (lambda rows: [*rows[:4], {**rows[4], "review": "  "}, *rows[5:]], {"strict": True},
     "log.csv: row 5: column 'review' (--text): empty text"),
    (lambda rows: [*rows[:9], {**rows[9], "asin": rows[3]["asin"]}, *rows[10:]], {"strict": True},
     "log.csv: row 10: column 'asin' (--item): user 'u000000' already has item"),
    (lambda rows: [*rows[:6], {**rows[6], "review": ""}, *rows[7:11], {**rows[11], "time": "?"}, *rows[12:]],
     {"strict": True}, "log.csv: row 7: column 'review' (--text): empty text"),  # the first bad row of the file
    (lambda rows: [{**r, "stars": "ten"} if i % 3 else r for i, r in enumerate(rows)], {},
     "log.csv: 623 of 935 rows would be skipped (label outside the task's set 623 (rows 2, 3, 5, 6, 8, …))"),
    (lambda rows: rows, {"min_items": 4}, "--min_items: 4 is too few for --train_per_user 2"),
    (lambda rows: rows, {"template": "Rate this: {text}"}, "--template: LaMP-3 reads the query after 'review:'"),
]


@pytest.mark.parametrize("edit, overrides, message", BAD, ids=["column", "date", "label", "text", "duplicate",
                                                                "first_row", "most_rows", "min_items", "template"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, rows, capsys, edit, overrides, message):
    """`--strict` refuses the first bad row; without it, only a log that would lose most of its rows is refused."""
    log = write_log(tmp_path / "log.csv", edit(rows))
    out = tmp_path / "out"
    flags = [f"--{k}" if v is True else f"--{k}={v}" for k, v in overrides.items()]
    with pytest.raises(SystemExit) as exit_:
        main(["data", "convert", str(log), "--task", "LaMP-3", "--user", "reviewer", "--date", "time", "--text",
              "review", "--label", "stars", "--item", "asin", "--out", str(out), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_bad_rows_are_skipped_counted_by_reason_with_their_first_rows(tmp_path, rows, capsys):
    """The same bad rows as the --strict refusals: each skipped, counted under its reason in the summary and in
    convert.json; the rest converts as if those rows were not in the log."""
    bad = {7: {"time": "last tuesday"}, 2: {"stars": "6"}, 4: {"review": "  "}, 9: {"asin": rows[3]["asin"]},
           11: {"review": None}, 12: {"reviewer": ""}}
    edited = [{**r, **bad.get(i, {})} for i, r in enumerate(rows)]
    log = write_log(tmp_path / "log.jsonl", edited)
    main(["data", "convert", str(log), "--task", "LaMP-3", "--user", "reviewer", "--date", "time", "--text",
          "review", "--label", "stars", "--item", "asin", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert (f"skipped 6 of {len(rows)} rows: missing text 2 (rows 5, 12); label outside the task's set 1 (row 3); "
            "unreadable date 1 (row 8); repeated item 1 (row 10); missing user 1 (row 13)") in printed  # most first
    manifest = json.loads((tmp_path / "out" / "convert.json").read_text())
    assert manifest["conversion"]["skipped"]["missing text"] == {"rows": 2, "first_rows": [5, 12]}
    assert manifest["conversion"]["skipped_rows"] == 6
    clean, _ = convert(tmp_path, [r for i, r in enumerate(rows) if i not in bad], "clean.jsonl")
    assert lamp_bytes(tmp_path / "out") == lamp_bytes(clean)


def test_a_folder_is_replaced_only_when_asked_and_tasks_without_a_log_shape_are_refused(tmp_path, rows):
    out, _ = convert(tmp_path, rows)
    with pytest.raises(LogFormatError, match="exists and is not empty; pass --overwrite"):
        convert_log(tmp_path / "log.csv", out, OPTIONS)
    convert_log(tmp_path / "log.csv", out, OPTIONS, overwrite=True)
    with pytest.raises(LogFormatError, match="LaMP-7 cannot be made from a log of single items"):
        convert_log(tmp_path / "log.csv", tmp_path / "x", ConvertOptions(**{**OPTIONS.__dict__, "task": "LaMP-7"}))


def test_the_command_prints_the_summary_and_the_next_command(tmp_path, rows, capsys):
    log = write_log(tmp_path / "log.jsonl", rows)
    main(["data", "convert", str(log), "--task", "LaMP-3", "--user", "reviewer", "--date", "time", "--text",
          "review", "--label", "stars", "--out", str(tmp_path / "lamp")])
    out = capsys.readouterr().out
    assert "LaMP-3: " + f"{len(rows)} rows → 24 users" in out and "items per user: min " in out
    assert f"--data_dir {tmp_path / 'lamp'}" in out
    ids = {e.example_id for e in load_lamp(tmp_path / "lamp", "LaMP-3").examples["test"]}
    assert all(i.rsplit("-", 1)[1].isdigit() for i in ids)  # no --item: `{user}-{position}`


# ------------------------------------------------------------------------------------ LaMP's user-based files

def user_based(folder: Path, records: list[dict], split: str = "train") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    questions_path(folder, split).write_text(json.dumps(records))
    (folder / f"{split}_outputs.json").write_text(json.dumps(
        {"task": "LaMP_2", "golds": [{"id": r["id"], "output": "comedy"} for r in records]}))
    return folder


def question(qid: str, **extra) -> dict:
    return {"id": qid, "input": "Which tag ... description: a film", **extra,
            "profile": [{"id": "1", "date": "2019-01-01", "description": "a film", "tag": "comedy"},
                        {"id": "2", "date": "2019-02-01", "description": "a show", "tag": "action"}]}


def test_questions_without_user_id_are_each_their_own_user_said_once(tmp_path, caplog):
    folder = user_based(tmp_path / "lamp", [question("110"), question("111")])
    with caplog.at_level(logging.WARNING, logger="persrag_lightning.data.lamp"):
        dataset = load_lamp(folder, "LaMP-2")
    assert {e.example_id: e.user_id for e in dataset.examples["train"]} == {"110": "110", "111": "111"}
    assert [d.doc_id for d in dataset.users["110"].docs] == ["1", "2"]  # the same doc id, two users' own docs
    notes = [r.getMessage() for r in caplog.records if "user_id" in r.getMessage()]
    assert notes == [("train_questions.json has no user_id: each of its 2 questions is its own user (LaMP's "
                      "user-based split)")]


def test_a_file_or_folder_mixing_the_two_splits_is_refused_in_one_line(tmp_path):
    mixed = user_based(tmp_path / "mixed", [question("1", user_id="u1"), question("2")])
    with pytest.raises(LampFormatError, match=r"train_questions.json: record 1 \(id '2'\): user_id: missing here "
                                              r"but present in record 0"):
        load_lamp(mixed, "LaMP-2")
    folder = user_based(tmp_path / "two", [question("1", user_id="u1")])
    user_based(folder, [question("2")], split="dev")
    with pytest.raises(LampFormatError, match="dev_questions.json: user_id: train_questions.json has user_id"):
        load_lamp(folder, "LaMP-2")


def test_columns_may_be_named_by_the_tasks_own_fields(tmp_path, rows, capsys):
    log = write_log(tmp_path / "log.csv", rows)
    main(["data", "convert", str(log), "--task", "LaMP-3", "--user", "reviewer", "--date", "time", "--text",
          "review", "--score", "stars", "--item", "asin", "--out", str(tmp_path / "by_field")])
    convert_log(log, tmp_path / "generic", OPTIONS)
    assert lamp_bytes(tmp_path / "by_field") == lamp_bytes(tmp_path / "generic")
    for flags, message in ((["--label", "stars", "--score", "stars"], "--label or --score: give one of them"),
                           (["--tag", "stars"], "--tag: not a field of LaMP-3"), ([], "--label or --score: required")):
        with pytest.raises(SystemExit):
            main(["data", "convert", str(log), "--task", "LaMP-3", "--user", "reviewer", "--date", "time", "--text",
                  "review", *flags, "--out", str(tmp_path / "x")])
        assert message in capsys.readouterr().err
