"""One door for reading: label scores are read only behind `reading/` (a static check over the package that fails
if another path returns), and evaluation, feedback labels, the generator's validation and serving all read through
the reader they are given, the trained reader as well as the LLM."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading.llm import LLMReader
from persrag_lightning.reading.trained import TrainedReader
from tests.conftest import REPO
from tests.helpers.reader import tiny_reader_export

PACKAGE = REPO / "persrag_lightning"
DOOR = ("reading/", "llm/")  # the readers, and the LLM backends they read with
# an LLM is called for its speed here and its scores are thrown away (the time-budget planner's probe)
SPEED_PROBES = {"pipeline/rates.py": "reader_rates"}
REMOVED = {"choose_labels", "read_labels"}  # the label paths the one door replaced


# ---- the static check ---------------------------------------------------------------------------------------

def _receiver(node: ast.AST) -> str:
    return ast.unparse(node)


def label_score_calls(tree: ast.AST, path: str) -> list[str]:
    """`x.score_options(...)` anywhere, and `<...llm>.score(...)` (an LLM's log p of a target), outside a function
    that is itself a backend's `score`/`score_options` (a wrapper delegating to another backend)."""
    hits = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and function not in ("score", "score_options") and SPEED_PROBES.get(path) != function):
            name, receiver = node.func.attr, _receiver(node.func.value)
            if name == "score_options" or (name == "score" and receiver.lower().endswith("llm")):
                hits.append(f"{path}:{node.lineno} {receiver}.{name}(")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    return hits


def removed_paths(tree: ast.AST, path: str) -> list[str]:
    """Names of the removed label paths, a `choose` on an LLM class, `LLMConfig.answer`/`read_labels`/`score`, and
    a module-level `answer` in llm/answer.py."""
    hits = []
    for node in ast.walk(tree):
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.name if isinstance(node, (ast.FunctionDef, ast.alias)) else None)
        if name in REMOVED:
            hits.append(f"{path}:{getattr(node, 'lineno', 0)} {name}")
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            methods = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if (any(b.endswith("LLM") for b in bases) or node.name == "LLM") and "choose" in methods:
                hits.append(f"{path}:{node.lineno} {node.name}.choose")
            if node.name == "LLMConfig" and methods & {"answer", "read_labels", "score"}:
                hits.append(f"{path}:{node.lineno} LLMConfig.{sorted(methods & {'answer', 'read_labels', 'score'})}")
    if path == "llm/answer.py":
        hits += [f"{path}:{f.lineno} answer" for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "answer"]
    return hits


