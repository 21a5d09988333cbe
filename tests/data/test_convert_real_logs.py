"""`persrag data convert` on logs as they are published: Amazon's own review file, a review export with empty texts
and same-day reviews, a news log with co-authors, articles without an author and 29 categories of its own."""

from __future__ import annotations

import csv
import gzip
import json
import shutil
from pathlib import Path

import pytest

from persrag_lightning.cli import main
from persrag_lightning.data.convert import ConvertOptions, convert_log
from persrag_lightning.data.lamp import load_lamp, questions_path
from persrag_lightning.data.tasks import get_task
from tests.data.test_convert import lamp_bytes
from tests.helpers.logs import CATEGORIES, QUOTED, QUOTING, news_log, review_rows

AMAZON = Path(__file__).resolve().parents[3] / "shared" / "data" / "real" / "Magazine_Subscriptions_5.json"
REVIEWS = ["--task", "LaMP-3", "--user", "reviewerID", "--date", "unixReviewTime", "--label", "overall"]
NEWS = ["--task", "labels", "--user", "authors", "--user_sep", ",", "--date", "date", "--text",
        "headline,short_description", "--label", "category", "--item", "link"]


def convert(capsys, log: Path, out: Path, flags: list[str]) -> str:
    main(["data", "convert", str(log), *flags, "--out", str(out)])
    return capsys.readouterr().out


