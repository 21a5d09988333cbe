"""Inference over exported bundles: CFRAG retrieval with provenance, generation, add_user, and `persrag evaluate`."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from persrag_lightning.data.lamp import read_outputs
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.evaluation.evaluate import Evaluation
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.models.reranker import PersonalizedReranker
from persrag_lightning.retrieval.base import Query
from persrag_lightning.retrieval.baselines import Recency, ZeroShot
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.serving import CFRAGPipeline
from tests.conftest import REPO, tiny_serving_run

USERS = 16


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_bert):
    """A run with all three bundles: stage 1 trained for an epoch; retriever and reranker untrained exports
    (their training is tested elsewhere; here only loading and inference matter)."""
    args = ["fit", "--config", "cfrag_user_encoder.yaml", "--run_name", "t", f"--data.init_args.encoder={tiny_bert}",
            f"--data.init_args.synth.num_users={USERS}", "--trainer.max_epochs=1", "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false"]
    return tiny_serving_run(tmp_path_factory.mktemp("serving"), args, "t", tiny_bert)


@pytest.fixture()
def pipeline(run_dir, tiny_llm, tmp_path):
    return CFRAGPipeline.from_pretrained(run_dir, llm=LLMConfig(model=tiny_llm, options={"device": "cpu"}), m=3,
                                         k_per_user=2, k=3, cache_dir=str(tmp_path / "cache"))


def test_retrieve_returns_provenance_from_similar_users(pipeline):
    user = pipeline.store.corpus.user_ids[2]
    docs = pipeline.retrieve(user, "description: a detective hunts a killer in a rainy city", k=3)
    assert len(docs) == 3 and len({d.row for d in docs}) == 3
    similar = dict(pipeline.strategy.similar_users(user))
    assert next(iter(similar)) == user and len(similar) == 3
    for d in docs:
        assert d.owner in similar and d.user_sim == pytest.approx(similar[d.owner], abs=1e-5)
        assert math.isfinite(d.retriever_score) and math.isfinite(d.reranker_score)
        assert d.text == pipeline.store.text(d.row) and d.row in pipeline.store.rows(d.owner)
    assert [d.reranker_score for d in docs] == sorted((d.reranker_score for d in docs), reverse=True)
    batch = pipeline.retrieve_batch([user, user], ["description: a detective", "description: a space ship"], 3)
    assert [d.row for d in batch[0]] == [d.row for d in pipeline.retrieve(user, "description: a detective", 3)]


def test_serving_defaults_are_the_measured_winners_and_the_paper_setting_stays_available(pipeline, run_dir, tmp_path):
    """docs/performance/serving.md: docs tokenised once, the reranker and the query encoder in the fastest runtime
    installed (OpenVINO, else bf16 autocast for the reranker where the CPU computes it natively, fp32); the
    evaluation's exact CFRAG (fp32, no cache) is three arguments away and returns the same docs without the
    cache."""
    from persrag_lightning.serving.runtimes import serving_runtime

    reranker = pipeline.strategy._reranker
    assert reranker.runtime == serving_runtime("reranker") and reranker._doc_tokens is not None
    assert pipeline.strategy.retriever.query_runtime == serving_runtime("query")
    exact = CFRAGPipeline.from_pretrained(run_dir, m=3, k_per_user=2, k=3, cache_dir=str(tmp_path / "cache"),
                                          reranker_runtime="fp32", query_runtime="fp32", cache_doc_tokens=False)
    cached = CFRAGPipeline.from_pretrained(run_dir, m=3, k_per_user=2, k=3, cache_dir=str(tmp_path / "cache"),
                                           reranker_runtime="fp32", query_runtime="fp32")
    assert exact.strategy._reranker.runtime == "fp32" and exact.strategy._reranker._doc_tokens is None
    assert exact.strategy.retriever.query_runtime == "fp32"
    user = pipeline.store.corpus.user_ids[2]
    for query in ("description: a detective story", "description: robots in space"):
        assert [d.row for d in cached.retrieve(user, query)] == [d.row for d in exact.retrieve(user, query)]


def test_a_distilled_reranker_is_served_by_name_over_the_same_candidates(run_dir, tmp_path):
    """from_pretrained(reranker="reranker_distilled") scores the same m·k candidates with the smaller export; a
    missing one names the config that trains it; reranker=None serves the first-stage order."""
    import dataclasses

    from persrag_lightning.data.tasks import get_task
    from persrag_lightning.models.reranker import keep_layers

    run = shutil.copytree(run_dir, tmp_path / "run")
    student = PersonalizedReranker.from_pretrained(run / "reranker")
    keep_layers(student.encoder, 1)
    student.config = dataclasses.replace(student.config, num_layers=1)
    student.save_pretrained(run / "reranker_distilled")
    args = {"m": 3, "k_per_user": 2, "k": 3, "cache_dir": str(tmp_path / "cache"), "reranker_runtime": "fp32"}
    full = CFRAGPipeline.from_pretrained(run, **args)
    small = CFRAGPipeline.from_pretrained(run, reranker="reranker_distilled", **args)
    assert len(small.strategy._reranker.encoder.encoder.layer) == 1
    user, query = full.store.corpus.user_ids[2], "description: a detective story"
    asked = Query(user, get_task(small.task).extract_query(query), query)  # as retrieve() asks
    candidates = {d.row for d in small.strategy.candidates([asked])[0]}
    got, want = small.retrieve(user, query), full.retrieve(user, query)
    assert len(got) == 3 and {d.row for d in got} <= candidates and {d.row for d in want} <= candidates
    assert [d.reranker_score for d in got] != [d.reranker_score for d in want]
    with pytest.raises(FileNotFoundError, match="cfrag_reranker_distilled.yaml"):
        CFRAGPipeline.from_pretrained(run_dir, reranker="reranker_distilled", **args)
    first = CFRAGPipeline.from_pretrained(run, reranker=None, **args)  # Table 3's "w/o reranker tuning"
    assert first.strategy._reranker is None
    assert [d.row for d in first.retrieve(user, query)] == \
        [d.row for d in sorted(first.strategy.candidates([asked])[0], key=lambda d: -d.retriever_score)][:3]


def threads_while_retrieving(pipe: CFRAGPipeline, monkeypatch) -> list[int]:
    """torch's thread count inside the strategy's retrieve, for one retrieve() called with 2 threads set; the
    count after it (restored) is appended last."""
    seen = []
    retrieve = pipe.strategy.retrieve
    monkeypatch.setattr(pipe.strategy, "retrieve", lambda qs, k: seen.append(torch.get_num_threads()) or
                        retrieve(qs, k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert pipe.retrieve(pipe.store.corpus.user_ids[0], "description: robots")
        return [*seen, torch.get_num_threads()]
    finally:
        torch.set_num_threads(before)


def test_retrieval_threads_apply_while_retrieving_and_are_restored(run_dir, tmp_path, monkeypatch):
    pipe = CFRAGPipeline.from_pretrained(run_dir, m=3, k_per_user=2, k=3, cache_dir=str(tmp_path / "cache"),
                                         threads=1)
    assert threads_while_retrieving(pipe, monkeypatch) == [1, 2]
    seen = []

    class Strategy:  # loading runs under the count too: an exported reranker runtime fixes its threads then
        def prepare(self, store) -> None:
            seen.append(torch.get_num_threads())

        def warm(self) -> None:  # and so does compiling the query encoder's shapes
            seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        CFRAGPipeline(Strategy(), pipe.store, threads=1)
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads"):
        CFRAGPipeline.from_pretrained(run_dir, cache_dir=str(tmp_path / "cache"), threads=0)


def test_torch_retrieves_on_one_thread_only_when_every_encoder_runs_exported(run_dir, tmp_path, monkeypatch):
    """threads=None: 1 torch thread while retrieving when the query encoder, the reranker and its first cut all run
    in an exported runtime (torch then does only small ops); the process's count as soon as one runs in torch."""
    from types import SimpleNamespace

    from persrag_lightning.serving.runtimes import all_exported

    def strategy(query: str, *rerankers: str | None) -> SimpleNamespace:
        models = [SimpleNamespace(runtime=r) if r else None for r in rerankers]
        return SimpleNamespace(retriever=SimpleNamespace(query_runtime=query), _reranker=models[0],
                               _first_cut=models[1])

    assert all_exported(strategy("openvino", "openvino", None)) and all_exported(strategy("onnx", None, None))
    assert all_exported(strategy("openvino", "openvino", "openvino"))
    assert not all_exported(strategy("openvino", "bf16", None)) and not all_exported(strategy("fp32", "openvino", None))
    assert not all_exported(strategy("openvino", "openvino", "fp32"))
    pytest.importorskip("openvino")
    pytest.importorskip("onnx")
    settings = {"m": 3, "k_per_user": 2, "k": 3, "cache_dir": str(tmp_path / "cache")}
    exported = CFRAGPipeline.from_pretrained(run_dir, reranker_runtime="openvino", query_runtime="openvino", **settings)
    assert exported.retrieve_threads == 1
    assert CFRAGPipeline.from_pretrained(run_dir, reranker_runtime="fp32", **settings).retrieve_threads is None
    assert threads_while_retrieving(exported, monkeypatch) == [1, 2]


