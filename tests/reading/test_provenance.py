"""Provenance through the one door: every hand-over from retrieval to a reader (evaluation, feedback labels,
serving) gives the reader `ReadDocs` built by `DocStore.read_docs`: each doc with its owner, whether it is the
asker's own, the owner's similarity, its rank and its owner's label habit, and the asker's habit over their whole
visible history; the trained reader reads them, and an export from before reads as it did."""

from __future__ import annotations

import json
import math

import pytest
import torch

from persrag_lightning.data.records import ReadDoc, ReadDocs
from persrag_lightning.data.tasks import get_task
from persrag_lightning.models.reader import LabelReader
from persrag_lightning.reading.trained import TrainedReader
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from tests.helpers.reader import labelled_docs, tiny_reader, tiny_reader_export
from tests.reading.test_one_door import evaluation, record, synth_dataset

SIM = 0.625


class OwnAndNeighbour(Strategy):
    """The asker's most recent visible doc, then the most recent doc of the next user in the corpus (a stand-in
    for CFRAG's top-m users: what is tested is the hand-over, not who is similar)."""

    name = "own_and_neighbour"

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        users = self.store.corpus.user_ids
        out = []
        for q in queries:
            other = users[(users.index(q.user_id) + 1) % len(users)]
            own, theirs = self.store.rows(q.user_id, query=q), self.store.rows(other, query=q)
            out.append([self.store.doc(int(own[-1])), self.store.doc(int(theirs[-1]), user_sim=SIM)])
        return out


def habit(store: DocStore, user_id: str, query: Query) -> tuple[int, ...]:
    """The label counts over what `query` may see of `user_id`, counted here from the docs themselves."""
    spec = get_task(store.dataset.task)
    counts = [0] * len(spec.labels)
    for r in store.rows(user_id, query=query):
        if (label := spec.doc_label(store.history_doc(int(r)))) > 0:
            counts[label - 1] += 1
    return tuple(counts)


def check(store: DocStore, query: Query, docs) -> None:
    """`docs` as `read_docs` hands them over for `query`: the asker's habit, each doc's provenance."""
    assert isinstance(docs, ReadDocs) and docs.asker_labels == habit(store, query.user_id, query)
    assert sum(docs.asker_labels) > len(docs)  # the whole visible history, not the docs read
    for rank, d in enumerate(docs):
        assert isinstance(d, ReadDoc) and d.rank == rank
        assert d.own == (d.owner == query.user_id)
        assert d.user_sim == (1.0 if d.own else SIM)
        assert d.owner_labels == habit(store, d.owner, query)


def test_read_docs_keeps_each_docs_provenance_and_the_askers_habit(tmp_path, monkeypatch):
    dataset = synth_dataset(tmp_path, monkeypatch)
    store = DocStore(dataset)
    strategy = OwnAndNeighbour()
    strategy.prepare(store)
    for e in dataset.examples["test"][:4]:
        query = Query(e.user_id, e.query, e.input, e.example_id)
        docs = store.read_docs(query, strategy.retrieve([query], 2)[0])
        check(store, query, docs)
        assert [d.own for d in docs] == [True, False]
        # the habit counts visible docs only: the question's own item is never among them
        assert e.example_id not in {store.corpus.doc_ids[r] for r in store.rows(e.user_id, query=query)}


def test_the_evaluation_hands_the_reader_provenance(tmp_path, tiny_bert, monkeypatch, one_thread):
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    reads = record(monkeypatch, TrainedReader, "read")
    seen: list[DocStore] = []
    monkeypatch.setattr(OwnAndNeighbour, "prepare", lambda self, store: (seen.append(store),
                                                                         Strategy.prepare(self, store)))
    ev = evaluation(tmp_path, reader=str(export))
    ev.run([OwnAndNeighbour()])
    (_, inputs, docs), _ = reads[0]
    examples = {e.input: e for e in ev.source.load().examples["test"]}
    for text, ds in zip(inputs, docs):
        e = examples[text]
        check(seen[0], Query(e.user_id, e.query, e.input, e.example_id), ds)
        assert [d.own for d in ds] == [True, False]


