"""Serving follows the record: `CFRAGPipeline.from_pretrained(run)` serves what the run's pipeline.json says its
table's reference row was (the docs' order, the reader, the reading), an explicit argument wins, a run without a
record keeps the defaults, and a malformed record is refused naming the file and the field."""

from __future__ import annotations

import json
import shutil

import pytest

from persrag_lightning.record import CONFIGURATIONS, TABLE, Configuration, read_reference
from persrag_lightning.serving import CFRAGPipeline
from persrag_lightning.utils import ConfigError
from tests.conftest import tiny_serving_run

pytestmark = pytest.mark.usefixtures("one_thread")

USERS = 24  # the smoke preset's, so its table's evaluation reads the users the tiny run's stage 1 trained on
FIRST_STAGE = "CFRAG (judgment profile, first-stage order)"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_bert):
    """A tiny run (stage 1 trained, untrained retriever and reranker, a tiny trained reader) whose pipeline.json is
    the smoke preset's record with its fits and evaluations stood in for: dev chose the trained reader and the
    first-stage order."""
    from tests.commands.test_pipeline_recipe import run_pipeline
    from tests.helpers.reader import tiny_reader_export

    root = tmp_path_factory.mktemp("recorded")
    args = ["fit", "--config", "cfrag_user_encoder.yaml", "--run_name", "t", f"--data.init_args.encoder={tiny_bert}",
            f"--data.init_args.synth.num_users={USERS}", "--trainer.max_epochs=1", "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false"]
    run = tiny_serving_run(root, args, "t", tiny_bert)
    tiny_reader_export(run / "reader", tiny_bert, "LaMP-2")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        run_pipeline(patch, run.parent, ["--preset", "smoke", "--run_name", "t"], {"w/o reranker tuning": 0.9})
    return run


def served(run, **kwargs) -> CFRAGPipeline:
    """The pipeline over `run` with the evaluation's exact encoders; every other setting left to the defaults."""
    return CFRAGPipeline.from_pretrained(run, cache_dir=str(run.parent.parent / ".cache" / "persrag"),
                                         reranker_runtime="fp32", query_runtime="fp32", cache_doc_tokens=False,
                                         **kwargs)


def test_the_record_of_a_pipeline_run_says_what_its_reference_row_served(recorded):
    ref = read_reference(recorded)
    assert ref.path == recorded / "pipeline.json" and ref.row == FIRST_STAGE and ref.task == "LaMP-2"
    assert ref.configuration == Configuration(None) and ref.reader == "reader" and ref.answer_mode == "choose"
    assert ref.gemm == "torch"  # the suite's PERSRAG_GEMM, as the run's decisions kept it
    assert read_reference(recorded / "user_encoder") is None  # no record there


def test_served_answers_equal_the_evaluations_reference_row_one_by_one(recorded, capsys):
    """The table's reference row evaluated as the record ran it, on the test questions; the pipeline loaded with
    no order or reader named, replaying the same questions (each sees its own profile, as in the evaluation),
    answers each as the table's predictions do, from the same label scores (the tiny reader's answers alone
    barely vary: the scores show the docs and their order were the evaluation's)."""
    from persrag_lightning.commands.evaluate import run_evaluation
    from persrag_lightning.data.lamp import read_outputs
    from persrag_lightning.data.source import LampSource
    from persrag_lightning.data.synth import SynthConfig
    from persrag_lightning.pipeline.command import LocalRunner
    from persrag_lightning.pipeline.runs import EvaluationRun
    from persrag_lightning.retrieval.base import DocStore, Query
    from persrag_lightning.retrieval.strategies import file_name

    record = json.loads((recorded / "pipeline.json").read_text())
    table = EvaluationRun(**next(e for e in record["evaluations"] if e["purpose"] == "test table"))
    table.only = [record["chosen_on_dev"]]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(recorded.parent.parent)
        report = run_evaluation(LocalRunner().evaluation_config(table))
        predictions = read_outputs(report.out_dir / "predictions" / f"{file_name(FIRST_STAGE)}.json", "LaMP-2")
        pipe = served(recorded)
        assert f"[serving] {pipe.serves}" in capsys.readouterr().err
        source = LampSource("LaMP-2", None, SynthConfig(num_users=USERS), ".cache/persrag")
        dataset = source.load()
    assert pipe.strategy._reranker is None and pipe.reader_spec == str(recorded / "reader")
    assert pipe.serves == (f"serving {FIRST_STAGE} read by the trained reader (decision argmax): chosen on dev by "
                           f"{recorded / 'pipeline.json'}")
    examples = sorted(dataset.examples["test"], key=lambda e: e.example_id)[: len(predictions)]
    assert [e.example_id for e in examples] == sorted(predictions) and len(examples) == 6
    replay = CFRAGPipeline(pipe.strategy, DocStore(dataset), pipe.llm_config, pipe.k, reader=pipe.reader_spec)
    answers = replay.generate_batch([e.user_id for e in examples], [e.input for e in examples],
                                    example_ids=[e.example_id for e in examples])
    assert {e.example_id: a.answer for e, a in zip(examples, answers)} == predictions
    # and the label scores they were decided from: the same docs in the same order, read by the same reader
    docs = [replay.store.read_docs(Query(e.user_id, e.query, e.input, e.example_id), a.docs)
            for e, a in zip(examples, answers)]
    again = replay.reader.read("LaMP-2", [e.input for e in examples], docs)
    reading = report.readings[FIRST_STAGE]
    assert again.decision == reading.decision and again.calibration == reading.calibration
    assert again.log_scores == [pytest.approx(row, abs=1e-5) for row in reading.log_scores]


