"""The reader stage end to end at tiny scale: `fit --config reader.yaml` trains on SynthLaMP's train questions and
their profiles (never a dev or test question, never a held-out train user's), validates on the held-out train users
with the task's metric, fits its decision on them, and exports a reader that `TrainedReader` loads and reads with
BM25's docs, answering labels of the task by the fitted decision."""

from __future__ import annotations

import json

import pytest

from persrag_lightning.commands.train import lightning_command
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.splits import user_fold
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.data.tasks import get_task
from persrag_lightning.models.reader import encoder_digest
from persrag_lightning.reading.trained import TrainedReader
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.baselines import BM25

USERS = 12


def fit_args(encoder: str, task: str, epochs: int = 2, *extra: str) -> list[str]:
    return ["fit", "--config", "reader.yaml", "--run_name", "t", "--trainer.accelerator=cpu",
            f"--trainer.max_epochs={epochs}", "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
            f"--model.init_args.config.encoder={encoder}", "--model.init_args.config.max_length=32",
            "--model.init_args.config.dim=16", "--model.init_args.config.layers=1",
            "--model.init_args.config.heads=2", f"--data.init_args.task={task}",
            f"--data.init_args.synth.num_users={USERS}", "--data.init_args.batch_size=16", *extra]


@pytest.mark.parametrize("task", ["LaMP-2", "LaMP-3"])
def test_fit_reader_yaml_exports_a_reader_that_reads(in_tmp_cwd, tiny_bert, task, one_thread, capsys):
    lightning_command(fit_args(tiny_bert, task))
    assert "examples of held-out train users, decision" in capsys.readouterr().out
    export = in_tmp_cwd / "checkpoints" / "t" / "reader"
    config = json.loads((export / "config.json").read_text())
    spec = get_task(task)
    assert config["task"] == task and tuple(config["labels"]) == spec.labels
    assert config["encoder_digest"] == encoder_digest(tiny_bert) and config["dim"] == 16
    # the decision fitted on the held-out train users: a quantile level (ordered labels) or the prior's power
    assert len(config["label_prior"]) == len(spec.labels) and sum(config["label_prior"]) == pytest.approx(1)
    if task == "LaMP-3":
        assert config["decision"] == "median" or config["decision"].startswith("quantile:")
    else:
        assert config["decision"] == "argmax" and config["prior_power"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    metrics = next((in_tmp_cwd / "runs" / "t" / "reader").rglob("metrics.csv")).read_text().splitlines()
    for name in ("train/loss", "val/loss", "val/metric", "val/mae" if task == "LaMP-3" else "val/accuracy"):
        assert name in metrics[0].split(","), name

    # what it trained on: SynthLaMP's train questions of the users not held out and their profiles' items, no dev or
    # test question; the held-out fold's questions and items validate, and dev is not read
    dataset = LampSource(task, None, SynthConfig(num_users=USERS), ".cache/persrag").load()
    stored, = (json.loads(p.read_text()) for p in (in_tmp_cwd / ".cache" / "persrag" / "reader_data").rglob(
        "examples.json"))
    train, held_out = stored["splits"]["train"], {e.example_id for s in ("dev", "test") for e in dataset.examples[s]}
    held_texts = {e.query for s in ("dev", "test") for e in dataset.examples[s]}
    assert {r["origin"] for r in train} == {"question", "profile"}
    held_users = {e.user_id for e in dataset.examples["train"] if user_fold(e.user_id, 5) == 0}
    assert held_users and set(stored["splits"]) == {"train", "held"}
    for split, users in (("train", lambda u: u not in held_users), ("held", lambda u: u in held_users)):
        assert {r["id"] for r in stored["splits"][split] if r["origin"] == "question"} == {
            e.example_id for e in dataset.examples["train"] if users(e.user_id)}
    assert not {r["id"] for r in train} & held_out
    assert not {r["id"].split("/")[-1] for r in train} & held_out
    assert not {r["text"] for r in train} & held_texts

    # the export read as the evaluation reads it: dev questions with BM25's docs over their own profiles
    store = DocStore(dataset)
    bm25 = BM25()
    bm25.prepare(store)
    dev = sorted(dataset.examples["dev"], key=lambda e: e.example_id)
    retrieved = bm25.retrieve([Query(e.user_id, e.query, e.input, e.example_id) for e in dev], 5)
    docs = [[store.history_doc(d.row) for d in ds] for ds in retrieved]
    reader = TrainedReader(export)
    assert reader.model.config.ordinal == (task == "LaMP-3")  # head auto: cumulative link for ordered labels
    reading = reader.read(task, [e.input for e in dev], docs)
    assert len(reading.answers) == len(dev) and set(reading.answers) <= set(spec.labels)
    assert all(abs(sum(p) - 1) < 1e-4 for p in reading.probabilities)
    assert reading.decision == config["decision"]
    assert reader.answer(task, [e.input for e in dev], docs) == reading.answers


def test_a_second_fit_that_finds_its_data_cached_trains_the_same_reader(in_tmp_cwd, tiny_bert, one_thread):
    lightning_command(fit_args(tiny_bert, "LaMP-3", 2, "--run_name", "first"))  # builds the reader's data
    lightning_command(fit_args(tiny_bert, "LaMP-3", 2, "--run_name", "second"))  # finds it cached
    first, second = (in_tmp_cwd / "checkpoints" / run / "reader" for run in ("first", "second"))
    assert (first / "reader.safetensors").read_bytes() == (second / "reader.safetensors").read_bytes()
    assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())


@pytest.mark.parametrize("select_on", ["metric", "loss"])
def test_the_checkpoint_is_chosen_on_the_held_out_metric_or_their_likelihood(in_tmp_cwd, tiny_bert, one_thread,
                                                                               select_on):
    lightning_command(fit_args(tiny_bert, "LaMP-3", 2, f"--model.init_args.select_on={select_on}"))
    metrics = next((in_tmp_cwd / "runs" / "t" / "reader").rglob("metrics.csv")).read_text().splitlines()
    header = metrics[0].split(",")
    rows = [dict(zip(header, line.split(","))) for line in metrics[1:]]
    epochs = [r for r in rows if r["val/select"]]
    assert len(epochs) >= 2  # each epoch's, then the exported checkpoint's validation
    for r in epochs:  # the epoch's held-out NLL, weighted by examples as Lightning's epoch mean of val/loss is
        expected = float(r["val/metric"]) if select_on == "metric" else -float(r["val/loss"])
        assert float(r["val/select"]) == pytest.approx(expected, abs=1e-5)