def test_serving_loads_and_retrieves_without_importing_lightning(run_dir, tmp_path):
    """Serving code is plain torch: a fresh interpreter that loads the bundles and retrieves never imports
    Lightning (checked on sys.modules, so an indirect import anywhere on the path fails it)."""
    script = textwrap.dedent(f"""
        import sys
        from persrag_lightning.serving import CFRAGPipeline
        pipe = CFRAGPipeline.from_pretrained({str(run_dir)!r}, m=3, k_per_user=2, k=3,
                                             cache_dir={str(tmp_path / "cache")!r})
        user = pipe.store.corpus.user_ids[0]
        assert pipe.retrieve(user, "description: a film")
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
        assert not leaked, leaked
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False,
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]


def test_generate_returns_answer_and_prompt(pipeline):
    user = pipeline.store.corpus.user_ids[0]
    out = pipeline.generate(user, "Which tag does this movie relate to among the following tags? "
                                  "description: a lonely robot tends a garden on a dead planet")
    assert isinstance(out.answer, str) and len(out.docs) == 3
    assert "lonely robot" in out.prompt
    assert all(pipeline.store.history_doc(d.row).fields["description"][:30] in out.prompt for d in out.docs)


def test_add_user_is_retrievable_at_once(pipeline):
    template = pipeline.store.dataset.users[pipeline.store.corpus.user_ids[5]].docs
    history = [{"id": f"new-{i}", "date": f"2024-01-{i + 1:02d}", "fields": d.fields}
               for i, d in enumerate(template[:6])]
    pipeline.add_user("newcomer", history)
    docs = pipeline.retrieve("newcomer", "description: " + template[0].fields["description"], k=3)
    assert docs and all(d.owner in dict(pipeline.strategy.similar_users("newcomer")) for d in docs)
    assert pipeline.strategy.similar_users("newcomer")[0][0] == "newcomer"
    rows = set(pipeline.store.rows("newcomer").tolist())
    candidates = pipeline.strategy.candidates([Query("newcomer", template[0].fields["description"])])[0]
    assert len(rows) == 6 and {d.row for d in candidates if d.owner == "newcomer"} <= rows
    assert sum(d.owner == "newcomer" for d in candidates) == 2  # its own k_per_user docs are candidates
    with pytest.raises(ValueError, match="already exists"):
        pipeline.add_user("newcomer", history)


def test_evaluate_writes_lamp_predictions_metrics_table_and_chart(run_dir, tiny_llm, tmp_path):
    out = tmp_path / "eval"
    evaluation = Evaluation(task="LaMP-2", synth=SynthConfig(num_users=USERS), cache_dir=str(tmp_path / "cache"),
                            k=3, llm=LLMConfig(model=tiny_llm, options={"device": "cpu"}), max_examples=6,
                            out_dir=str(out))
    strategies = [ZeroShot(), Recency(),
                  CFRAG(str(run_dir / "user_encoder"), str(run_dir / "retriever"), str(run_dir / "reranker"), m=3,
                        k_per_user=2, cache_dir=str(tmp_path / "cache"), name="CFRAG")]
    results = evaluation.run(strategies).results
    # the LLM's rows, then the reader-free rows: the train majority, the user's own majority, each row's docs' vote
    assert list(results) == [s.name for s in strategies] + [
        "majority label (train)", "user's own majority", "recency docs' vote", "CFRAG docs' vote"]
    assert results[strategies[1].name]["own_docs"] == 1.0
    assert 0.0 <= results["CFRAG"]["own_docs"] <= 1.0 and "same_community_docs" in results["CFRAG"]
    assert 0.0 < results["CFRAG"]["same_community_chance"] <= 1.0
    assert "answer_in_docs" in results["CFRAG"] and "accuracy" in results["CFRAG"]
    predictions = read_outputs(out / "predictions" / "CFRAG.json", "LaMP-2")
    assert len(predictions) == 6
    assert set(predictions) == {e.example_id for e in evaluation.examples(evaluation.source.load())}
    assert all(e.split == "test" for e in evaluation.examples(evaluation.source.load()))  # reports on test
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["results"]["CFRAG"]["accuracy"] == results["CFRAG"]["accuracy"]
    assert metrics["split"] == "test" and metrics["answer_mode"] == "generate"
    low, high = metrics["intervals"]["CFRAG"]["accuracy"][1:]
    assert low <= results["CFRAG"]["accuracy"] <= high and "recency" in metrics["p_values"]
    table = (out / "results.md").read_text()
    assert "| method | LaMP-2 accuracy | p vs CFRAG (accuracy) |" in table and "split **test**" in table
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cached_retrieval_reads_back_as_it_was_retrieved(run_dir, tmp_path):
    """The trained reader reads whose doc it reads (own or a neighbour's, at which similarity): a retrieval read back
    from the cache hands over the docs with the provenance and scores the live retrieval gave, so a row's answers do
    not depend on whether its retrieval was cached."""
    from persrag_lightning.data.source import LampSource
    from persrag_lightning.retrieval.base import DocStore
    from persrag_lightning.retrieval.strategies import cached_retrieval

    source = LampSource("LaMP-2", None, SynthConfig(num_users=USERS), str(tmp_path / "cache"))
    source.prepare()
    dataset = source.load()
    store, examples = DocStore(dataset), sorted(dataset.examples["test"], key=lambda e: e.example_id)[:6]

    def retrieved() -> list[tuple]:
        cfrag = CFRAG(str(run_dir / "user_encoder"), str(run_dir / "retriever"), str(run_dir / "reranker"), m=3,
                      k_per_user=2, cache_dir=str(tmp_path / "cache"), name="CFRAG")
        docs, _ = cached_retrieval(cfrag, store, examples, 3, tmp_path / "cache", "synth")
        return [(e.user_id, d.row, d.owner, d.user_sim, d.retriever_score, d.reranker_score)
                for e, ds in zip(examples, docs) for d in ds]

    live = retrieved()
    assert any(owner != asker and sim < 1.0 for asker, _, owner, sim, *_ in live)  # neighbours, less similar
    assert len(list((tmp_path / "cache" / "retrievals").glob("CFRAG-*.json"))) == 1
    assert retrieved() == live  # read back from the cache: the same docs, similarities and scores


def test_evaluate_cache_follows_bundle_content_not_path(run_dir, tiny_bert, tiny_llm, tmp_path):
    """A retrained model under the same run name (same path, new weights) gets new predictions, not the cache."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    evaluation = Evaluation(task="LaMP-2", synth=SynthConfig(num_users=USERS), cache_dir=str(tmp_path / "cache"),
                            k=3, llm=LLMConfig(model=tiny_llm, options={"device": "cpu"}), max_examples=4,
                            out_dir=str(tmp_path / "eval"))

    def cfrag():
        return CFRAG(str(run / "user_encoder"), str(run / "retriever"), str(run / "reranker"), m=3, k_per_user=2,
                     cache_dir=str(tmp_path / "cache"), name="CFRAG")

    evaluation.run([cfrag()])
    evaluation.run([cfrag()])
    assert len(list((tmp_path / "eval" / "cache").glob("CFRAG-*.json"))) == 1  # unchanged bundles: cache hit
    torch.manual_seed(1)
    PersonalizedReranker.from_encoder(tiny_bert, user_dim=32).save_pretrained(run / "reranker")  # "retrained"
    evaluation.run([cfrag()])
    assert len(list((tmp_path / "eval" / "cache").glob("CFRAG-*.json"))) == 2


def test_evaluate_skips_an_untrained_bundle_with_a_row_naming_the_command(run_dir, tiny_llm, tmp_path):
    evaluation = Evaluation(task="LaMP-2", synth=SynthConfig(num_users=USERS), cache_dir=str(tmp_path / "cache"),
                            k=3, llm=LLMConfig(model=tiny_llm, options={"device": "cpu"}), max_examples=4,
                            out_dir=str(tmp_path / "eval"), reader_free=False)
    ropg = CFRAG(str(run_dir / "user_encoder"), str(run_dir / "retriever_ropg"), None, m=1, name="ROPG",
                 cache_dir=str(tmp_path / "cache"))
    summary = evaluation.run([ZeroShot(), ropg])
    assert list(summary.results) == ["zero_shot"]
    assert "retriever_ropg" in evaluation.skipped["ROPG"] and "python train.py" in evaluation.skipped["ROPG"]
    table = (tmp_path / "eval" / "results.md").read_text()
    assert "Not trained (skipped)" in table and "- ROPG:" in table


def synth_store(tmp_path):
    from persrag_lightning.data.source import LampSource
    from persrag_lightning.retrieval.base import DocStore

    source = LampSource("LaMP-2", None, SynthConfig(num_users=USERS), str(tmp_path / "cache"))
    source.prepare()
    return DocStore(source.load())


def test_cfrag_users_cluster_takes_cohort_neighbours_not_the_encoders_top_m(run_dir, tmp_path):
    """`users: cluster`: the query user, then the m − 1 members of its cohort most similar to it (cosine, best
    first); a user outside the cohort model retrieves alone; the encoder's top-m is not consulted."""
    from persrag_lightning.retrieval.cohorts import CohortSettings

    store = synth_store(tmp_path)
    make = lambda users, **kw: CFRAG(str(run_dir / "user_encoder"), str(run_dir / "retriever"),
                                     str(run_dir / "reranker"), m=4, k_per_user=2,
                                     cache_dir=str(tmp_path / "cache"), users=users, **kw)
    cfrag = make("cluster", cohorts=CohortSettings(method="kmeans", n_clusters=3))
    cfrag.prepare(store)
    assert cfrag.user_index is None and cfrag._cohort_model.n_cohorts == 3
    for user in store.corpus.user_ids[:6]:
        similar = cfrag.similar_users(user)
        cohort = cfrag._cohort_model.cohort_of(user)
        assert similar[0] == (user, 1.0) and 1 <= len(similar) <= 4
        assert all(cfrag._cohort_model.cohort_of(u) == cohort for u, _ in similar[1:])
        assert [s for _, s in similar[1:]] == sorted((s for _, s in similar[1:]), reverse=True)
        assert [(n.user_id, n.similarity) for n in cfrag._cohort_model.neighbours(user, 3)] == similar[1:]
    docs = cfrag.retrieve([Query(store.corpus.user_ids[0], "description: a detective", "", "")], 3)[0]
    allowed = {u for u, _ in cfrag.similar_users(store.corpus.user_ids[0])}
    assert len(docs) == 3 and {d.owner for d in docs} <= allowed
    assert cfrag.similar_users("somebody-new") == [("somebody-new", 1.0)]
    with pytest.raises(ValueError, match="cohorts settings apply only"):
        make("encoder", cohorts=CohortSettings())
    encoder = make("encoder")
    encoder.prepare(store)
    assert len(encoder.similar_users(store.corpus.user_ids[0])) == 4  # the paper's top-m still works


def test_clusterrag_rows_in_the_evaluation_with_trained_user_vectors(run_dir, tiny_bert, tiny_llm, tmp_path):
    """ClusterRAG goes through `persrag evaluate`'s one path (retrieve → Eq. 3 prompt → LLM → metric), cohorts
    from the stage-1 export's user table (`cohorts.user_vectors: encoder`), and a second run reads its cache."""
    from persrag_lightning.retrieval.cluster_index import ClusterIndexSettings
    from persrag_lightning.retrieval.clusterrag import ClusterRAG, ClusterRAGSettings, CorpusEmbedder
    from persrag_lightning.retrieval.cohorts import CohortSettings

    def rows():
        return [ClusterRAG(CorpusEmbedder(tiny_bert, str(tmp_path / "cache")),
                           ClusterRAGSettings(mode, CohortSettings(user_vectors="encoder"),
                                              ClusterIndexSettings(top_b=2)),
                           cache_dir=str(tmp_path / "cache"), user_encoder=str(run_dir / "user_encoder"))
                for mode in ("user", "collab", "hybrid")]

    evaluation = Evaluation(task="LaMP-2", synth=SynthConfig(num_users=USERS), cache_dir=str(tmp_path / "cache"),
                            k=3, llm=LLMConfig(model=tiny_llm, options={"device": "cpu"}), max_examples=4,
                            out_dir=str(tmp_path / "eval"), reference="ClusterRAG (hybrid)", reader_free=False)
    results = evaluation.run(rows()).results
    assert list(results) == ["ClusterRAG (user)", "ClusterRAG (collab)", "ClusterRAG (hybrid)"]
    assert results["ClusterRAG (user)"]["own_docs"] == 1.0 and results["ClusterRAG (collab)"]["own_docs"] < 1.0
    assert len(list((tmp_path / "eval" / "cache").glob("ClusterRAG*.json"))) == 3
    again = rows()
    evaluation.run(again)
    assert all(s.index is None for s in again)  # answered from the cache: nothing prepared
    assert len(list((tmp_path / "eval" / "cache").glob("ClusterRAG*.json"))) == 3


def _no_rebuild(*args, **kwargs):
    raise AssertionError("the exported user index was rebuilt")


def test_cfrag_loads_the_exported_user_index_and_finds_the_exact_neighbours(run_dir, tmp_path, monkeypatch):
    """users.faiss is built once at export (`index: auto`: exact at this size) and loaded by every process that
    prepares CFRAG, not rebuilt; its top-m is the exact one. MEAN vectors still get an index built for them."""
    import faiss

    from persrag_lightning.retrieval.user_index import UserIndex

    store = synth_store(tmp_path)
    make = lambda users: CFRAG(str(run_dir / "user_encoder"), str(run_dir / "retriever"), None, m=4,
                               k_per_user=2, cache_dir=str(tmp_path / "cache"), users=users)
    with monkeypatch.context() as patch:
        patch.setattr(UserIndex, "build", _no_rebuild)
        cfrag = make("encoder")
        cfrag.prepare(store)
    ue = cfrag.user_encoder
    assert isinstance(ue._index, faiss.IndexFlatIP) and cfrag.user_index.kind == "flat"
    if faiss.get_num_gpus() == 0:  # on a GPU the loaded index is copied there
        assert cfrag.user_index.index is ue._index
    users = [u for u in store.corpus.user_ids if u in cfrag.user_vectors]
    loaded = {u: cfrag.similar_users(u) for u in users}
    cfrag.user_index = UserIndex.build(ue.user_ids, ue.user_embeddings, "flat")
    assert loaded == {u: cfrag.similar_users(u) for u in users} and all(len(s) == 4 for s in loaded.values())
    mean = make("mean")
    mean.prepare(store)
    assert mean.user_index.index is not mean.user_encoder._index and len(mean.user_index) == len(mean.user_vectors)


def test_an_hnsw_export_is_served_as_exported_and_keeps_its_parameters(run_dir, tmp_path, monkeypatch):
    """Above the `auto` threshold the export holds HNSW; serving loads it (no rebuild), adds users to it, and a
    deletion rebuilds it with the exported M, efConstruction and efSearch."""
    import faiss

    from persrag_lightning import index as index_module
    from persrag_lightning.index import index_params
    from persrag_lightning.models.user_encoder import UserEncoder
    from persrag_lightning.retrieval.user_index import UserIndex

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ue = UserEncoder.from_pretrained(run / "user_encoder")
    monkeypatch.setattr(index_module, "AUTO_EXACT_MAX_USERS", USERS // 2)
    ue.index_users(ue.user_ids, ue.user_embeddings)  # kind "auto"
    assert isinstance(ue._index, faiss.IndexHNSW)
    ue._index.hnsw.efSearch = 21  # not the default, so a lost parameter shows
    params = index_params(ue._index)
    ue.save_pretrained(run / "user_encoder")
    assert index_params(UserEncoder.from_pretrained(run / "user_encoder")._index) == params
    with monkeypatch.context() as patch:
        patch.setattr(UserIndex, "build", _no_rebuild)
        pipe = CFRAGPipeline.from_pretrained(run, m=3, k_per_user=2, k=3, cache_dir=str(tmp_path / "cache"))
    s = pipe.strategy
    assert s.user_index.kind == "hnsw" and s.user_index.index is s.user_encoder._index
    template = pipe.store.dataset.users[pipe.store.corpus.user_ids[5]].docs
    pipe.add_user("newcomer", [{"id": f"new-{i}", "date": f"2024-01-{i + 1:02d}", "fields": d.fields}
                               for i, d in enumerate(template[:6])])
    assert s.similar_users("newcomer")[0][0] == "newcomer" and len(s.user_index) == USERS + 1
    assert pipe.retrieve("newcomer", "description: " + template[0].fields["description"], k=3)
    gone = pipe.store.corpus.user_ids[0]
    texts = [pipe.store.text(r) for r in pipe.store.corpus.rows_of(gone)]
    pipe.retrieve(gone, "description: " + template[0].fields["description"], k=3)
    assert set(texts) & set(s._reranker._doc_tokens)  # the user's own docs were reranked: their tokens cached
    pipe.remove_user(gone)
    assert index_params(s.user_index.index) == params and len(s.user_index) == USERS
    assert not set(texts) & set(s._reranker._doc_tokens)  # deletion leaves no trace in the reranker's caches


def test_a_trained_reader_bundle_of_the_run_answers_generate(run_dir, tiny_bert, tmp_path):
    """`reader="reader"`: the run's trained reader answers `generate` (a label of the task), reading the question's
    query; a reader the run has not trained is refused, saying so."""
    from persrag_lightning.data.tasks import LAMP2_LABELS
    from persrag_lightning.reading.trained import TrainedReader
    from tests.helpers.reader import tiny_reader_export

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    tiny_reader_export(run / "reader", tiny_bert, "LaMP-2")
    pipe = CFRAGPipeline.from_pretrained(run, m=3, k_per_user=2, k=3, cache_dir=str(tmp_path / "cache"),
                                         reader="reader")
    assert isinstance(pipe.reader, TrainedReader) and pipe.reader.path == run / "reader"
    out = pipe.generate(pipe.store.corpus.user_ids[0], "Which tag does this movie relate to among the following "
                                                       "tags? description: a lonely robot tends a garden")
    assert out.answer in LAMP2_LABELS and out.prompt == "a lonely robot tends a garden" and len(out.docs) == 3
    assert pipe._llm is None  # no LLM was loaded to answer
    with pytest.raises(FileNotFoundError, match="reader is not trained yet"):
        CFRAGPipeline.from_pretrained(run_dir, m=3, k_per_user=2, k=3, cache_dir=str(tmp_path / "cache"),
                                      reader="reader")


def test_a_split_rerankers_doc_states_are_precomputed_for_the_store_and_each_user_attached(run_dir, tiny_bert,
                                                                                          tmp_path):
    """`precompute_doc_states`, on by default where the reranker served is split: every stored doc's states at
    load, a new user's when attached, none left of a deleted user; the docs and their order are the reranker's
    computed as they come."""
    from persrag_lightning.models.reranker import PersonalizedReranker

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    torch.manual_seed(0)
    PersonalizedReranker.from_encoder(tiny_bert, user_dim=32, split_layer=1).save_pretrained(run / "reranker_split")
    settings = {"m": 3, "k_per_user": 2, "k": 3, "cache_dir": str(tmp_path / "cache"), "reranker": "reranker_split"}
    lazy = CFRAGPipeline.from_pretrained(run, precompute_doc_states=False, **settings)
    assert len(lazy.strategy._reranker._split.cache) == 0
    # the evaluation's exact path keeps no doc cache, so nothing is precomputed by default there
    exact = CFRAGPipeline.from_pretrained(run, cache_doc_tokens=False, **settings)
    assert exact.strategy._reranker._split.cache is None
    pipe = CFRAGPipeline.from_pretrained(run, **settings)
    cache = pipe.strategy._reranker._split.cache
    store = pipe.store
    assert len(cache) == len({store.text(r) for u in store.corpus.user_ids for r in store.corpus.rows_of(u)})
    user = store.corpus.user_ids[1]
    query = "description: " + store.dataset.users[user].docs[0].fields["description"]
    want, got = lazy.retrieve(user, query), pipe.retrieve(user, query)
    assert [d.row for d in got] == [d.row for d in want]
    torch.testing.assert_close(torch.tensor([d.reranker_score for d in got]),
                               torch.tensor([d.reranker_score for d in want]), atol=1e-5, rtol=1e-5)
    template = store.dataset.users[store.corpus.user_ids[5]].docs
    docs = [{"id": f"new-{i}", "date": f"2024-01-{i + 1:02d}", "fields": {**d.fields, "description": f"new {i}"}}
            for i, d in enumerate(template[:4])]
    pipe.add_user("newcomer", docs)
    texts = [store.text(r) for r in store.corpus.rows_of("newcomer")]
    assert all(cache.get(t) is not None for t in texts)
    pipe.remove_user("newcomer")
    assert all(cache.get(t) is None for t in texts)
