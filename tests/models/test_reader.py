"""The trained reader's model on tiny configs: label-head shapes, the cumulative-link head as a proper distribution,
the NLL loss learning a separable problem, decisions through `TrainedReader`, and the export/load round trip with
its refusals (another encoder's vectors, weights that do not fit their config)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.datamodules.reader import ReaderTrainBatch
from persrag_lightning.models.reader import (
    READER_WEIGHTS,
    LabelReader,
    ReaderConfig,
    ReaderSettings,
    cumulative_link_log_probs,
)
from persrag_lightning.models.reader_inputs import ReaderBatch
from persrag_lightning.modules.reader import ReaderModule
from persrag_lightning.reading.decision import decide
from persrag_lightning.reading.trained import TrainedReader
from persrag_lightning.utils import ConfigError
from tests.helpers.reader import labelled_docs, tiny_config, tiny_reader, tiny_reader_export

E = 8  # the vectors' width in tests that feed tensors directly


def random_batch(n: int, k: int, n_labels: int, seed: int = 0) -> ReaderBatch:
    """Random vectors and labels; question i has i % (k + 1) docs (some none at all)."""
    g = torch.Generator().manual_seed(seed)
    present = torch.arange(k)[None, :] < (torch.arange(n) % (k + 1))[:, None]
    labels = torch.randint(0, n_labels + 1, (n, k), generator=g) * present
    return ReaderBatch(torch.randn(n, E, generator=g), torch.randn(n, k, E, generator=g), labels, present)


# ---- heads ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("task", "head", "n_labels", "ordinal"), [
    ("LaMP-2", "auto", len(LAMP2_LABELS), False),
    ("LaMP-1", "auto", 2, False),
    ("LaMP-3", "auto", 5, True),
    ("LaMP-3", "softmax", 5, False),
    ("LaMP-3", "ordinal", 5, True),
])
def test_label_head_shapes(task, head, n_labels, ordinal, one_thread):
    torch.manual_seed(0)
    model = LabelReader(tiny_config(task, E, head=head)).eval()
    assert model.config.ordinal is ordinal
    assert model.score.out_features == (1 if ordinal else n_labels)  # ordinal: one score f, thresholds apart
    with torch.no_grad():
        out = model(random_batch(7, 3, n_labels))
    assert out.shape == (7, n_labels)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.exp().sum(-1), torch.ones(7), atol=1e-5)
    assert len({tuple(row) for row in out.round(decimals=4).tolist()}) > 1  # rows depend on their inputs


def test_a_generation_task_has_no_reader():
    with pytest.raises(ValueError, match="LaMP-5"):
        LabelReader(ReaderConfig(task="LaMP-5", labels=()))


@settings(max_examples=150, deadline=None)
@given(f=st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=6),
       first=st.floats(-1e3, 1e3),
       gaps=st.lists(st.floats(-50, 50), min_size=3, max_size=3))
def test_the_ordinal_head_is_a_distribution_for_any_input(f, first, gaps):
    """Cumulative link over the model's own threshold parametrisation: ordered thresholds whatever the raw
    parameters, probabilities non-negative and summing to 1 whatever the score."""
    model = LabelReader(tiny_config("LaMP-3", E))
    with torch.no_grad():
        model.first_threshold.fill_(first)
        model.threshold_gaps.copy_(torch.tensor(gaps))
        thresholds = model.thresholds()
        log_p = cumulative_link_log_probs(torch.tensor(f), thresholds)
    assert thresholds.shape == (4,) and (thresholds[1:] > thresholds[:-1]).all()
    p = log_p.exp()
    assert log_p.shape == (len(f), 5) and not torch.isnan(log_p).any()
    assert (p >= 0).all() and torch.allclose(p.sum(-1), torch.ones(len(f)), atol=1e-5)


def test_the_ordinal_head_moves_mass_up_the_labels_as_its_score_grows():
    """P(y <= j) = sigma(theta_j - f): a larger f puts more mass on higher labels (the expected label grows)."""
    thresholds = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    p = cumulative_link_log_probs(torch.linspace(-4, 4, 9), thresholds).exp()
    expected = (p * torch.arange(1, 6)).sum(-1)
    assert (expected[1:] > expected[:-1]).all()
    assert p[0].argmax() == 0 and p[-1].argmax() == 4 and p[4].argmax() == 2


# ---- the loss learns ------------------------------------------------------------------------------------------

def separable(task: str, n: int = 64, k: int = 3, seed: int = 0) -> ReaderTrainBatch:
    """LaMP-2: the gold is the label of the first doc (read only through the label embedding); LaMP-3: the gold is
    the fifth of a fixed projection of the question's vector (ordered buckets)."""
    g = torch.Generator().manual_seed(seed)
    question, docs = torch.randn(n, E, generator=g), torch.randn(n, k, E, generator=g)
    if task == "LaMP-2":
        labels = torch.randint(1, len(LAMP2_LABELS) + 1, (n, k), generator=g)
        targets = labels[:, 0] - 1
    else:
        labels = torch.randint(1, 6, (n, k), generator=g)
        score = question @ torch.randn(E, generator=g)
        targets = torch.bucketize(score, score.quantile(torch.tensor([0.2, 0.4, 0.6, 0.8])))
    return ReaderTrainBatch(ReaderBatch(question, docs, labels, torch.ones(n, k, dtype=torch.bool)), targets)