def package_files() -> list[tuple[str, ast.AST]]:
    return [(p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def test_label_scores_are_read_only_behind_the_reader_door():
    hits = [h for path, tree in package_files() if not path.startswith(DOOR) for h in label_score_calls(tree, path)]
    assert not hits, f"label scores read outside reading/ (read them through a Reader): {hits}"
    hits = [h for path, tree in package_files() for h in removed_paths(tree, path)]
    assert not hits, f"a removed label path is back (read through persrag_lightning.reading): {hits}"
    from persrag_lightning.llm.base import LLM

    assert not hasattr(LLM, "choose") and not any(hasattr(LLMConfig, n) for n in ("answer", "read_labels", "score"))


@pytest.mark.parametrize(("source", "path", "hit"), [
    ("def f(llm, p):\n    return llm.score_options(p, ['a'])\n", "evaluation/x.py", "llm.score_options("),
    ("def f(self, p, t):\n    return self.llm.score(p, t)\n", "feedback/x.py", "self.llm.score("),
    ("def reader_rates(llm):\n    llm.score(['p'], ['t'])\n", "commands/other.py", "llm.score("),
])
def test_the_static_check_finds_a_path_around_the_door(source, path, hit):
    assert [h.split(" ", 1)[1] for h in label_score_calls(ast.parse(source), path)] == [hit]


@pytest.mark.parametrize("source", [
    "from persrag_lightning.llm.answer import choose_labels\n",
    "def f(config, llm):\n    return config.read_labels(llm)\n",
    "class HFLLM(LLM):\n    def choose(self, prompts, options):\n        pass\n",
    "class LLMConfig:\n    def answer(self, llm):\n        pass\n",
])
def test_the_static_check_finds_a_removed_path(source):
    assert removed_paths(ast.parse(source), "llm/x.py")
    assert removed_paths(ast.parse("def answer(llm, task, prompts):\n    pass\n"), "llm/answer.py")
    assert not removed_paths(ast.parse("class Job:\n    def choose(self):\n        pass\n"), "commands/x.py")
    assert not label_score_calls(ast.parse("def score(self, p, t):\n    return self.pipeline.llm.score(p, t)\n"),
                                 "serving/x.py")  # a backend wrapping another


READERS = ("LLMReader", "TrainedReader")
OPENER = "reading/open.py"  # the one place a reader is built


def reader_constructions(tree: ast.AST, path: str) -> list[str]:
    """Calls of a reader class (`LLMReader(...)`, `x.TrainedReader(...)`)."""
    return [f"{path}:{node.lineno} {ast.unparse(node.func)}(" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] in READERS]


def test_readers_are_built_only_by_open_reader():
    hits = [h for path, tree in package_files() if path != OPENER for h in reader_constructions(tree, path)]
    assert not hits, f"a reader built outside open_reader (open it with reading.open_reader): {hits}"
    assert reader_constructions(ast.parse("r = reading.LLMReader(config, llm=llm)\n"), "serving/x.py")


def test_open_reader_hands_a_loaded_llm_to_the_llm_reader_only(tmp_path):
    from persrag_lightning.reading import LLM_READER, open_reader

    llm = object()  # a generator's model under training, serving's LLM shared with chat
    reader = open_reader(LLM_READER, LLMConfig(answer_mode="choose"), llm=llm, remember_terms=False)
    assert isinstance(reader, LLMReader) and reader.llm is llm and not reader.remember_terms and reader.store is None
    with pytest.raises(ValueError, match="without an LLM"):
        open_reader(str(tmp_path), llm=llm)


def test_the_words_of_reading_import_no_llm_code():
    """llm/registry.py checks its settings with reading.decision: importing it (and the reading package) must not
    import llm/ back, or the two would import each other."""
    import subprocess
    import sys

    code = ("import sys, persrag_lightning.reading.decision, persrag_lightning.reading.label_reading; "
            "print(sorted(m for m in sys.modules if m.startswith(('persrag_lightning.llm', 'persrag_lightning.models'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
    subprocess.run([sys.executable, "-c", "import persrag_lightning.llm.registry"], check=True, cwd=REPO)


# ---- the callers read through their reader ----------------------------------------------------------------------

def record(monkeypatch, cls: type, name: str) -> list[tuple[tuple, dict]]:
    """Each call of `cls.name` (args without self, kwargs), the method still run."""
    calls: list[tuple[tuple, dict]] = []
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        calls.append((args, kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return calls


@pytest.fixture()
def no_llm(monkeypatch):
    """A trained reader reads without an LLM: loading one fails the test."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("an LLM was loaded where the trained reader reads")

    monkeypatch.setattr(LLMConfig, "load", refuse)


USERS = 12


def evaluation(tmp_path: Path, **kwargs):
    from persrag_lightning.evaluation.evaluate import Evaluation

    return Evaluation(task="LaMP-2", synth=SynthConfig(num_users=USERS), cache_dir=str(tmp_path / "cache"), k=3,
                      max_examples=4, out_dir=str(tmp_path / "eval"), reader_free=False, reference="bm25", **kwargs)


def test_the_evaluation_reads_every_row_through_the_trained_reader(tmp_path, tiny_bert, monkeypatch, no_llm,
                                                                  one_thread):
    from persrag_lightning.retrieval.baselines import BM25

    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    reads = record(monkeypatch, TrainedReader, "read")
    ev = evaluation(tmp_path, reader=str(export))
    results = ev.run([BM25()]).results
    assert len(reads) == 1
    (task, inputs, docs), kwargs = reads[0]
    assert task == "LaMP-2" and len(inputs) == 4 and all(0 < len(ds) <= 3 for ds in docs)
    assert kwargs["every_calibration"] is True
    answers = TrainedReader(export).answer(task, inputs, docs)
    predictions = json.loads((tmp_path / "eval" / "predictions" / "bm25.json").read_text())
    assert [g["output"] for g in predictions["golds"]] == answers and set(answers) <= set(LAMP2_LABELS)
    labels = json.loads((tmp_path / "eval" / "predictions" / "bm25.labels.json").read_text())
    assert labels["calibration"] == "none" and [r["answer"] for r in labels["rows"]] == answers
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["reader"] == str(export) and metrics["reading"] == {"calibration": "none", "decision": "argmax"}
    assert "trained reader" in (tmp_path / "eval" / "results.md").read_text()
    assert 0.0 <= results["bm25"]["accuracy"] <= 1.0


def test_the_evaluation_reads_through_the_llm_reader(tmp_path, tiny_llm, monkeypatch, one_thread):
    from persrag_lightning.retrieval.baselines import BM25

    reads = record(monkeypatch, LLMReader, "read_prompts")
    ev = evaluation(tmp_path, llm=LLMConfig(model=tiny_llm, answer_mode="choose", calibration="contextual",
                                            options={"device": "cpu"}))
    ev.run([BM25()])
    assert len(reads) == 1 and reads[0][0][0] == "LaMP-2" and len(reads[0][0][1]) == 4
    assert reads[0][1]["every_calibration"] is True
    labels = json.loads((tmp_path / "eval" / "predictions" / "bm25.labels.json").read_text())
    assert labels["calibration"] == "contextual" and set(labels["terms"]) == {"none", "contextual", "pmi"}


@pytest.mark.parametrize("metric", ["loglik", "task"])
def test_feedback_labels_come_from_the_trained_reader(tmp_path, tiny_bert, tiny_llm, monkeypatch, no_llm, metric,
                                                      one_thread):
    from tests.helpers.feedback import datamodule, feedback_world

    root = feedback_world(tmp_path, tiny_bert)
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    calls = record(monkeypatch, TrainedReader, "score_targets" if metric == "loglik" else "read")
    builder = datamodule(root, tiny_bert, tiny_llm, feedback={"reader": str(export), "metric": metric}).builder()
    examples = builder.examples("train")[:2]
    records = builder.label_chunk(examples)
    assert len(calls) == 1 and builder.llm_calls == 0
    reader = TrainedReader(export)
    for example, record_ in zip(examples, records):
        assert len(record_.candidates) == 6  # m x k, each read alone (Eq. 6)
        for c in record_.candidates:
            docs = [[builder.store.history_doc(c.row)]]
            if metric == "loglik":
                want = reader.score_targets("LaMP-2", [example.input], docs, [example.target])[0]
                assert c.label == pytest.approx(want, abs=1e-5) and c.label < 0 and math.isfinite(c.label)
            else:
                answer, = reader.answer("LaMP-2", [example.input], docs)
                assert c.output == answer and c.label == float(answer == example.target)
    other = datamodule(root, tiny_bert, tiny_llm, feedback={"metric": metric}).builder()
    assert other.key != builder.key  # the reader is part of the labels' cache key


def test_the_generators_validation_reads_through_the_llm_reader_under_every_calibration(tiny_llm, monkeypatch,
                                                                                        one_thread):
    """Validation reads dev prompts as the evaluation reads a tuned generator (the LLM reader, its own model under
    training), every calibration from one reading; val/metric is the best calibration's, as the dev choice takes."""
    from types import SimpleNamespace

    from persrag_lightning.datamodules.generator import GeneratorBatch
    from persrag_lightning.modules.generator import GeneratorModule

    module = GeneratorModule(model=tiny_llm, lora_r=4, answer_mode="choose", eval_batch_size=4)
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(task="LaMP-2", hparams={}))
    module.setup("fit")
    logged: dict[str, float] = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.__setitem__(name, float(value.detach())))
    reads = record(monkeypatch, LLMReader, "read_prompts")
    batch = GeneratorBatch(["e1", "e2", "e3"], ["which tag? a film about a heist", "which tag? a ghost story",
                                                "which tag? two friends fall in love"], ["crime", "horror", "romance"])
    module.eval()
    module.validation_step(batch, 0)
    module.on_validation_epoch_end()
    assert module.reader.llm is module.backend  # the model under training, not a copy loaded from disk
    assert len(reads) == 1 and reads[0][0] == ("LaMP-2", batch.prompts) and reads[0][1]["every_calibration"]
    by = {c: logged[f"val/{c}/accuracy"] for c in ("none", "contextual", "pmi")}
    assert logged["val/metric"] == logged["val/accuracy"] == max(by.values())
    assert "val/loss" in logged


def synth_dataset(tmp_path: Path, monkeypatch):
    """SynthLaMP for a pipeline over BM25 (the reader is what is tested; CFRAG's bundles are tests/serving's)."""
    from persrag_lightning.data.source import LampSource
    from persrag_lightning.serving import cfrag_pipeline

    monkeypatch.setattr(cfrag_pipeline, "all_exported", lambda strategy: False)  # BM25 runs no exported encoder
    source = LampSource("LaMP-2", None, SynthConfig(num_users=USERS), str(tmp_path / "cache"))
    source.prepare()
    return source.load()


def test_serving_answers_with_the_trained_reader(tmp_path, tiny_bert, monkeypatch, no_llm, one_thread):
    from persrag_lightning.retrieval.base import DocStore
    from persrag_lightning.retrieval.baselines import BM25
    from persrag_lightning.serving import CFRAGPipeline

    dataset = synth_dataset(tmp_path, monkeypatch)
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    answers = record(monkeypatch, TrainedReader, "answer")
    pipeline = CFRAGPipeline(BM25(), DocStore(dataset), k=3, reader=str(export))
    question = dataset.examples["test"][0]
    out = pipeline.generate(question.user_id, question.input)
    assert len(answers) == 1 and answers[0][0][:2] == ("LaMP-2", [question.input])
    assert isinstance(pipeline.reader, TrainedReader) and out.answer in LAMP2_LABELS
    docs = [pipeline.store.history_doc(d.row) for d in out.docs]
    assert out.answer == TrainedReader(export).answer("LaMP-2", [question.input], [docs])[0]
    assert out.prompt == question.query  # what the trained reader reads of the question


def test_serving_opens_a_trained_reader_at_load_in_the_query_encoders_runtime(tmp_path, tiny_bert, monkeypatch,
                                                                              one_thread):
    """The trained reader is opened with the pipeline (no question waits for its export or compile), its text
    encoder in the query encoder's exported runtime; a strategy that embeds no query leaves it in torch."""
    pytest.importorskip("openvino")
    pytest.importorskip("onnx")
    from types import SimpleNamespace

    from persrag_lightning.retrieval.base import DocStore
    from persrag_lightning.retrieval.baselines import BM25
    from persrag_lightning.serving import CFRAGPipeline

    dataset = synth_dataset(tmp_path, monkeypatch)
    export = str(tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2"))
    plain = CFRAGPipeline(BM25(), DocStore(dataset), k=3, reader=export)
    assert isinstance(plain._reader, TrainedReader) and plain._reader.model.text_runtime == "fp32"
    strategy = BM25()
    strategy.retriever, strategy.cache_dir = SimpleNamespace(query_runtime="openvino"), str(tmp_path / "cache")
    served = CFRAGPipeline(strategy, DocStore(dataset), k=3, reader=export)
    assert served._reader.model.text_runtime == "openvino"
    assert list((tmp_path / "cache" / "onnx").glob("reader-text-*.onnx"))
    question = dataset.examples["test"][0]
    assert served.generate(question.user_id, question.input).answer in LAMP2_LABELS


def test_serving_answers_with_the_llm_reader(tmp_path, tiny_llm, monkeypatch, one_thread):
    from persrag_lightning.retrieval.base import DocStore
    from persrag_lightning.retrieval.baselines import BM25
    from persrag_lightning.serving import CFRAGPipeline

    dataset = synth_dataset(tmp_path, monkeypatch)
    reads = record(monkeypatch, LLMReader, "read_prompts")
    llm = LLMConfig(model=tiny_llm, answer_mode="choose", options={"device": "cpu"})
    pipeline = CFRAGPipeline(BM25(), DocStore(dataset), llm=llm, k=3)
    question = dataset.examples["test"][0]
    out = pipeline.generate(question.user_id, question.input)
    assert len(reads) == 1 and reads[0][0] == ("LaMP-2", [out.prompt]) and out.answer in LAMP2_LABELS
    assert pipeline.reader.llm is pipeline.llm  # the chat's LLM, loaded once
