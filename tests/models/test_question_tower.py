"""The trained reader's question tower (`tune_layers`): an untrained tower reads exactly as the frozen encoder does,
the export carries the tuned layers and loads them (not a fresh copy of the encoder's), the reader stage trains them
at their own learning rate over the cached lower-layer states, and a tower the encoder cannot give is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from persrag_lightning.commands.train import lightning_command
from persrag_lightning.models.question_tower import QuestionTower, lower_states, pad_states
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.modules.optim import OptimizerSettings, adamw
from persrag_lightning.reading.trained import TrainedReader
from tests.helpers.reader import labelled_docs, tiny_reader
from tests.modules.test_reader_stage import fit_args

TEXTS = ["a short one", "a much longer question about the magazine's print quality and its late delivery", "ok"]


@pytest.mark.parametrize("n", [1, 2])
def test_an_untrained_tower_gives_the_frozen_encoders_vectors(tiny_bert, n, one_thread):
    encoder = TextEncoder.from_pretrained(tiny_bert, max_length=32)
    tower = QuestionTower(encoder, n).eval()
    states = lower_states(encoder, TEXTS, n)
    assert [len(s) for s in states] == [int(m.sum()) for m in encoder.tokenize(TEXTS)["attention_mask"]]
    with torch.no_grad():
        vectors = tower(*pad_states(states))  # padded to the longest: padding changes nothing
    # the states are rounded to bfloat16 (as the DataModule stores them), the rest is the encoder's own arithmetic
    assert torch.allclose(vectors, encoder.encode(TEXTS), atol=2e-2)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(len(TEXTS)))


def test_a_tower_the_encoder_does_not_have_is_refused(tiny_bert):
    encoder = TextEncoder.from_pretrained(tiny_bert, max_length=32)
    for n in (0, 3):  # tiny_bert has 2 layers
        with pytest.raises(ValueError, match="tune_layers"):
            QuestionTower(encoder, n)


def test_the_export_carries_the_tuned_layers_and_loads_them(tmp_path, tiny_bert, one_thread):
    reader = tiny_reader(tiny_bert, "LaMP-3", tune_layers=1)
    with torch.no_grad():  # as if trained: the tower no longer equals the encoder's top layer
        for p in reader.tower.parameters():
            p.add_(0.05 * torch.randn_like(p))
    docs = [labelled_docs("LaMP-3", ["fine", "awful"], ["4", "1"])] * len(TEXTS)
    before = reader.log_probs(TEXTS, docs)
    export = reader.save_pretrained(tmp_path / "reader")
    assert json.loads((export / "config.json").read_text())["tune_layers"] == 1
    weights = load_file(str(export / "reader.safetensors"))
    assert any(k.startswith("tower.") for k in weights) and not any(k.startswith("encoder.") for k in weights)
    loaded = TrainedReader(export).model
    assert torch.allclose(loaded.log_probs(TEXTS, docs), before, atol=1e-5)
    frozen = tiny_reader(tiny_bert, "LaMP-3")  # the frozen design reads the same question otherwise
    assert not torch.allclose(loaded.embed_questions(TEXTS), frozen.embed(TEXTS), atol=1e-3)


def test_the_tuned_layers_train_at_their_own_learning_rate():
    model = torch.nn.ModuleDict({"tower": torch.nn.Linear(2, 2), "fusion": torch.nn.Linear(2, 2)})
    optimizer = adamw(model.named_parameters(), OptimizerSettings(lr=1e-3, weight_decay=0.01), 10,
                      lr_of=lambda name: 5e-5 if name.startswith("tower.") else None)
    groups = {(g["lr"], g["weight_decay"]): len(g["params"]) for g in optimizer.param_groups}
    assert groups == {(1e-3, 0.01): 1, (5e-5, 0.01): 1, (1e-3, 0.0): 1, (5e-5, 0.0): 1}


def test_the_reader_stage_tunes_the_top_layer_over_cached_states(in_tmp_cwd, tiny_bert, one_thread):
    lightning_command(fit_args(tiny_bert, "LaMP-3", 2, "--model.init_args.config.tune_layers=1",
                               "--model.init_args.tune_lr=1e-3"))
    export = in_tmp_cwd / "checkpoints" / "t" / "reader"
    cache = next((in_tmp_cwd / ".cache" / "persrag" / "reader_data").rglob("question-states-top1.safetensors"))
    stored = json.loads((cache.parent / "examples.json").read_text())
    texts = json.loads(cache.with_name(cache.name + ".json").read_text())["texts"]
    assert set(texts) == {r["text"] for rows in stored["splits"].values() for r in rows}  # every question, no doc
    tuned = load_file(str(export / "reader.safetensors"))
    top = TextEncoder.from_pretrained(tiny_bert).model.encoder.layer[-1].state_dict()
    assert set(top) == {k.removeprefix("tower.layers.0.") for k in tuned if k.startswith("tower.")}
    assert any(not torch.equal(tuned[f"tower.layers.0.{k}"], v) for k, v in top.items())  # it trained
    reader = TrainedReader(export)
    reading = reader.read("LaMP-3", TEXTS, [labelled_docs("LaMP-3", ["fine"], ["4"])] * len(TEXTS))
    assert len(reading.answers) == len(TEXTS) and set(reading.answers) <= {"1", "2", "3", "4", "5"}
