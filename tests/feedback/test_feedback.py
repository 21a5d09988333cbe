"""LLM-feedback labels: built once, cached, resumable, shardable, and read back as typed batches."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from persrag_lightning.data.source import LampSource
from persrag_lightning.datamodules.feedback import FeedbackDataModule, UninformativeFeedbackWarning
from persrag_lightning.feedback.builder import feedback_stats
from persrag_lightning.llm import hf
from persrag_lightning.llm.base import LLMBackendError
from persrag_lightning.models.user_encoder import UserEncoder
from persrag_lightning.retrieval.base import Query
from tests.helpers.feedback import datamodule, feedback_world

EIGHT = {"max_train_examples": 8, "max_val_examples": 8}


@pytest.fixture()
def world(tmp_path, tiny_bert):
    return feedback_world(tmp_path, tiny_bert)


@pytest.fixture()
def count_llm_calls(monkeypatch):
    """Counts prompts that reach the hf backend's generate."""
    calls = {"prompts": 0, "loads": 0}
    generate, init = hf.HFLLM.generate, hf.HFLLM.__init__

    def counting_generate(self, prompts, max_new_tokens):
        calls["prompts"] += len(prompts)
        return generate(self, prompts, max_new_tokens)

    def counting_init(self, *args, **kwargs):
        calls["loads"] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(hf.HFLLM, "generate", counting_generate)
    monkeypatch.setattr(hf.HFLLM, "__init__", counting_init)
    return calls


def chunk_files(dm: FeedbackDataModule) -> dict[str, bytes]:
    root = dm.builder().root
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("chunk-*.jsonl"))}


def test_build_once_then_zero_llm_calls(world, tiny_bert, tiny_llm, count_llm_calls):
    dm = datamodule(world, tiny_bert, tiny_llm)
    dm.prepare_data()
    first = count_llm_calls["prompts"]
    dm.setup("fit")
    records = dm.train_examples + dm.val_examples
    distinct = {(e.input, dm.corpus.texts[c.row]) for e in records for c in e.candidates}  # = distinct prompts
    assert first == len(distinct)  # each distinct prompt reached the LLM exactly once

    again = datamodule(world, tiny_bert, tiny_llm)
    again.prepare_data()
    assert count_llm_calls["prompts"] == first  # the second run makes zero LLM calls
    assert count_llm_calls["loads"] == 1  # and never even loads the LLM

    other_build = datamodule(world, tiny_bert, tiny_llm, feedback={"chunk_size": 4})  # another cache folder, same prompts
    other_build.prepare_data()
    assert other_build.builder().root != dm.builder().root
    assert count_llm_calls["prompts"] == first  # the prompt store is shared across builds

    again.setup("fit")
    assert len(again.train_examples) == 32 and len(again.val_examples) == 16
    batch = next(iter(again.train_dataloader()))
    assert batch.doc_index.shape == (4, 6) and batch.mask.all()
    assert ((batch.labels == 0) | (batch.labels == 1)).all()  # LaMP-2 accuracy per candidate
    assert len(batch.docs) == len(set(batch.docs)) <= 24  # a doc shared by examples is carried once
    first_ex = again.train_examples[0]
    assert first_ex.candidates[0].owner == first_ex.user_id  # the query user ranks first among the m users
    assert {c.owner for c in first_ex.candidates} <= set(again.user_ids)


def test_shards_merge_to_single_process_build(world, tiny_bert, tiny_llm):
    single = datamodule(world, tiny_bert, tiny_llm)
    single.prepare_data()
    sharded = datamodule(world, tiny_bert, tiny_llm, cache="cache_sharded")
    # the corpus embeddings are in another cache dir: copy nothing, let each shard build what it needs
    for shard in (2, 0, 1):
        sharded.build_feedback(shard, 3)
    assert chunk_files(sharded) == chunk_files(single)