@pytest.mark.parametrize("task", ["LaMP-2", "LaMP-3"])
def test_the_nll_loss_falls_on_a_separable_problem(task, one_thread):
    module = ReaderModule(ReaderSettings(dim=32, layers=1, heads=2, dropout=0.0))
    torch.manual_seed(0)
    module.model = LabelReader(tiny_config(task, E, dim=32, heads=2))
    batch = separable(task)
    optimizer = torch.optim.Adam(module.model.parameters(), lr=1e-2)
    first = module.loss(batch).item()
    assert first == pytest.approx(-(module.model(batch.batch).gather(1, batch.targets[:, None])).mean().item())
    for _ in range(300):
        loss = module.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    module.model.eval()
    with torch.no_grad():
        last = module.loss(batch).item()
        accuracy = (module.model(batch.batch).argmax(-1) == batch.targets).float().mean().item()
    assert last < 0.25 * first, (first, last)
    assert accuracy >= 0.9


# ---- decisions through TrainedReader ---------------------------------------------------------------------------

# LaMP-3: arg max 5, median 4 (cumulative .35 .40 .45 .60), mean 3.2 → 3
SPLIT = [0.35, 0.05, 0.05, 0.15, 0.40]


def fixed_log_probs(rows: list[list[float]]):
    def log_probs(self, inputs, docs):
        assert len(inputs) == len(docs)
        return torch.tensor(rows[:len(inputs)]).log()

    return log_probs


@pytest.mark.parametrize(("decision", "answer"), [("auto", "4"), ("median", "4"), ("argmax", "5"), ("mean", "3")])
def test_lamp3_answers_by_the_decision_rule(tmp_path, tiny_bert, monkeypatch, decision, answer):
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-3")
    monkeypatch.setattr(LabelReader, "log_probs", fixed_log_probs([SPLIT]))
    reader = TrainedReader(export, decision=decision)
    docs = [labelled_docs("LaMP-3", ["fine"], ["4"])]
    reading = reader.read("LaMP-3", ["review: ok"], docs)
    assert reading.answers == [answer] == reader.answer("LaMP-3", ["review: ok"], docs)
    assert reading.calibration == "none" and reading.terms is None
    assert reading.decision == ("median" if decision == "auto" else decision)
    assert reading.probabilities[0] == pytest.approx(SPLIT)
    assert reader.reading("LaMP-3")["decision"] == reading.decision