def test_an_explicit_argument_wins_over_the_record(recorded, tmp_path):
    from persrag_lightning.reading.llm import LLMReader

    pipe = served(recorded, reranker="reranker", reader="llm", calibration="pmi")
    assert pipe.strategy._reranker is not None and isinstance(pipe.reader, LLMReader)
    # the record's answer mode still reads: only what was given differs
    assert pipe.llm_config.calibration == "pmi" and pipe.llm_config.answer_mode == "choose"
    assert pipe.serves.startswith("serving CFRAG (reranked) read by the LLM smollm2 (choose, calibration pmi, "
                                  "decision argmax): chosen on dev by ")
    assert pipe.serves.endswith("except order, reader (given)")  # the record names no calibration: none overridden
    first = served(recorded, reranker=None, decision="argmax")
    assert first.strategy._reranker is None and "except" not in first.serves


def test_a_run_without_a_record_serves_the_defaults_it_served_before(recorded, tmp_path):
    run = shutil.copytree(recorded, tmp_path / "t", ignore=shutil.ignore_patterns("pipeline.json"))
    pipe = served(run)
    assert pipe.strategy._reranker is not None and pipe.reader_spec == "llm"
    assert pipe.llm_config.answer_mode == "generate" and pipe.llm_config.calibration == "none"
    assert pipe.serves == (f"serving CFRAG (reranked) read by the LLM smollm2 (generated answers): the defaults "
                           f"(no pipeline.json in {run})")


