"""Profiles strictly older, on random logs full of ties: no question's profile holds an item dated on or after the
question, each profile holds every older item of its user, the latest item by content is the test question, and
the collaborative path (another user's pool, data/histories.py) never holds anyone's question item nor an item
dated on or after any question of its owner."""

from __future__ import annotations

import json
import random
import tempfile
from datetime import date, timedelta
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persrag_lightning.data.convert import ConvertOptions, convert_log
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.histories import visible_histories
from persrag_lightning.data.lamp import load_lamp, questions_path
from persrag_lightning.data.log_files import LogFormatError

DAY0 = date(2021, 5, 1)


@st.composite
def logs(draw) -> tuple[list[dict], ConvertOptions]:
    """A few users with 3–12 items each over a handful of days (many items share a day), short texts that repeat,
    and the split's options."""
    rows = []
    for u in range(draw(st.integers(1, 5))):
        for _ in range(draw(st.integers(3, 12))):
            rows.append({"user": f"u{u}", "date": (DAY0 + timedelta(days=draw(st.integers(0, 5)))).isoformat(),
                         "text": draw(st.sampled_from(["good", "bad", "fine", "so so", "great buy"])),
                         "stars": draw(st.sampled_from("12345")), "item": f"i{len(rows):03d}"})
    train = draw(st.integers(1, 2))
    options = ConvertOptions(task="LaMP-3", user="user", date="date", text="text", label="stars", item="item",
                             train_per_user=train, min_items=train + 3, dedupe=draw(st.booleans()))
    return rows, options


def convert(rows: list[dict], options: ConvertOptions, root: Path, name: str) -> Path | None:
    log = root / f"{name}.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        convert_log(log, root / name, options)
    except LogFormatError as e:  # every user under --min_items: nothing to convert
        assert "no user has" in str(e)
        return None
    return root / name


def kept_items(rows: list[dict], options: ConvertOptions) -> dict[str, list[dict]]:
    """Each user's items, oldest first (same day: by item id), the repeated texts dropped under dedupe."""
    by_user: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["date"], r["item"])):
        mine = by_user.setdefault(r["user"], [])
        if not (options.dedupe and any(m["text"] == r["text"] for m in mine)):
            mine.append(r)
    return {u: items for u, items in by_user.items() if len(items) >= options.min_items}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logs())
def test_no_profile_item_is_dated_on_or_after_its_question(log):
    rows, options = log
    with tempfile.TemporaryDirectory() as tmp:
        folder = convert(rows, options, Path(tmp), "lamp")
        if folder is None:
            return
        kept = kept_items(rows, options)
        when = {f"{r['user']}-{r['item']}": r["date"] for r in rows}
        for split in ("train", "dev", "test"):
            for q in json.loads(questions_path(folder, split).read_text()):
                profile = [p["id"] for p in q["profile"]]
                assert profile and all(when[p] < when[q["id"]] for p in profile), (split, q["id"])
                older = [f"{r['user']}-{r['item']}" for r in kept[q["user_id"]] if r["date"] < when[q["id"]]]
                assert profile == older  # every older item, oldest first
                if split == "test":
                    assert q["id"] == f"{q['user_id']}-{kept[q['user_id']][-1]['item']}"
        _collaborative_pool_is_older_than_its_owners_questions(folder, when)


def _collaborative_pool_is_older_than_its_owners_questions(folder: Path, when: dict[str, str]) -> None:
    dataset = load_lamp(folder, "LaMP-3")
    corpus = Corpus.from_dataset(dataset)
    questions = {e.example_id: e.user_id for examples in dataset.examples.values() for e in examples}
    pools = visible_histories(dataset, corpus).pool
    for owner, rows in pools.items():
        pooled = {corpus.doc_ids[r] for r in rows}
        asked = [q for q, u in questions.items() if u == owner]
        assert not pooled & set(questions)  # no question's own item, of anyone, is in a pool
        assert all(when[d] < when[q] for d in pooled for q in asked)


@settings(max_examples=25, deadline=None)
@given(logs(), st.randoms(use_true_random=False))
def test_the_folder_does_not_depend_on_the_row_order_even_with_ties(log, rnd: random.Random):
    rows, options = log
    with tempfile.TemporaryDirectory() as tmp:
        a = convert(rows, options, Path(tmp), "a")
        b = convert(rnd.sample(rows, len(rows)), options, Path(tmp), "b")
        if a is None:
            return
        assert b is not None
        for name in ("train_questions.json", "dev_questions.json", "test_questions.json", "test_outputs.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