def test_killed_build_resumes_from_finished_chunks(world, tiny_bert, tiny_llm, count_llm_calls, monkeypatch):
    dm = datamodule(world, tiny_bert, tiny_llm)
    generate = hf.HFLLM.generate
    state = {"batches": 0}

    def failing_after_two_chunks(self, prompts, max_new_tokens):
        state["batches"] += 1
        if state["batches"] > 2:
            raise LLMBackendError("server went away")
        return generate(self, prompts, max_new_tokens)

    monkeypatch.setattr(hf.HFLLM, "generate", failing_after_two_chunks)
    with pytest.raises(LLMBackendError, match="server went away"):
        dm.prepare_data()
    done = chunk_files(dm)
    assert len(done) == 2 and not list(dm.builder().root.rglob("*.tmp"))

    monkeypatch.setattr(hf.HFLLM, "generate", generate)
    dm.prepare_data()
    assert len(chunk_files(dm)) == 4 + 2  # train: 32 examples / 8; dev: 16 / 8
    assert {k: v for k, v in chunk_files(dm).items() if k in done} == done  # finished chunks kept as they were


def test_concurrent_builders_of_one_shared_cache_label_once(world, tiny_bert, tiny_llm, count_llm_calls,
                                                          monkeypatch):
    """Two nodes' prepare_data on one shared cache folder (here: two threads, released together just before they
    look for missing chunks): the first labels every chunk, the second waits for its lock and loads no LLM."""
    import threading

    start = threading.Barrier(2, timeout=60)
    prepare = LampSource.prepare
    monkeypatch.setattr(LampSource, "prepare", lambda self: (prepare(self), start.wait()))
    modules = [datamodule(world, tiny_bert, tiny_llm) for _ in range(2)]
    errors: list[BaseException] = []

    def run(dm: FeedbackDataModule) -> None:
        try:
            dm.prepare_data()
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(dm,)) for dm in modules]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert count_llm_calls["loads"] == 1
    assert len(chunk_files(modules[0])) == 4 + 2


def test_fit_builds_no_test_labels_and_test_reads_the_test_split(world, tiny_bert, tiny_llm):
    """Dev selects, test reports: fitting never spends LLM calls on the test split; `test` builds and reads it."""
    from types import SimpleNamespace

    dm = datamodule(world, tiny_bert, tiny_llm)
    dm.prepare_data()
    root = dm.builder().root
    assert (root / "train").is_dir() and (root / "dev").is_dir() and not (root / "test").exists()
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="test"))  # what Trainer.test sets before prepare_data
    dm.prepare_data()
    dm.setup("test")
    ids = [i for batch in dm.test_dataloader() for i in batch.example_ids]
    assert len(ids) == 16 and all("-test" in i for i in ids)


def test_a_trainer_that_validates_nothing_gets_no_dev_labels(world, tiny_bert, tiny_llm):
    """`--trainer.limit_val_batches=0` (the quick preset's feedback stages): the dev split is neither labelled nor
    read; the train split is."""
    from types import SimpleNamespace

    dm = datamodule(world, tiny_bert, tiny_llm)
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), limit_val_batches=0)
    dm.prepare_data()
    dm.setup("fit")
    root = dm.builder().root
    assert (root / "train").is_dir() and not (root / "dev").exists()
    assert dm.train_examples and dm.val_examples == []
    dm.trainer.limit_val_batches = 1.0  # validation on again: dev is labelled and read
    dm.prepare_data()
    dm.train_examples = []
    dm.setup("fit")
    assert (root / "dev").is_dir() and dm.val_examples


def test_missing_user_encoder_names_the_command(world, tiny_bert, tiny_llm):
    dm = datamodule(world, tiny_bert, tiny_llm, candidates={"user_encoder": str(world / "nowhere")})
    with pytest.raises(FileNotFoundError, match="cfrag_user_encoder.yaml"):
        dm.prepare_data()


def test_setup_without_labels_names_the_command(world, tiny_bert, tiny_llm):
    dm = datamodule(world, tiny_bert, tiny_llm)
    with pytest.raises(FileNotFoundError, match="persrag feedback"):
        dm.setup("fit")