def refused(capsys, log: Path, out: Path, flags: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["data", "convert", str(log), *flags, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and not out.exists(), err
    return err[0]


def gzipped(path: Path, suffix: str) -> Path:
    out = path.with_name(path.name + suffix)
    with open(path, "rb") as f, gzip.open(out, "wb") as g:
        shutil.copyfileobj(f, g)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.mark.skipif(not AMAZON.is_file(), reason="the real Amazon file is in ../shared/data/real")
def test_amazons_own_file_json_lines_named_json_converts_as_published_and_gzipped(tmp_path, capsys):
    flags = [*REVIEWS, "--text", "reviewText", "--item", "asin"]
    printed = convert(capsys, AMAZON, tmp_path / "mag", flags)
    assert "LaMP-3: 2375 rows → " in printed
    assert ("skipped 74 of 2375 rows: repeated item 73 (rows 87, 135, 193, 262, 286, …); missing text 1 (row 429)"
            in printed)
    assert "repeated texts: 371 items repeat an older item's text of the same user; kept (--dedupe keeps one)" in printed
    log = tmp_path / "Magazine_Subscriptions_5.json"
    shutil.copy(AMAZON, log)
    convert(capsys, gzipped(log, ".gz"), tmp_path / "mag-gz", flags)
    assert lamp_bytes(tmp_path / "mag-gz") == lamp_bytes(tmp_path / "mag")
    deduped = convert(capsys, AMAZON, tmp_path / "dedupe", [*flags, "--dedupe"])
    assert "371 items repeat an older item's text of the same user; dropped (--dedupe)" in deduped
    assert refused(capsys, AMAZON, tmp_path / "strict", [*REVIEWS, "--text", "reviewText", "--strict"]) == (
        "persrag: error: Magazine_Subscriptions_5.json: row 429: column 'reviewText' (--text): missing value")
    _no_profile_on_or_after_its_question(tmp_path / "mag", "LaMP-3")


def _no_profile_on_or_after_its_question(folder: Path, task: str) -> None:
    """Every profile item is dated strictly before its question's own item (its date: where any profile shows it,
    else the latest date it may have, the test question's)."""
    dataset = load_lamp(folder, task)
    dates = {(u.user_id, d.doc_id): d.date for u in dataset.users.values() for d in u.docs}
    for examples in dataset.examples.values():
        for ex in examples:
            own = dates.get((ex.user_id, ex.example_id))
            profile = [dates[(ex.user_id, d)] for d in ex.profile]
            assert ex.example_id not in ex.profile and (own is None or max(profile) < own), ex.example_id


def test_a_review_export_with_empty_texts_skips_them_or_reads_the_summary_too(tmp_path, capsys):
    log = write_csv(tmp_path / "reviews.csv", review_rows())
    printed = convert(capsys, log, tmp_path / "text", [*REVIEWS, "--text", "reviewText", "--item", "asin"])
    empty = [i + 1 for i, r in enumerate(review_rows()) if not r["reviewText"]]
    assert f"skipped {len(empty)} of 107 rows: missing text {len(empty)} (rows {', '.join(map(str, empty[:5]))}, …)" \
        in printed
    printed = convert(capsys, log, tmp_path / "both", [*REVIEWS, "--text", "reviewText,summary", "--item", "asin"])
    assert "skipped" not in printed
    test = {q["id"]: q for q in json.loads(questions_path(tmp_path / "both", "test").read_text())}
    assert test["AQUOTER-B0SN2"]["input"].endswith(f"review: {QUOTING} 4 stars")  # the two columns, as sentences
    empty_text = next(r for r in review_rows() if not r["reviewText"])
    dataset = load_lamp(tmp_path / "both", "LaMP-3")
    doc = next(d for d in dataset.users[empty_text["reviewerID"]].docs if d.doc_id.endswith(empty_text["asin"]))
    assert doc.fields["text"] == empty_text["summary"]


def test_two_reviews_of_one_day_never_see_each_other_and_the_later_by_content_is_the_test(tmp_path, capsys):
    """The quoting review and the review it quotes are written on the user's latest day: the test question (the
    later of the two by item id) does not show the quoted review, and neither question shows the other."""
    rows = review_rows()
    convert(capsys, write_csv(tmp_path / "reviews.csv", rows), tmp_path / "out",
            [*REVIEWS, "--text", "reviewText", "--item", "asin"])
    splits = {s: {q["id"]: q for q in json.loads(questions_path(tmp_path / "out", s).read_text())}
              for s in ("dev", "test")}
    test, dev = splits["test"]["AQUOTER-B0SN2"], splits["dev"]["AQUOTER-B0SN1"]
    assert test["input"].endswith(QUOTING) and dev["input"].endswith(QUOTED)
    assert test["profile"] == dev["profile"] and not {p["id"] for p in test["profile"]} & {"AQUOTER-B0SN1"}
    day = next(r for r in rows if r["asin"] == "B0SN1")["reviewTime"]
    assert all(p["date"] < "-".join([day[-4:], day[:2], day[3:5]]) for p in test["profile"])
    reversed_log = write_csv(tmp_path / "reversed.csv", rows[::-1])  # the same day's rows in the other order
    convert(capsys, reversed_log, tmp_path / "reversed", [*REVIEWS, "--text", "reviewText", "--item", "asin"])
    assert lamp_bytes(tmp_path / "reversed") == lamp_bytes(tmp_path / "out")


def test_a_news_log_with_co_authors_and_its_own_29_categories_converts_to_a_label_task(tmp_path, capsys):
    rows = news_log()
    assert len({r["category"] for r in rows}) == 29
    log = gzipped(write_jsonl(tmp_path / "news.json", rows), ".gz")  # JSON Lines named .json, then gzipped
    printed = convert(capsys, log, tmp_path / "news", NEWS)
    missing = [i + 1 for i, r in enumerate(rows) if not r["authors"]]
    assert f"skipped {len(missing)} of {len(rows)} rows: missing user {len(missing)} (rows " \
           f"{', '.join(map(str, missing[:5]))}, …)" in printed
    manifest = json.loads((tmp_path / "news" / "convert.json").read_text())
    labels = manifest["task"]["labels"]
    assert manifest["task"]["name"] == "labels" and labels == sorted(labels) and set(labels) <= set(CATEGORIES)
    assert f"label set ({len(labels)}, the train split's): {', '.join(labels)}" in printed
    dataset = load_lamp(tmp_path / "news", "labels")
    assert get_task("labels").labels == tuple(labels) and dataset.task == "labels"
    train = {e.target for e in dataset.examples["train"]}
    train_docs = {d.fields["label"] for e in dataset.examples["train"] for d in dataset.users[e.user_id].docs
                  if d.doc_id in e.profile}
    assert set(labels) == train | train_docs  # the train questions' and their profiles' labels, no other
    assert all(e.target in labels for s in ("dev", "test") for e in dataset.examples[s])
    coauthored = next(r for r in rows if ", " in r["authors"])
    first, second = (a.strip() for a in coauthored["authors"].split(","))
    holders = {uid for uid, u in dataset.users.items() for d in u.docs if d.doc_id.endswith(coauthored["link"])}
    assert holders <= {first, second} and ", " not in "".join(dataset.users)
    _no_profile_on_or_after_its_question(tmp_path / "news", "labels")


def test_the_same_command_twice_writes_byte_identical_folders_whatever_the_row_order(tmp_path, capsys):
    rows = news_log(seed=3)
    log = write_jsonl(tmp_path / "news.jsonl", rows)
    convert(capsys, log, tmp_path / "a", NEWS)
    convert(capsys, log, tmp_path / "b", NEWS)
    for name in (*lamp_bytes(tmp_path / "a"), "convert.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    convert(capsys, write_jsonl(tmp_path / "oldest_first.jsonl", rows[::-1]), tmp_path / "c", NEWS)
    assert lamp_bytes(tmp_path / "c") == lamp_bytes(tmp_path / "a")


def test_json_is_recognised_by_its_content_and_gzip_by_its_bytes(tmp_path):
    rows = review_rows()
    options = ConvertOptions(task="LaMP-3", user="reviewerID", date="unixReviewTime", text="reviewText,summary",
                             label="overall", item="asin")
    as_list = tmp_path / "reviews.jsonl"
    as_list.write_text(json.dumps(rows))  # a JSON list under a JSON Lines name
    folders = [(tmp_path / name, log) for name, log in (
        ("list", as_list), ("lines", write_jsonl(tmp_path / "reviews.txt", rows)),
        ("csv", gzipped(write_csv(tmp_path / "reviews.csv", rows), ".gz")),
        ("nameless", gzipped(write_jsonl(tmp_path / "export", rows), ".bin")))]  # gzipped JSON Lines, no hint
    for out, log in folders:
        convert_log(log, out, options)
    assert all(lamp_bytes(out) == lamp_bytes(folders[0][0]) for out, _ in folders[1:])


def test_repeated_texts_are_counted_and_dedupe_keeps_the_oldest(tmp_path):
    rows = [{"user": "a", "date": f"2020-01-{d:02d}", "text": f"text {d}", "stars": "4", "item": f"i{d}"}
            for d in range(1, 8)]
    rows += [{**rows[2], "item": "copy", "date": "2020-01-05"}, {**rows[0], "item": "copy2", "date": "2020-01-06"}]
    log = write_jsonl(tmp_path / "log.jsonl", rows)
    options = ConvertOptions(task="LaMP-3", user="user", date="date", text="text", label="stars", item="item")
    kept = convert_log(log, tmp_path / "kept", options)
    deduped = convert_log(log, tmp_path / "deduped", ConvertOptions(**{**options.__dict__, "dedupe": True}))
    assert (kept.repeated_texts, kept.deduplicated, kept.items) == (2, 0, 9)
    assert (deduped.repeated_texts, deduped.deduplicated, deduped.items) == (2, 2, 7)
    docs = {d.doc_id for d in load_lamp(tmp_path / "deduped", "LaMP-3").users["a"].docs}
    assert "a-copy" not in docs and "a-copy2" not in docs and {"a-i1", "a-i3"} <= docs  # the oldest of each text