def test_lamp2_answers_the_arg_max_and_refuses_an_ordered_decision(tmp_path, tiny_bert, monkeypatch):
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    rows = [[0.01] * 15 for _ in range(2)]
    rows[0][3], rows[1][11] = 0.5, 0.3  # the rest spread evenly
    rows = [[p / sum(r) for p in r] for r in rows]
    monkeypatch.setattr(LabelReader, "log_probs", fixed_log_probs(rows))
    docs = [labelled_docs("LaMP-2", ["a"], ["comedy"])] * 2
    assert TrainedReader(export).answer("LaMP-2", ["description: x", "description: y"], docs) == \
        [LAMP2_LABELS[3], LAMP2_LABELS[11]]
    with pytest.raises(ValueError, match="ordered labels"):
        TrainedReader(export, decision="median").read("LaMP-2", ["description: x"], docs[:1])


def test_a_trained_reader_reads_its_own_task_only_and_scores_targets(tmp_path, tiny_bert, one_thread):
    reader = TrainedReader(tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-3"))
    inputs = ["review: the print edition arrived late", "review: a great read every month"]
    docs = [labelled_docs("LaMP-3", ["late again", "never came"], ["2", "1"]), []]
    rows = reader.model.log_probs(inputs, docs).tolist()
    reading = reader.read("LaMP-3", inputs, docs)
    assert torch.allclose(torch.tensor(reading.log_scores), torch.tensor(rows))
    assert reading.answers == [decide(("1", "2", "3", "4", "5"), [math.exp(v) for v in r], "median") for r in rows]
    assert reader.score_targets("LaMP-3", inputs, docs, ["2", "4.0"]) == pytest.approx([rows[0][1], rows[1][3]])
    assert reader.score_targets("LaMP-3", inputs[:1], docs[:1], ["7"]) == [float("-inf")]
    assert reader.prompts("LaMP-3", inputs, docs)[0] == "the print edition arrived late"  # the query it reads
    with pytest.raises(ConfigError, match="trained on LaMP-3, not LaMP-2"):
        reader.read("LaMP-2", ["description: x"], [[]])
    with pytest.raises(FileNotFoundError, match="reader.yaml"):
        TrainedReader(tmp_path / "nowhere")


# ---- export and load ---------------------------------------------------------------------------------------------

INPUTS = ["description: a detective hunts a killer", "description: two friends open a bakery"]
DOCS = [labelled_docs("LaMP-2", ["a murder in the fog", "a heist", "a ghost"], ["crime", "action", "horror"]),
        labelled_docs("LaMP-2", ["a wedding"], ["romance"])]


def test_export_and_load_give_the_same_log_probs(tmp_path, tiny_bert, one_thread):
    model = tiny_reader(tiny_bert, "LaMP-2", seed=0)
    want = model.log_probs(INPUTS, DOCS)
    model.save_pretrained(tmp_path / "reader")
    weights = load_file(str(tmp_path / "reader" / READER_WEIGHTS))
    assert weights and not any(k.startswith("encoder.") for k in weights)  # the encoder is named, not copied
    torch.manual_seed(1)  # another initialisation: only the loaded weights can give the same numbers
    loaded = LabelReader.from_pretrained(tmp_path / "reader").eval()
    assert loaded.config == model.config
    assert torch.allclose(loaded.log_probs(INPUTS, DOCS), want, atol=1e-6)
    other = tiny_reader(tiny_bert, "LaMP-2", seed=1)
    assert not torch.allclose(other.log_probs(INPUTS, DOCS), want, atol=1e-3)  # the check above can fail
    assert torch.allclose(torch.tensor(TrainedReader(tmp_path / "reader").read("LaMP-2", INPUTS, DOCS).log_scores),
                          want, atol=1e-6)


def test_an_export_read_with_another_encoders_vectors_is_refused(tmp_path, tiny_bert, one_thread):
    encoder = tmp_path / "encoder"
    shutil.copytree(tiny_bert, encoder)
    tiny_reader_export(tmp_path / "reader", str(encoder), "LaMP-2")
    LabelReader.from_pretrained(tmp_path / "reader")  # the same encoder loads
    from transformers import BertModel

    bert = BertModel.from_pretrained(encoder)
    torch.manual_seed(5)
    for p in bert.parameters():
        torch.nn.init.normal_(p, std=0.02)
    bert.save_pretrained(encoder)  # the encoder retrained in place: same path and name, other vectors
    with pytest.raises(ValueError, match="another") as refused:
        LabelReader.from_pretrained(tmp_path / "reader")
    assert str(tmp_path / "reader") in str(refused.value) and "retrain" in str(refused.value)
    with pytest.raises(ValueError, match="another"):
        TrainedReader(tmp_path / "reader").read("LaMP-2", INPUTS, DOCS)


@pytest.mark.parametrize("change", [{"layers": 2}, {"dim": 32}, {"head": "ordinal"}, {"max_docs": 5}])
def test_weights_that_do_not_fit_their_config_are_refused(tmp_path, tiny_bert, change, one_thread):
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match="does not fit its config.json") as refused:
        LabelReader.from_pretrained(export)
    assert str(export) in str(refused.value)