def test_the_float32_gemm_paths_are_the_records_where_the_environment_names_none(recorded, tmp_path, monkeypatch,
                                                                                 capsys):
    """The trained reader reads in float32: its sums in the run's order keep its answers near a tie the table's.
    A record from before the pin was kept names its paths by consumer; a record without paths is served as before,
    and a malformed one is refused naming the field."""
    from persrag_lightning import runtime

    run = shutil.copytree(recorded, tmp_path / "t")
    record = json.loads((run / "pipeline.json").read_text())
    record["gemm"] = {"chosen": {"reader": "torch", "encoders": "torch-kn"}}
    (run / "pipeline.json").write_text(json.dumps(record))
    monkeypatch.setattr(runtime, "_FOLLOWED", {})
    monkeypatch.delenv(runtime.ENV)
    served(run)
    assert "[serving] float32 GEMM paths: reader:torch,encoders:torch-kn, as the run's record says" \
        in capsys.readouterr().err
    assert runtime.gemm_choice().chosen == {"reader": "torch", "encoders": "torch-kn"}
    del record["gemm"]
    (run / "pipeline.json").write_text(json.dumps(record))
    assert read_reference(run).gemm is None
    record["gemm"] = {"chosen": ["torch"]}
    (run / "pipeline.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=rf"{run / 'pipeline.json'}: field 'gemm'"):
        read_reference(run)


@pytest.mark.parametrize(("change", "field"), [
    ({"chosen_on_dev": "CFRAG (best)"}, "chosen_on_dev"),
    ({"reader": None}, "reader"),
    ({"reader": ["trained"]}, "reader"),
    ({"task": None}, "task"),
    ({"calibration_chosen_on_dev": "platt"}, "calibration"),
])
def test_a_malformed_record_is_refused_naming_the_file_and_the_field(recorded, tmp_path, change, field):
    run = shutil.copytree(recorded, tmp_path / "t")
    record = json.loads((run / "pipeline.json").read_text())
    record.update(change)
    record = {k: v for k, v in record.items() if v is not None}
    (run / "pipeline.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=rf"{run / 'pipeline.json'}: field '{field}'"):
        served(run)
    (run / "pipeline.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"{run / 'pipeline.json'}: not JSON"):
        read_reference(run)


def test_the_service_answers_a_label_question_with_the_reader_the_record_chose(recorded, tiny_bert, tmp_path):
    """`persrag serve --run`: /healthz says what is served; POST /v1/answers reads the caller's docs with the
    run's trained reader (no LLM needed); a server without an LLM whose reader is the LLM refuses, saying why."""
    from fastapi.testclient import TestClient

    from persrag_lightning.data.tasks import LAMP2_LABELS
    from persrag_lightning.serving.app import create_app
    from persrag_lightning.serving.limits import Limits
    from tests.helpers.serve_helpers import open_service

    service = open_service(recorded, tmp_path / "state", tiny_bert)
    assert service.pipeline.reader_spec == str(recorded / "reader") and service.pipeline.strategy._reranker is None
    client = TestClient(create_app(service, limits=Limits(signup_per_minute=0, requests_per_minute=0)))
    assert client.get("/healthz").json()["serves"] == service.pipeline.serves
    history = [{"id": f"h{i}", "date": f"2024-01-0{i + 1}", "fields": {"description": d, "tag": t}}
               for i, (d, t) in enumerate([("a slow film about a lighthouse", "classic"),
                                           ("robots fight on a moon", "sci-fi")])]
    signed = client.post("/v1/users", json={"user_id": "asker", "answers": {"goals": "g"}, "history": history})
    assert signed.status_code == 201, signed.text
    auth = {"Authorization": f"Bearer {signed.json()['access_token']}"}
    question = "Which tag does this movie relate to among the following tags? description: a ghost in a lighthouse"
    got = client.post("/v1/answers", json={"input": question}, headers=auth)
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["answer"] in LAMP2_LABELS and body["serves"] == service.pipeline.serves and body["docs"]
    assert body["read"] == "a ghost in a lighthouse" and service.pipeline._llm is None  # the trained reader read
    assert client.post("/v1/answers", json={"input": " "}, headers=auth).status_code == 400
    assert client.post("/v1/answers", json={"input": question}).status_code == 401
    llm = TestClient(create_app(open_service(recorded, tmp_path / "state-llm", tiny_bert, reader="llm")))
    token = llm.post("/v1/users", json={"user_id": "asker", "answers": {"goals": "g"}}).json()["access_token"]
    refused = llm.post("/v1/answers", json={"input": question}, headers={"Authorization": f"Bearer {token}"})
    assert refused.status_code == 409 and "--reader reader" in refused.json()["error"]["message"]


def test_concurrent_answers_share_one_call_and_answer_as_one_by_one(recorded, tiny_bert, tmp_path):
    """POST /v1/answers batches: questions asked together are retrieved in one call and read in one call, and each
    gets the docs and the answer it gets alone."""
    import threading

    from persrag_lightning.serving.answers import answer_question
    from persrag_lightning.serving.batcher import Batching
    from tests.helpers.serve_helpers import ADMIN, open_service

    questions = [f"Which tag does this movie relate to among the following tags? description: {d}"
                 for d in ("a ghost in a lighthouse", "robots on the moon", "two friends open a bakery")]
    got: dict[str, dict] = {}
    for name, batching in (("batched", Batching(max_batch=len(questions), max_wait_ms=60_000)),
                           ("alone", Batching(max_batch=1))):
        service = open_service(recorded, tmp_path / name, tiny_bert, answering=batching)
        admin = service.authenticate(f"Bearer {ADMIN}")
        users = service.pipeline.store.corpus.user_ids[:len(questions)]  # exported users: their docs are stored
        callers = [service.authenticate("Bearer " + service.sign_up({"user_id": u, "answers": {"goals": "g"}},
                                                                    admin)["access_token"]) for u in users]
        out = got.setdefault(name, {})

        def ask(i: int, service=service, callers=callers, out=out) -> None:
            out[i] = answer_question(service, callers[i], {"input": questions[i]})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
            t.join(0 if name == "batched" else 120)  # one by one where alone
        for t in threads:
            t.join(120)
        stats = service.answering.stats
        assert stats.items == len(questions) and stats.largest == (len(questions) if name == "batched" else 1)
        assert service.retrieval.stats.items == 0  # the chats' batcher
        service.close()
    for i in range(len(questions)):
        a, b = got["batched"][i], got["alone"][i]
        assert a["docs"] and [d["doc_id"] for d in a["docs"]] == [d["doc_id"] for d in b["docs"]]
        assert a["answer"] == b["answer"] and a["read"] == b["read"]


def test_a_record_whose_dev_chose_the_llm_serves_it_under_the_chosen_calibration(recorded, tmp_path):
    """The LLM reader chosen on dev, its calibration with it (the table's evaluation.llm.calibration, as the
    pipeline sets it): served so, answering by `choose`; no LLM is loaded before a question comes."""
    run = shutil.copytree(recorded, tmp_path / "t")
    record = json.loads((run / "pipeline.json").read_text())
    record.update(reader="llm", reader_chosen_on_dev="llm", calibration_chosen_on_dev="contextual")
    table = next(e for e in record["evaluations"] if e["purpose"] == "test table")
    table["overrides"].pop("evaluation.reader", None)
    table["overrides"]["evaluation.llm.calibration"] = "contextual"
    (run / "pipeline.json").write_text(json.dumps(record))
    pipe = served(run)
    assert pipe.reader_spec == "llm" and pipe._llm is None
    assert (pipe.llm_config.answer_mode, pipe.llm_config.calibration, pipe.llm_config.decision) == \
        ("choose", "contextual", "auto")
    assert f"read by the LLM smollm2 (choose, calibration contextual, decision argmax): chosen on dev by {run}" \
        in pipe.serves


def test_every_configuration_dev_can_choose_is_served_as_its_row_of_the_evaluate_config():
    """record.CONFIGURATIONS against the rows the dev choice compares (pipeline/choice.py) as
    evaluate_cfrag.yaml sets them: the reranker or none, m, the neighbour gate."""
    from inspect import signature

    from persrag_lightning.pipeline.choice import EVERY_CANDIDATE
    from persrag_lightning.retrieval.cfrag import CFRAG
    from tests.conftest import evaluate_config_rows

    assert set(CONFIGURATIONS) == set(EVERY_CANDIDATE)
    _, run, rows = evaluate_config_rows("evaluate_cfrag.yaml")
    for name, configuration in CONFIGURATIONS.items():
        row = rows[name]
        reranker = row.get("reranker")
        assert (None if reranker is None else reranker.removeprefix(f"{run}/")) == configuration.reranker, name
        m = configuration.m if configuration.m is not None else signature(CFRAG).parameters["m"].default
        assert row.get("m") == m and row.get("neighbour_slots") == configuration.neighbour_slots, name


@pytest.mark.parametrize(("chosen", "reranked", "m", "slots"), [
    ("CFRAG, ≤ 2 neighbour docs", True, 6, 2), ("w/o user retrieval (first-stage order)", False, 1, None)])
def test_a_gated_or_own_docs_configuration_chosen_on_dev_is_served_so(recorded, tmp_path, chosen, reranked, m,
                                                                      slots):
    run = shutil.copytree(recorded, tmp_path / "t")
    record = json.loads((run / "pipeline.json").read_text())
    record.update(chosen_on_dev=chosen, reference_row=chosen)
    (run / "pipeline.json").write_text(json.dumps(record))
    pipe = served(run)
    s = pipe.strategy
    assert (s._reranker is not None, s.m, s.neighbour_slots) == (reranked, m, slots)
    assert pipe.serves.startswith(f"serving {chosen} read by the trained reader")
    given = served(run, m=3, neighbour_slots=None)
    assert (given.strategy.m, given.strategy.neighbour_slots) == (3, None)
    assert given.serves.startswith("serving CFRAG (") and "m = 3" in given.serves and "(given)" in given.serves


def _with_table_decision(run, decision: str):
    record = json.loads((run / "pipeline.json").read_text())
    table = next(e for e in record["evaluations"] if e.get("purpose") == TABLE)
    table["overrides"]["evaluation.llm.decision"] = decision
    (run / "pipeline.json").write_text(json.dumps(record))
    return read_reference(run)


def test_a_recorded_decision_is_checked_as_every_readers_decision_is(recorded, tmp_path):
    from persrag_lightning.commands.serve import serve_parser

    run = shutil.copytree(recorded, tmp_path / "t")
    assert _with_table_decision(run, "quantile:0.4").decision == "quantile:0.4"  # a fitted level is a decision
    with pytest.raises(ConfigError, match=rf"{run / 'pipeline.json'}: field 'decision': unknown decision 'medain'"):
        _with_table_decision(run, "medain")
    parser = serve_parser()
    assert parser.parse_args(["--run", str(run), "--decision", "quantile:0.3"]).decision == "quantile:0.3"
    with pytest.raises(SystemExit):
        parser.parse_args(["--run", str(run), "--decision", "quantile:2"])
