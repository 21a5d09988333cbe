"""The reader stage's data on a converted review log with same-day items: what it trains on holds no dev or test
question (ids and texts), each profile item is read with items of the same train question's profile dated strictly
before it, and no doc of a question is one the history rules hide from it."""

from __future__ import annotations

import json
from datetime import date, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from persrag_lightning.data.convert import ConvertOptions, convert_log
from persrag_lightning.data.lamp import load_lamp
from persrag_lightning.data.records import HistoryDoc, LampDataset
from persrag_lightning.data.splits import Holdout, user_fold
from persrag_lightning.data.tasks import get_task
from persrag_lightning.datamodules.reader import ReaderDataModule, ReaderExample
from persrag_lightning.models.reader import ReaderSettings
from persrag_lightning.models.reader_inputs import doc_text, question_text
from persrag_lightning.utils import ConfigError

DAY0 = date(2022, 3, 1)
# each user's items by day: ties on the first days (profile items that must not see each other), on the days of
# the train questions, and between dev and test; day 5 is free for the late items `folder` adds
DAYS = (0, 0, 1, 1, 1, 2, 3, 3, 4, 6, 6)
LATE = "a later note"
WORDS = ("glossy", "late", "thin", "recipes", "crossword", "renewal", "ads", "photos", "essays", "price")