def test_loglik_metric_and_stats(world, tiny_bert, tiny_llm):
    dm = datamodule(world, tiny_bert, tiny_llm, feedback={"metric": "loglik"}, splits=EIGHT)
    dm.prepare_data()
    dm.setup("fit")
    labels = np.array([c.label for e in dm.train_examples for c in e.candidates])
    assert len(dm.train_examples) == 8 and (labels < 0).all() and np.isfinite(labels).all()
    stats = feedback_stats(dm.train_examples)
    assert stats.candidates_per_example == 6 and stats.informative_fraction == 1.0
    assert "informative_fraction" in stats.table()


def test_labels_that_rank_no_candidate_warn_the_stage(world, tiny_bert, tiny_llm):
    """Under the task metric the tiny random LLM never answers a tag, so every candidate's label is 0 and the stage
    would train towards a uniform target: setup says so and names `loglik`; log-likelihood labels do not warn."""
    dm = datamodule(world, tiny_bert, tiny_llm, splits=EIGHT)
    dm.prepare_data()
    with pytest.warns(UninformativeFeedbackWarning,
                      match=r"train feedback labels: only 0% of 8 examples .*feedback\.metric task"
                            r".*`feedback\.metric: loglik`"):
        dm.setup("fit")
    assert feedback_stats(dm.train_examples).informative_fraction == 0.0
    ranked = datamodule(world, tiny_bert, tiny_llm, feedback={"metric": "loglik"}, splits=EIGHT)
    ranked.prepare_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UninformativeFeedbackWarning)
        ranked.setup("fit")


def stage_config(world: Path, tiny_bert: str, tiny_llm: str, **feedback) -> Path:
    """A retriever stage's config file over the `world` fixture, as `persrag feedback --config` takes it."""
    import yaml

    config = world / "feedback.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"class_path": "persrag_lightning.modules.retriever.RetrieverModule",
                  "init_args": {"config": {"encoder": tiny_bert}}},
        "data": {"class_path": "persrag_lightning.datamodules.feedback.FeedbackDataModule", "init_args": {
            "task": "LaMP-2", "synth": {"num_users": 16, "docs_per_user": [6, 10]},
            "cache_dir": str(world / "cache"),
            "candidates": {"user_encoder": str(world / "user_encoder"), "retriever": tiny_bert, "m": 3, "k": 2},
            "feedback": {"chunk_size": 8, "llm": {"model": tiny_llm, "batch_size": 8, "options": {"device": "cpu"}},
                         **feedback}}},
    }))
    return config


def test_feedback_command_builds_shards_and_prints_stats(world, tiny_bert, tiny_llm, capsys):
    """`persrag feedback --config <stage config> --shard i --num-shards n`, then `--stats`."""
    from persrag_lightning.cli import main

    config = stage_config(world, tiny_bert, tiny_llm)
    for shard in (1, 0):
        main(["feedback", "--config", str(config), "--shard", str(shard), "--num-shards", "2"])
    built = capsys.readouterr().out
    assert "shard 1/2" in built and "shard 0/2" in built
    main(["feedback", "--config", str(config), "--stats"])
    stats = capsys.readouterr().out
    assert "| examples | 32 |" in stats and "| examples | 16 |" in stats and "informative_fraction" in stats


def test_feedback_command_labels_only_what_the_stage_reads(world, tiny_bert, tiny_llm, capsys):
    """With the stage's `--trainer.limit_val_batches=0` (the quick preset's) the command builds, and `--stats`
    reads, the train labels only: no LLM call goes to dev questions the stage would never read."""
    from persrag_lightning.cli import main

    config = stage_config(world, tiny_bert, tiny_llm, metric="loglik")
    main(["feedback", "--config", str(config), "--trainer.limit_val_batches=0"])
    root = next(p for p in (world / "cache" / "feedback").iterdir() if p.is_dir())
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["train"]
    capsys.readouterr()
    main(["feedback", "--config", str(config), "--trainer.limit_val_batches=0", "--stats"])
    stats = capsys.readouterr().out
    assert "| examples | 32 |" in stats and "dev (" not in stats