def test_feedback_labels_read_each_candidate_with_its_provenance(tmp_path, tiny_bert, tiny_llm, monkeypatch,
                                                                 one_thread):
    from tests.helpers.feedback import datamodule, feedback_world

    root = feedback_world(tmp_path, tiny_bert)
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    calls = record(monkeypatch, TrainedReader, "score_targets")
    builder = datamodule(root, tiny_bert, tiny_llm, feedback={"reader": str(export), "metric": "loglik"}).builder()
    examples = builder.examples("train")[:2]
    records = builder.label_chunk(examples)
    (_, _, docs, _), _ = calls[0]
    flat = [(e, c) for e, r in zip(examples, records) for c in r.candidates]
    assert len(docs) == len(flat) and any(c.owner != e.user_id for e, c in flat)  # neighbours among them
    for (e, c), ds in zip(flat, docs):
        (d,) = ds
        assert isinstance(ds, ReadDocs) and d.owner == c.owner and d.own == (c.owner == e.user_id)
        assert d.user_sim == (1.0 if d.own else pytest.approx(c.user_sim))
        query = Query(e.user_id, e.query, e.input, e.example_id)
        assert ds.asker_labels == builder.store.label_counts(e.user_id, query)


def test_serving_hands_the_reader_provenance(tmp_path, tiny_bert, monkeypatch, one_thread):
    from persrag_lightning.serving import CFRAGPipeline

    dataset = synth_dataset(tmp_path, monkeypatch)
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    answers = record(monkeypatch, TrainedReader, "answer")
    pipeline = CFRAGPipeline(OwnAndNeighbour(), DocStore(dataset), k=2, reader=str(export))
    question = dataset.examples["test"][0]
    out = pipeline.generate(question.user_id, question.input)
    (_, _, docs), _ = answers[0]
    check(pipeline.store, Query(question.user_id, "", question.input), docs[0])
    assert [d.owner for d in docs[0]] == [d.owner for d in out.docs]


def test_the_reader_reads_provenance_and_the_prior_and_an_old_export_reads_as_before(tmp_path, tiny_bert):
    docs = labelled_docs("LaMP-2", ["a heist film", "a ghost story"], ["comedy", "fantasy"])
    own = ReadDocs([ReadDoc(d.doc_id, d.date, d.fields, "u", True, 1.0, i, (1,) * 15) for i, d in enumerate(docs)],
                   (3,) + (0,) * 14)
    theirs = ReadDocs([ReadDoc(d.doc_id, d.date, d.fields, "v", False, 0.3, i, (0,) * 14 + (9,))
                       for i, d in enumerate(docs)], (0,) * 14 + (3,))
    reader = tiny_reader(tiny_bert, "LaMP-2")
    torch.manual_seed(1)
    for name in ("prior_map", "owner_embedding", "sim_map", "habit_map"):  # as if trained: not the zero start
        for p in getattr(reader, name).parameters():
            p.data.normal_()
    a, b = reader.log_probs(["a film"] * 2, [own, theirs])
    assert not torch.allclose(a, b)
    assert not torch.allclose(reader.log_probs(["a film"], [list(own)])[0], a)  # a plain list: no asker's habit
    blind = tiny_reader(tiny_bert, "LaMP-2", prior=False, provenance=False)
    a, b = blind.log_probs(["a film"] * 2, [own, theirs])
    assert torch.allclose(a, b)
    path = blind.save_pretrained(tmp_path / "old")
    config = json.loads((path / "config.json").read_text())
    del config["prior"], config["provenance"]
    (path / "config.json").write_text(json.dumps(config))
    old = LabelReader.from_pretrained(path)
    assert not old.config.prior and not old.config.provenance
    assert torch.allclose(old.log_probs(["a film"], [own])[0], a) and math.isfinite(float(a.sum()))


def test_a_neighbours_doc_is_read_against_its_owners_habit(tiny_bert):
    """The doc's label surprise under its author's habit is an input: a 'fantasy' from a user who always says
    'fantasy' and one from a user who never does read differently, the label and the text the same."""
    from persrag_lightning.models.reader_inputs import batch_from_vectors, reader_inputs

    reader = tiny_reader(tiny_bert, "LaMP-2")
    (doc,) = labelled_docs("LaMP-2", ["a ghost story"], ["fantasy"])
    fantasy = get_task("LaMP-2").labels.index("fantasy")
    usual = tuple(20 if i == fantasy else 0 for i in range(15))
    rare = tuple(0 if i == fantasy else 2 for i in range(15))
    read = reader_inputs(reader.config, ["a film"] * 2,
                         [ReadDocs([ReadDoc(doc.doc_id, doc.date, doc.fields, "v", False, 0.5, 0, h)]) for h in
                          (usual, rare)])
    batch = batch_from_vectors(read, reader.embed, 3, reader.config.embedding_dim, 15)
    surprise = batch.doc_habit[:, 0, -1]
    assert surprise[0] < 0.5 and surprise[1] > 2.0  # Jeffreys-smoothed shares: 0.75 and 0.01
    assert batch.own.tolist() == [[0], [0]] and batch.user_sim.tolist() == [[0.5], [0.5]]