def review_log(users: int = 6) -> list[dict]:
    """Reviews whose texts are all different (a text names its item), stars that vary within each user."""
    rows = []
    for u in range(users):
        for i, day in enumerate(DAYS):
            rows.append({"user": f"u{u}", "when": (DAY0 + timedelta(days=day)).isoformat(), "item": f"m{u}{i:02d}",
                         "stars": str(1 + (u + 2 * i) % 5),
                         "text": f"issue {i} of magazine m{u}{i:02d}: {WORDS[(u + i) % 10]} and {WORDS[(3 * i) % 10]}"})
    return rows


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The log converted, then, as in LaMP's own time-based files, one more item in each user's dev and test
    profiles that is no question and in no train profile (dated after the train questions): the history rules
    show it to dev and test questions only."""
    root = tmp_path_factory.mktemp("reviews")
    (root / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in review_log()))
    convert_log(root / "log.jsonl", root / "lamp", ConvertOptions(task="LaMP-3", user="user", date="when",
                                                                  text="text", label="stars", item="item"))
    for split in ("dev", "test"):
        path = root / "lamp" / f"{split}_questions.json"
        questions = json.loads(path.read_text())
        for q in questions:
            q["profile"].append({"id": f"{q['user_id']}-late", "date": (DAY0 + timedelta(days=5)).isoformat(),
                                 "text": f"{LATE} by {q['user_id']}", "score": "2"})
        path.write_text(json.dumps(questions))
    return root / "lamp"


def reader_data(folder: Path, cache: Path, encoder: str, **kwargs) -> ReaderDataModule:
    """The DataModule prepared and set up, its text encoder (the module's setting) the tiny one; no train user held
    out unless `holdout` says so (dev then chooses the checkpoint)."""
    kwargs.setdefault("holdout", Holdout(fold=None))
    dm = ReaderDataModule(task="LaMP-3", data_dir=str(folder), cache_dir=str(cache), k=3, batch_size=8, **kwargs)
    settings = ReaderSettings(encoder=encoder, max_length=32, max_docs=3)
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(settings=settings), limit_val_batches=1.0,
                                 world_size=1)
    dm.prepare_data()
    dm.setup("fit")
    return dm


class Items:
    """The log's items as the folder holds them: by id, by text (texts are unique), and each question's profile."""

    def __init__(self, dataset: LampDataset) -> None:
        self.spec = get_task("LaMP-3")
        self.docs: dict[str, tuple[str, HistoryDoc]] = {d.doc_id: (u.user_id, d) for u in dataset.users.values()
                                                         for d in u.docs}
        self.by_text = {doc_text(self.spec, d): (u, d) for u, d in self.docs.values()}
        assert len(self.by_text) == len(self.docs)  # every text names one item
        self.questions = {s: {e.example_id: e for e in exs} for s, exs in dataset.examples.items()}

    def read(self, example: ReaderExample) -> list[tuple[str, HistoryDoc]]:
        """The items an example reads, each checked to carry its own label."""
        out = [self.by_text[d.text] for d in example.read.docs]
        assert [d.label for d in example.read.docs] == [self.spec.doc_label(d) for _, d in out]
        return out


def test_the_reader_trains_on_no_dev_or_test_question(folder, tmp_path, tiny_bert, one_thread):
    dm = reader_data(folder, tmp_path / "cache", tiny_bert)
    items = Items(load_lamp(folder, "LaMP-3"))
    held_out = {i for s in ("dev", "test") for i in items.questions[s]}
    held_texts = {question_text(items.spec, e.input) for s in ("dev", "test") for e in items.questions[s].values()}
    assert len(held_out) == 12 and len(held_texts) == 12
    train_ids = {e.example_id for e in dm.train_examples}
    profile_items = [e for e in dm.train_examples if e.origin == "profile"]
    assert {e.example_id for e in dm.train_examples if e.origin == "question"} == set(items.questions["train"])
    assert len(profile_items) > len(items.questions["train"])  # the profiles add most of what it learns from
    assert not train_ids & held_out
    assert not {e.example_id.split("/")[1] for e in profile_items} & (held_out | set(items.questions["train"]))
    read_texts = {e.read.text for e in dm.train_examples} | {d.text for e in dm.train_examples for d in e.read.docs}
    assert not read_texts & held_texts  # neither asked nor shown as a doc
    assert not any(LATE in t for t in read_texts) and any(LATE in t for t in items.by_text)  # nor what only they see
    # dev chooses the checkpoint: dev questions only, each read with its own profile's docs
    assert sorted(e.example_id for e in dm.val_examples) == sorted(items.questions["dev"])
    for e in dm.val_examples:
        question = items.questions["dev"][e.example_id]
        assert e.target == items.spec.label_index(question.target) and e.read.text == question_text(items.spec,
                                                                                                      question.input)
        assert {d.doc_id for _, d in items.read(e)} <= set(question.profile) - {e.example_id}


def test_profile_items_are_read_with_strictly_older_items_of_the_same_profile(folder, tmp_path, tiny_bert,
                                                                              one_thread):
    dm = reader_data(folder, tmp_path / "cache", tiny_bert)
    items = Items(load_lamp(folder, "LaMP-3"))
    train = items.questions["train"]
    same_day_neighbours = 0
    for e in dm.train_examples:
        read = items.read(e)
        if e.origin == "question":  # the strategy's docs: the question's own profile, never its own item
            question = train[e.example_id]
            assert e.read.text == question_text(items.spec, question.input)
            assert e.target == items.spec.label_index(question.target)
            assert {d.doc_id for _, d in read} <= set(question.profile) - {e.example_id}
            continue
        user, doc_id = e.example_id.split("/")
        owner, doc = items.docs[doc_id]
        assert owner == user and e.read.text == doc_text(items.spec, doc)
        assert e.target == items.spec.doc_label(doc) - 1
        assert all(u == user and d.date < doc.date for u, d in read), e.example_id  # strictly older, same user
        profiles = [set(q.profile) for q in train.values() if q.user_id == user and doc_id in q.profile]
        assert any({d.doc_id for _, d in read} <= p for p in profiles), e.example_id  # one train profile holds all
        same_day_neighbours += sum(d.date == doc.date for p in profiles[:1] for d in
                                   (items.docs[i][1] for i in p) if d.doc_id != doc_id)
    assert same_day_neighbours > 0  # the log has the ties the rule is about
    assert any(len(e.read.docs) == 3 for e in dm.train_examples if e.origin == "profile")


def test_without_profile_items_it_trains_on_the_train_questions_alone(folder, tmp_path, tiny_bert, one_thread):
    dm = reader_data(folder, tmp_path / "cache", tiny_bert, profile_items=False)
    items = Items(load_lamp(folder, "LaMP-3"))
    assert sorted(e.example_id for e in dm.train_examples) == sorted(items.questions["train"])
    assert {e.origin for e in dm.train_examples} == {"question"}
    batch = next(iter(dm.train_dataloader()))
    assert batch.batch.docs.shape == (8, 3, 32) and batch.batch.question.shape == (8, 32)
    assert set(batch.targets.tolist()) <= set(range(5)) and batch.batch.mask.any()


def test_a_generation_task_has_no_reader_stage(tmp_path):
    with pytest.raises(ConfigError, match="generation task"):
        ReaderDataModule(task="LaMP-5", cache_dir=str(tmp_path))


def _labels(spec, docs) -> tuple[int, ...]:
    counts = [0] * len(spec.labels)
    for d in docs:
        if (label := spec.doc_label(d)) > 0:
            counts[label - 1] += 1
    return tuple(counts)


def test_a_profile_item_reads_every_older_item_of_the_profile_even_one_an_earlier_question_read(
        folder, tmp_path, tiny_bert, one_thread):
    """A user's second train question's profile holds the first's items: each is a question once, but stays
    context for the items after it (before, items an earlier question had read were dropped as context too)."""
    dm = reader_data(folder, tmp_path / "cache", tiny_bert)
    items = Items(load_lamp(folder, "LaMP-3"))
    train = sorted(items.questions["train"].values(), key=lambda q: q.example_id)
    users_with_two = {q.user_id for q in train if sum(p.user_id == q.user_id for p in train) > 1}
    assert users_with_two  # the log gives some users two train questions
    checked = 0
    for e in (e for e in dm.train_examples if e.origin == "profile"):
        user, doc_id = e.example_id.split("/")
        profile = next(q.profile for q in train if q.user_id == user and doc_id in q.profile)
        doc = items.docs[doc_id][1]
        older = [items.docs[i][1] for i in profile if items.docs[i][1].date < doc.date]
        assert len(e.read.docs) == min(3, len(older)), e.example_id
        # the asker's habit: what the user had labelled strictly before the item, every doc the asker's own
        assert e.read.habit == _labels(items.spec, older)
        assert all(d.own and d.user_sim == 1.0 and d.habit == e.read.habit for d in e.read.docs)
        checked += user in users_with_two and len(older) > 3
    assert checked


def test_questions_carry_the_askers_habit_over_their_visible_profile(folder, tmp_path, tiny_bert, one_thread):
    dm = reader_data(folder, tmp_path / "cache", tiny_bert)
    items = Items(load_lamp(folder, "LaMP-3"))
    for e in (e for e in dm.train_examples + dm.val_examples if e.origin == "question"):
        question = {**items.questions["train"], **items.questions["dev"]}[e.example_id]
        visible = [items.docs[i][1] for i in question.profile if i != e.example_id]
        assert e.read.habit == _labels(items.spec, visible)  # the whole profile, not the k docs
        assert sum(e.read.habit) > len(e.read.docs)
        assert all(d.own and d.habit == e.read.habit for d in e.read.docs)


def test_a_mix_strategy_adds_a_copy_of_each_train_question_and_none_of_dev(folder, tmp_path, tiny_bert,
                                                                          one_thread):
    dm = reader_data(folder, tmp_path / "cache", tiny_bert, mix=["recency"], profile_items=False)
    items = Items(load_lamp(folder, "LaMP-3"))
    ids = sorted(e.example_id for e in dm.train_examples)
    assert ids == sorted([*items.questions["train"], *(f"{i}@recency" for i in items.questions["train"])])
    assert sorted(e.example_id for e in dm.val_examples) == sorted(items.questions["dev"])


def _user(example: ReaderExample, items: Items) -> str:
    if example.origin == "profile":
        return example.example_id.split("/")[0]
    return items.questions["train"][example.example_id.split("@")[0]].user_id


def test_held_out_train_users_choose_the_checkpoint_and_are_never_trained_on(folder, tmp_path, tiny_bert,
                                                                             one_thread):
    holdout = Holdout(folds=3, fold=1)
    dm = reader_data(folder, tmp_path / "cache", tiny_bert, holdout=holdout, mix=["recency"])
    items = Items(load_lamp(folder, "LaMP-3"))
    users = {q.user_id for q in items.questions["train"].values()}
    held = {u for u in users if user_fold(u, 3) == 1}
    assert held and held != users  # the log's six users fall in both
    assert {_user(e, items) for e in dm.train_examples} == users - held
    assert {_user(e, items) for e in dm.val_examples} == held and dm.held_examples == dm.val_examples
    # the held users' examples are built as the trained-on ones are: their questions (with each mix), their items
    assert {e.origin for e in dm.val_examples} == {"question", "profile"}
    assert any(e.example_id.endswith("@recency") for e in dm.val_examples)
    dev_and_test = {i for s in ("dev", "test") for i in items.questions[s]}
    assert not {e.example_id.split("@")[0] for e in dm.train_examples + dm.val_examples} & dev_and_test
    prior = dm.label_prior()  # of the trained-on targets only, add-one smoothed
    counts = [1 + sum(e.target == j for e in dm.train_examples) for j in range(5)]
    assert prior == pytest.approx([c / sum(counts) for c in counts])


def test_a_holdout_that_leaves_no_held_user_is_refused(folder, tmp_path, tiny_bert, one_thread):
    items = Items(load_lamp(folder, "LaMP-3"))
    users = {q.user_id for q in items.questions["train"].values()}
    empty = next(f for f in range(50) if all(user_fold(u, 50) != f for u in users))
    with pytest.raises(ConfigError, match="held questions"):
        reader_data(folder, tmp_path / "cache", tiny_bert, holdout=Holdout(folds=50, fold=empty))


def test_user_folds_are_stable_and_a_holdout_checks_its_fold():
    # the first 8 bytes of the id's SHA-256: the same folds on every machine and Python (`hash()` is salted)
    assert [user_fold(u, 5) for u in ("u0", "u1", "u2", "u3", "user7", "A2FRZ6")] == [3, 2, 0, 3, 3, 4]
    assert [user_fold(f"u{i}", 2) for i in range(4)] == [0, 0, 1, 0]
    assert {user_fold(f"user{i}", 5) for i in range(200)} == set(range(5))
    with pytest.raises(ValueError, match="fold 5 of 5"):
        Holdout(folds=5, fold=5)
    assert not Holdout(fold=None).holds("u0")


def test_the_exported_decision_is_fitted_on_the_held_out_train_users_alone(folder, tmp_path, tiny_bert, one_thread,
                                                                           monkeypatch):
    from persrag_lightning.models.reader import LabelReader, ReaderConfig
    from persrag_lightning.modules.reader import ReaderModule

    dm = reader_data(folder, tmp_path / "cache", tiny_bert, holdout=Holdout(folds=3, fold=1))
    settings = ReaderSettings(encoder=tiny_bert, max_length=32, max_docs=3, dim=16, layers=1, heads=2)
    module = ReaderModule(config=settings)
    module.task = "LaMP-3"
    module.model = LabelReader(ReaderConfig(**vars(settings), task="LaMP-3", labels=("1", "2", "3", "4", "5"),
                                            embedding_dim=dm.vectors.shape[1]))
    collated = []
    collate = dm.collate
    monkeypatch.setattr(dm, "collate", lambda exs: collated.extend(exs) or collate(exs))
    config = json.loads((module.export(tmp_path / "reader", dm) / "config.json").read_text())
    assert collated == dm.held_examples and collated  # the fit reads the held-out train users' golds, no other
    assert config["decision"] == "median" or config["decision"].startswith("quantile:")
    assert config["label_prior"] == pytest.approx(dm.label_prior())
    unfitted = ReaderModule(config=settings, fit_decision=False)
    unfitted.task = "LaMP-3"
    unfitted.model = LabelReader(ReaderConfig(**vars(settings), task="LaMP-3", labels=("1", "2", "3", "4", "5"),
                                              embedding_dim=dm.vectors.shape[1]))
    assert json.loads((unfitted.export(tmp_path / "plain", dm) / "config.json").read_text())["decision"] == ""