def test_candidates_never_come_from_a_user_who_does_not_share(world, tiny_bert, tiny_llm):
    """`share: false`: never a neighbour in the feedback candidates, and never a doc in another user's prompt."""
    builder = datamodule(world, tiny_bert, tiny_llm).builder()
    examples = builder.dataset.examples["train"]
    source = builder.candidate_source()
    private = examples[0].user_id
    queries = [Query(e.user_id, e.query, e.input, e.example_id) for e in examples if e.user_id != private]
    assert any(d.owner == private for docs in source.propose(queries) for d in docs)  # it would be a neighbour
    builder.store.set_share(private, False)
    for docs in builder.candidate_source().propose(queries):
        assert len({d.owner for d in docs}) == 3 and all(d.owner != private for d in docs)


def test_teacher_labels_are_the_scores_cfrag_serves_without_an_llm(world, tiny_bert, tiny_llm, count_llm_calls,
                                                                   monkeypatch, capsys):
    """feedback.metric teacher: each candidate's label is the teacher reranker's score of it, exactly what CFRAG's
    rerank computes at inference for the same query (same candidates, same pairs, same e_u); no LLM is loaded."""
    from persrag_lightning.models.reranker import PersonalizedReranker
    from persrag_lightning.retrieval.base import DocStore
    from persrag_lightning.retrieval.cfrag import CFRAG

    dim = UserEncoder.from_pretrained(world / "user_encoder").user_embeddings.shape[1]
    torch.manual_seed(2)
    teacher = PersonalizedReranker.from_encoder(tiny_bert, user_dim=dim).save_pretrained(world / "teacher")
    dm = datamodule(world, tiny_bert, tiny_llm, feedback={"metric": "teacher", "teacher": str(teacher)},
                    splits={"max_train_examples": 8, "max_val_examples": 4})
    dm.prepare_data()
    dm.setup("fit")
    assert count_llm_calls["loads"] == 0 and count_llm_calls["prompts"] == 0
    assert len(dm.train_examples) == 8 and len(dm.val_examples) == 4

    dataset = dm.source.load()
    strategy = CFRAG(str(world / "user_encoder"), tiny_bert, str(teacher), m=3, k_per_user=2,
                     cache_dir=str(world / "cache"))
    strategy.prepare(DocStore(dataset, dm.corpus))
    queries = [Query(e.user_id, e.query, e.input, e.example_id) for e in dm.train_examples]
    served = strategy.rerank(queries, strategy.candidates(queries), k=6)
    for example, docs in zip(dm.train_examples, served):
        labels = {c.row: c.label for c in example.candidates}
        assert labels.keys() == {d.row for d in docs}
        for d in docs:
            assert labels[d.row] == pytest.approx(d.reranker_score, abs=1e-5)
    # retrieve: the same docs, `batch_size` queries at a time, with a progress line per batch when it takes long
    import functools

    from persrag_lightning.progress import Progress
    from persrag_lightning.retrieval import cfrag

    monkeypatch.setattr(cfrag, "Progress", functools.partial(Progress, every=0))  # every batch counts as long
    strategy.batch_size = 3
    capsys.readouterr()
    assert [[d.row for d in ds] for ds in strategy.retrieve(queries, 6)] == [[d.row for d in ds] for ds in served]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("[retrieve CFRAG] 3/8 queries (38 %)") and lines[-1].startswith("[retrieve CFRAG] 8/8")

    with pytest.raises(ValueError, match="go together"):
        datamodule(world, tiny_bert, tiny_llm, feedback={"metric": "teacher"}).builder()
    with pytest.raises(FileNotFoundError, match="cfrag_reranker.yaml"):
        datamodule(world, tiny_bert, tiny_llm, feedback={"metric": "teacher", "teacher": str(world / "none")}).builder()
    other = PersonalizedReranker.from_encoder(tiny_bert, user_dim=dim).save_pretrained(world / "other")
    assert datamodule(world, tiny_bert, tiny_llm, feedback={"metric": "teacher", "teacher": str(other)}).builder().key != \
        dm.builder().key  # another teacher, other labels