def test_gain_labels_reward_what_a_candidate_adds_to_the_askers_own_docs(tmp_path, tiny_bert, tiny_llm,
                                                                        monkeypatch, one_thread):
    from tests.helpers.feedback import datamodule, feedback_world

    root = feedback_world(tmp_path, tiny_bert)
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    reader = TrainedReader(export)
    torch.manual_seed(2)  # as if trained: the prior and provenance read (not the zero start)
    for name in ("prior_map", "owner_embedding", "sim_map", "habit_map"):
        for p in getattr(reader.model, name).parameters():
            p.data.normal_(std=0.5)
    builder = datamodule(root, tiny_bert, tiny_llm, feedback={"reader": str(export), "metric": "gain"}).builder()
    builder.readers = {None: reader}
    examples = builder.examples("train")[:2]
    records = builder.label_chunk(examples)
    k = builder.candidates.k
    for e, r in zip(examples, records):
        query = Query(e.user_id, e.query, e.input, e.example_id)
        own = sorted((c for c in r.candidates if c.owner == e.user_id), key=lambda c: -c.first_stage)
        assert own and len(own) < len(r.candidates)
        for c in r.candidates:
            base = [builder.store.doc(o.row, retriever_score=o.first_stage) for o in own if o.row != c.row]
            base = base[:k - 1]
            doc = builder.store.doc(c.row, user_sim=c.user_sim, retriever_score=c.first_stage)
            plus, minus = (reader.score_targets("LaMP-2", [e.input], [builder.store.read_docs(query, ds)],
                                                [e.target])[0] for ds in ([*base, doc], base))
            assert c.label == pytest.approx(plus - minus, abs=1e-4)
        assert len({round(c.label, 4) for c in r.candidates}) > 1
    other = datamodule(root, tiny_bert, tiny_llm, feedback={"reader": str(export), "metric": "loglik"}).builder()
    assert other.key != builder.key


def test_cross_fitted_feedback_never_reads_a_question_with_a_reader_trained_on_it(tmp_path, tiny_bert, tiny_llm,
                                                                                 one_thread):
    from persrag_lightning.data.splits import user_fold
    from persrag_lightning.feedback.settings import FeedbackSettings
    from tests.helpers.feedback import datamodule, feedback_world

    root = feedback_world(tmp_path, tiny_bert)
    for fold in (0, 1):  # fold f's reader held fold f's users out of its training (the reader stage's holdout)
        tiny_reader_export(tmp_path / f"reader_fold{fold}", tiny_bert, "LaMP-2", seed=fold)
    settings = {"reader": str(tmp_path / "reader_fold{fold}"), "metric": "gain", "cross_fit": 2}
    builder = datamodule(root, tiny_bert, tiny_llm, feedback=settings).builder()
    assert sorted(builder.readers) == [0, 1]
    read_by: dict[int, set[str]] = {0: set(), 1: set()}
    for fold, reader in builder.readers.items():
        score = reader.score_targets

        def recording(task, inputs, docs, targets, *, phase=None, fold=fold, score=score):
            read_by[fold].update(inputs)
            return score(task, inputs, docs, targets, phase=phase)

        reader.score_targets = recording
    examples = builder.examples("train")[:8]
    assert {user_fold(e.user_id, 2) for e in examples} == {0, 1}
    records = builder.label_chunk(examples)
    assert [r.example_id for r in records] == [e.example_id for e in examples]
    for e in examples:  # each question read only by the reader that did not train on its user's fold
        fold = user_fold(e.user_id, 2)
        assert e.input in read_by[fold] and e.input not in read_by[1 - fold]
    # the same labels a single reader of that fold gives
    alone = datamodule(root, tiny_bert, tiny_llm, feedback={**settings, "cross_fit": 0,
                                                            "reader": str(tmp_path / "reader_fold1")}).builder()
    ones = [e for e in examples if user_fold(e.user_id, 2) == 1]
    assert [c.label for r in alone.label_chunk(ones) for c in r.candidates] == pytest.approx(
        [c.label for r in records if r.example_id in {e.example_id for e in ones} for c in r.candidates], abs=1e-5)
    assert alone.key != builder.key
    with pytest.raises(ValueError, match="placeholder"):
        FeedbackSettings(reader=str(tmp_path / "reader_fold0"), cross_fit=2)
