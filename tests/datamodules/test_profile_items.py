"""Profile items read the way CFRAG reads a question (`mix_items`): each item's docs come from the first stage's
users, are dated strictly before the item and visible to the train question whose profile holds it, never the item
itself; a neighbour's doc carries its similarity, and every habit counts only the labels dated before the item."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persrag_lightning.data.lamp import load_lamp
from persrag_lightning.data.splits import Holdout
from persrag_lightning.data.tasks import get_task
from persrag_lightning.datamodules.profile_items import collaborative_items, older_profile_questions
from persrag_lightning.datamodules.reader import ReaderDataModule
from persrag_lightning.models.reader_inputs import doc_text
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.utils import ConfigError
from tests.datamodules.test_reader_data import _labels, folder, reader_data  # noqa: F401 (the fixture)

SIM = 0.5


class RecentFirst:
    """A stand-in first-stage retriever: a user's most recent visible docs score best."""

    def query_vectors(self, texts: list[str]) -> torch.Tensor:
        return torch.zeros(len(texts), 1)

    def score(self, vector: torch.Tensor, rows: np.ndarray, e_u) -> torch.Tensor:
        return torch.as_tensor(rows, dtype=torch.float32)

    def tuned_user_embedding(self, user_id: str, e_u):
        return e_u


class FirstStage:
    """A stand-in for CFRAG's first stage: the asker and the next user of the corpus, 2 docs each."""

    def __init__(self, store: DocStore) -> None:
        self.store, self.retriever, self.k_per_user = store, RecentFirst(), 2

    def similar_users(self, user_id: str) -> list[tuple[str, float]]:
        users = self.store.corpus.user_ids
        return [(user_id, 1.0), (users[(users.index(user_id) + 1) % len(users)], SIM)]

    def user_embedding(self, user_id: str):
        return None


def test_an_item_reads_older_docs_of_its_first_stage_users_with_their_provenance(folder):  # noqa: F811
    dataset = load_lamp(folder, "LaMP-3")
    spec, store = get_task("LaMP-3"), DocStore(dataset)
    source = FirstStage(store)
    read_any_neighbour = False
    for example in dataset.examples["train"]:
        profile = set(example.profile)
        user_docs = [d for d in dataset.users[example.user_id].docs if d.doc_id in profile]
        items = [doc for doc, _ in older_profile_questions(spec, user_docs, set(), 3, lambda t: torch.eye(len(t)))]
        reads = collaborative_items(spec, store, source, example, items, 3)
        assert len(reads) == len(items)
        query = Query(example.user_id, example.query, example.input, example.example_id)
        by_text = {doc_text(spec, store.history_doc(int(r))): (owner, store.history_doc(int(r)))
                   for owner, _ in source.similar_users(example.user_id) for r in store.rows(owner, query=query)}
        for item, read in zip(items, reads):
            assert read.text == doc_text(spec, item) and len(read.docs) <= 3  # none before the first item
            older = {owner: [d for o, d in by_text.values() if o == owner and d.date < item.date]
                     for owner, _ in source.similar_users(example.user_id)}
            assert read.habit == _labels(spec, older[example.user_id])  # the asker's, before the item only
            for d in read.docs:
                owner, doc = by_text[d.text]  # a doc the train question may see, of a first-stage user
                assert doc.date < item.date and doc.doc_id != item.doc_id
                assert d.own == (owner == example.user_id) and d.user_sim == (1.0 if d.own else SIM)
                assert d.label == spec.doc_label(doc) and d.habit == _labels(spec, older[owner])
                read_any_neighbour |= not d.own
    assert read_any_neighbour


def test_mix_items_needs_a_mix_strategy_with_a_first_stage(folder, tmp_path, tiny_bert, one_thread):  # noqa: F811
    with pytest.raises(ConfigError, match="mix_items"):
        reader_data(folder, tmp_path / "cache", tiny_bert, mix=["recency"], mix_items=True)
    with pytest.raises(ConfigError, match="mix_items"):
        reader_data(folder, tmp_path / "cache", tiny_bert, mix_items=True)


def test_every_reader_of_the_same_data_shares_the_items_collaborative_reads(folder, tmp_path, tiny_bert,  # noqa: F811
                                                                             one_thread, monkeypatch):
    stages = []

    def first_stage(self, store, name):
        stages.append(name)
        return FirstStage(store)

    monkeypatch.setattr(ReaderDataModule, "mix_source", first_stage)
    dm = reader_data(folder, tmp_path / "cache", tiny_bert, mix=["recency"], mix_items=True,
                     holdout=Holdout(folds=3, fold=0))
    examples = dm.train_examples + dm.val_examples
    read = {e.example_id: e for e in examples if e.origin == "profile" and e.example_id.endswith("@recency")}
    own = [e for e in examples if e.origin == "profile" and "@" not in e.example_id]
    assert stages and sorted(read) == sorted(f"{e.example_id}@recency" for e in own)  # every item, both ways
    assert any(not d.own for e in read.values() for d in e.read.docs)
    # another holdout (a fold reader) builds its own examples from the same reads, without a first stage
    monkeypatch.setattr(ReaderDataModule, "mix_source", lambda *a: pytest.fail("the reads were made again"))
    other = reader_data(folder, tmp_path / "cache", tiny_bert, mix=["recency"], mix_items=True,
                        holdout=Holdout(folds=3, fold=1))
    again = {e.example_id: e for e in other.train_examples + other.val_examples if e.example_id in read}
    assert again == read