def test_a_reader_of_one_folders_labels_refuses_another_folders(tmp_path, tiny_bert, monkeypatch, one_thread):
    """Two converted folders of `--task labels` share the task's name, not its labels: a reader trained on one
    label set must not read questions of another as if the labels were its own."""
    from persrag_lightning.data import tasks

    monkeypatch.setattr(tasks, "_FOLDER_TASKS", {})
    tasks.define_task({"name": "labels", "labels": ["arts", "crime", "sports"]})
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "labels")
    docs = [labelled_docs("labels", ["a match"], ["sports"])]
    assert TrainedReader(export).answer("labels", ["text: a goal"], docs)[0] in ("arts", "crime", "sports")
    tasks.define_task({"name": "labels", "labels": ["arts", "crime", "weather"]})
    with pytest.raises(ConfigError, match="labels"):
        TrainedReader(export).read("labels", ["text: a storm"], [[]])


def test_the_readers_text_encoder_runs_exported_and_back(tmp_path, tiny_bert, one_thread):
    """use_text_runtime embeds through the frozen encoder's ONNX export (made once per encoder under the cache
    folder, OpenVINO's one dynamic-shape model) within bf16's tolerance of torch, names the runtime in the trained
    reader's identity (cache keys), and fp32 gives torch's vectors back exactly; an unknown runtime is refused."""
    pytest.importorskip("openvino")
    pytest.importorskip("onnx")
    from persrag_lightning.models import exported

    reader = TrainedReader(tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2"))
    model = reader.model
    texts = ["a film about a heist", "a long " + "and winding " * 8 + "road movie", "space"]
    want = model.embed(texts)
    fp32_identity = reader.identity()
    reader.use_text_runtime("openvino", str(tmp_path / "cache"))
    got = model.embed(texts)
    assert model.text_runtime == "openvino" and not isinstance(model._text_session, exported.StaticShapes)
    assert got.shape == want.shape and (got - want).abs().max() < 0.05
    assert reader.identity() == {**fp32_identity, "text_runtime": "openvino"}
    made = list((tmp_path / "cache" / "onnx").glob("reader-text-*.onnx"))
    assert len(made) == 1
    mtime = made[0].stat().st_mtime_ns
    TrainedReader(tmp_path / "reader").use_text_runtime("openvino", str(tmp_path / "cache"))
    assert made[0].stat().st_mtime_ns == mtime  # read, not exported again
    reader.use_text_runtime("fp32")
    assert torch.equal(model.embed(texts), want) and reader.identity() == fp32_identity
    with pytest.raises(ValueError, match="text runtime"):
        reader.use_text_runtime("int4")
