"""CFRAG's inference-time settings (serving latency) on tiny random models: cached doc tokenisation and a
first cut that covers every candidate return exactly the baseline's docs, int8, ONNX Runtime and OpenVINO stay
within tolerance, the first cut keeps first-stage order after the reranked head, the query runtimes embed queries (never docs)
within tolerance, OpenVINO's static shapes compute the dynamic model's output, and only non-default settings enter
the evaluation cache key."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, replace

import pytest
import torch

from persrag_lightning.models.exported import BATCH_SHAPE, export_path
from persrag_lightning.models.reranker import PersonalizedReranker
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.retrieval.cohorts import CohortSettings
from persrag_lightning.retrieval.corpus_retriever import EncoderRetriever
from persrag_lightning.retrieval.pbr_strategy import PBRExpansion
from persrag_lightning.retrieval.strategies import set_reranker_runtime, strategy_config
from persrag_lightning.utils import fingerprint

WORDS = ["the", "a", "movie", "about", "space", "war", "love", "comedy", "drama", "robots", "future", "city",
         "night", "music", "school", "friends"]


def texts(n: int, seed: int, low: int = 3, high: int = 40) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (int(torch.randint(low, high, (1,),
                                                                                          generator=g)),), generator=g))
            for _ in range(n)]


@pytest.fixture()
def reranker(tiny_bert) -> PersonalizedReranker:
    torch.manual_seed(0)
    return PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval()


class Store:
    """What CFRAG.rerank reads of a DocStore: a row's text."""

    def __init__(self, docs: list[str]) -> None:
        self.docs = docs

    def text(self, row: int) -> str:
        return self.docs[row]


def strategy(model: PersonalizedReranker, docs: list[str], **settings) -> CFRAG:
    """A CFRAG with its reranker in place and no other stage (rerank only reads the store, e_u and the reranker)."""
    s = CFRAG("unused", **settings)
    s.store, s._reranker = Store(docs), model
    users = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    s.e_u = lambda u: users[int(u)]
    return s


def candidates(n_queries: int, per_query: int, n_docs: int) -> tuple[list[Query], list[list[RetrievedDoc]]]:
    g = torch.Generator().manual_seed(2)
    queries = [Query(str(i % 4), q, q) for i, q in enumerate(texts(n_queries, 3))]
    cands = [[RetrievedDoc(int(r), f"d{int(r)}", "0", retriever_score=float(s))
              for r, s in zip(torch.randperm(n_docs, generator=g)[:per_query], torch.rand(per_query, generator=g))]
             for _ in queries]
    return queries, cands


def rows(out: list[list[RetrievedDoc]]) -> list[list[int]]:
    return [[d.row for d in docs] for docs in out]


def test_cached_doc_tokens_build_the_same_pairs_token_for_token(reranker):
    queries, docs = texts(24, 0), texts(24, 1)
    docs[3] = " ".join(["robots"] * 300)  # longer than max_doc_length: cut once, cached cut
    plain = reranker.tokenize_pairs(queries, docs)
    reranker.config = replace(reranker.config, max_length=40, max_query_length=30, max_doc_length=30)
    short_plain = reranker.tokenize_pairs(queries, docs)  # pairs over budget: the doc side is cut further per pair
    reranker.cache_doc_tokens()
    for _ in range(2):  # the second pass reads the cache; nothing cut in place may leak into a later pair
        short = reranker.tokenize_pairs(queries, docs)
        assert all(torch.equal(short[k], short_plain[k]) for k in short_plain)
    reranker.config = replace(reranker.config, max_length=512, max_query_length=256, max_doc_length=256)
    reranker.cache_doc_tokens()  # a new cut length: a new cache
    for _ in range(2):
        cached = reranker.tokenize_pairs(queries, docs)
        assert all(torch.equal(cached[k], plain[k]) for k in plain)


def test_cached_doc_tokens_and_a_first_cut_over_every_candidate_return_the_baselines_docs(reranker, one_thread):
    docs = texts(40, 4)
    queries, cands = candidates(6, 10, len(docs))
    base = strategy(reranker, docs).rerank(queries, cands, 5)
    same = strategy(reranker, docs, rerank_top=10, cache_doc_tokens=True).rerank(queries, cands, 5)
    assert rows(same) == rows(base)
    assert [[d.reranker_score for d in ds] for ds in same] == [[d.reranker_score for d in ds] for ds in base]


def test_first_cut_reranks_the_best_first_stage_candidates_then_keeps_first_stage_order(reranker, one_thread):
    docs = texts(40, 5)
    queries, cands = candidates(4, 10, len(docs))
    top = 3
    out = strategy(reranker, docs, rerank_top=top).rerank(queries, cands, 6)
    for q, ds, got in zip(queries, cands, out):
        by_first = sorted(ds, key=lambda d: -d.retriever_score)
        head, tail = by_first[:top], by_first[top:]
        scores = reranker.score_pairs([q.query] * top, [docs[d.row] for d in head],
                                      torch.stack([strategy(reranker, docs).e_u(q.user_id)] * top))
        assert [d.row for d in got[:top]] == [head[i].row for i in torch.argsort(scores, descending=True).tolist()]
        assert [d.row for d in got[top:]] == [d.row for d in tail[:3]]  # the rest: first-stage order, unscored
        assert all(d.reranker_score != d.reranker_score for d in got[top:])  # NaN: never reranked


def test_a_first_cut_reranker_chooses_the_pairs_the_reranker_scores(reranker, tiny_bert, one_thread):
    """first_cut: a cheaper reranker scores all m·k candidates, the reranker only its top rerank_top (in its own
    order), the rest follow in the cut's order unscored; the reranker itself as the cut keeps the full rerank's
    top k whenever rerank_top ≥ k."""
    docs = texts(40, 6)
    queries, cands = candidates(4, 10, len(docs))
    torch.manual_seed(3)
    cut = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval()  # other weights: another order
    top = 4

    def cascade(cut_model: PersonalizedReranker) -> CFRAG:
        s = strategy(reranker, docs, reranker="unused", rerank_top=top, first_cut="unused")
        s._first_cut = cut_model
        return s

    full = strategy(reranker, docs).rerank(queries, cands, 3)
    assert rows(cascade(reranker).rerank(queries, cands, 3)) == rows(full)
    s = cascade(cut)
    out = s.rerank(queries, cands, 7)
    for q, ds, got in zip(queries, cands, out):
        users = torch.stack([s.e_u(q.user_id)] * len(ds))
        by_cut = [ds[i] for i in torch.argsort(cut.score_pairs([q.query] * len(ds), [docs[d.row] for d in ds],
                                                               users), descending=True).tolist()]
        head = by_cut[:top]
        scores = reranker.score_pairs([q.query] * top, [docs[d.row] for d in head], users[:top])
        assert [d.row for d in got[:top]] == [head[i].row for i in torch.argsort(scores, descending=True).tolist()]
        assert [d.row for d in got[top:]] == [d.row for d in by_cut[top:7]]
        assert all(d.reranker_score != d.reranker_score for d in got[top:])
    with pytest.raises(ValueError, match="first_cut"):
        CFRAG("unused", reranker="unused", first_cut="unused")  # no rerank_top: nothing for the cut to choose


def test_int8_reranker_stays_within_tolerance_of_fp32(tiny_bert, one_thread):
    torch.manual_seed(0)
    fp32 = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval()
    torch.manual_seed(0)
    int8 = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval().for_inference("int8")
    assert int8.runtime == "int8" and any("quantized" in type(m).__module__ for m in int8.encoder.modules())
    queries, docs = texts(32, 6), texts(32, 7)
    users = torch.randn(32, 8, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        a, b = fp32.score_pairs(queries, docs, users), int8.score_pairs(queries, docs, users)
    # the stated tolerance: score error below 10 % of the spread of scores, rank correlation ≥ 0.9
    assert (a - b).abs().max() < 0.1 * a.std()
    ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
    assert torch.corrcoef(torch.stack([ra, rb]))[0, 1] >= 0.9


def fp32_and_exported(tiny_bert: str, runtime: str, path) -> tuple[PersonalizedReranker, PersonalizedReranker]:
    """The same random reranker twice: as trained (fp32 torch) and in an exported runtime reading `path`."""
    torch.manual_seed(0)
    fp32 = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval()
    torch.manual_seed(0)
    exported = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval().for_inference(runtime, path)
    assert exported.runtime == runtime and path.is_file()
    return fp32, exported


def test_onnx_reranker_matches_fp32_across_batch_shapes(tiny_bert, tmp_path, one_thread):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    path = tmp_path / "onnx" / "reranker.onnx"
    fp32, onnx = fp32_and_exported(tiny_bert, "onnx", path)
    queries, docs = texts(20, 9), texts(20, 10, high=60)
    users = torch.randn(20, 8, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        for batch in (1, 7, 20):  # other batch sizes and lengths than the export's sample
            assert torch.allclose(onnx.score_pairs(queries, docs, users, batch_size=batch),
                                  fp32.score_pairs(queries, docs, users), atol=1e-4)
    again = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval()
    mtime = path.stat().st_mtime_ns
    again.for_inference("onnx", path)  # an existing export is loaded, not made again
    assert path.stat().st_mtime_ns == mtime


def test_openvino_reranker_stays_within_tolerance_and_shares_the_onnx_export(tiny_bert, tmp_path, one_thread):
    """OpenVINO reads the same ONNX export as ONNX Runtime (made once); it computes in bf16 where the CPU does
    natively, so its scores are held to a tolerance (error below 5 % of the scores' spread, ranks correlated
    ≥ 0.95), across batch shapes other than the export's sample."""
    pytest.importorskip("openvino")
    pytest.importorskip("onnx")
    path = tmp_path / "onnx" / "reranker.onnx"
    fp32, ov = fp32_and_exported(tiny_bert, "openvino", path)
    queries, docs = texts(24, 12), texts(24, 13, high=60)
    users = torch.randn(24, 8, generator=torch.Generator().manual_seed(14))
    fp32.warm()  # no-op in torch
    ov.warm()  # the batches' model compiled before the first batch
    assert list(ov._session.requests) == [BATCH_SHAPE]
    with torch.no_grad():
        a = fp32.score_pairs(queries, docs, users)
        for batch in (1, 5, 24):
            b = ov.score_pairs(queries, docs, users, batch_size=batch)
            assert b.dtype == torch.float32 and (a - b).abs().max() < 0.05 * a.std()
            ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
            assert torch.corrcoef(torch.stack([ra, rb]))[0, 1] >= 0.95
    mtime = path.stat().st_mtime_ns
    PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval().for_inference("openvino", path)
    assert path.stat().st_mtime_ns == mtime  # read, not exported again


def test_serving_runtime_prefers_openvino_where_installed(monkeypatch):
    from persrag_lightning import hardware
    from persrag_lightning.serving import runtimes as pipeline

    installed = {"openvino", "onnx"}
    monkeypatch.setattr(pipeline.importlib.util, "find_spec", lambda name: object() if name in installed else None)
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert pipeline.serving_runtime("reranker") == pipeline.serving_runtime("query") == "openvino"
    installed.clear()
    assert pipeline.serving_runtime("reranker") == "bf16"
    assert pipeline.serving_runtime("query") == "fp32"  # bf16 autocast embedded one query slower than fp32
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert pipeline.serving_runtime("reranker") == "fp32"


def test_unknown_runtime_and_bad_first_cut_are_refused(reranker):
    with pytest.raises(ValueError, match="runtime"):
        reranker.for_inference("fp8")
    with pytest.raises(ValueError, match="reranker_runtime"):
        CFRAG("unused", reranker_runtime="fp8")
    with pytest.raises(ValueError, match="rerank_top"):
        CFRAG("unused", rerank_top=0)
    with pytest.raises(ValueError, match="query_runtime"):
        CFRAG("unused", query_runtime="int8")


def test_only_non_default_settings_enter_the_evaluation_cache_key():
    base = strategy_config(CFRAG("unused"))
    assert not {"rerank_top", "reranker_runtime", "cache_doc_tokens", "_cache_doc_tokens"} & set(base)
    assert strategy_config(CFRAG("unused", rerank_top=None, reranker_runtime="fp32")) == base
    assert strategy_config(CFRAG("unused", cache_doc_tokens=True)) == base  # same pairs, same retrievals
    assert strategy_config(CFRAG("unused", rerank_top=10)) == {**base, "rerank_top": 10}
    assert strategy_config(CFRAG("unused", reranker_runtime="int8")) == {**base, "reranker_runtime": "int8"}
    assert strategy_config(CFRAG("unused", query_runtime="bf16")) == {**base, "query_runtime": "bf16"}


def test_a_cfrag_key_is_its_declared_settings_whatever_attributes_it_holds():
    """CFRAG.cache_config names what it retrieves by; the key of the paper's row is the one it always had, and
    neither runtime state nor a runtime chosen later by the evaluation slips in or out by attribute presence."""
    paper = {"class": "CFRAG", "query_expansion": "none", "pbr": asdict(PBRExpansion()), "user_encoder_path": "ue",
             "retriever_spec": "minilm", "reranker_path": "r", "m": 6, "k_per_user": 5, "users": "encoder",
             "retriever_user_term": True}
    row = CFRAG("ue", reranker="r")
    assert strategy_config(row) == paper
    row.user_row, row._reranker = {"u": 0}, object()  # what prepare sets
    assert strategy_config(row) == paper
    set_reranker_runtime([row], "int8")  # the evaluation's runtime for rows that name none: now part of the key
    assert strategy_config(row) == {**paper, "reranker_runtime": "int8"}
    cluster = strategy_config(CFRAG("ue", users="cluster"))
    assert cluster == {**paper, "reranker_path": None, "users": "cluster",
                       "cohort_settings": asdict(CohortSettings())}


def query_retriever(tiny_bert: str, cache) -> EncoderRetriever:
    """The untuned tiny encoder as a corpus retriever over three docs of one user."""
    from persrag_lightning.data.records import HistoryDoc, LampDataset, User

    docs = [HistoryDoc(f"d{i}", (2020, 1, i + 1), {"description": f"film {i}", "tag": "comedy"}) for i in range(3)]
    retriever = EncoderRetriever(tiny_bert, DocStore(LampDataset("LaMP-2", {"u1": User("u1", docs)}, {})).corpus,
                                 cache, 64)
    retriever.prepare()
    return retriever


def test_query_runtimes_embed_queries_only_within_tolerance(tiny_bert, tmp_path, one_thread):
    """query_runtime: bf16 autocasts the query encoder only while it embeds; onnx (float32) and openvino (bf16 where
    native) read one export of the query encoder, made once under the cache; the doc vectors never change."""
    queries = texts(9, 3, high=60)
    fp32 = query_retriever(tiny_bert, tmp_path / "cache")
    want, docs = fp32.query_vectors(queries), fp32.encode_docs(["film 0", "film 1"])
    with pytest.raises(ValueError, match="query runtime"):
        fp32.use_query_runtime("int8")
    seen = []
    fp32.query_encoder().register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    fp32.use_query_runtime("bf16")
    got = fp32.query_vectors(queries)
    assert seen and all(seen) and not torch.is_autocast_enabled("cpu") and got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05
    seen.clear()
    assert torch.equal(fp32.encode_docs(["film 0", "film 1"]), docs) and seen == [False]
    for runtime, modules, tolerance in (("onnx", ("onnxruntime", "onnx"), 1e-4), ("openvino", ("openvino", "onnx"),
                                                                                   0.05)):
        if any(importlib.util.find_spec(m) is None for m in modules):
            continue
        retriever = query_retriever(tiny_bert, tmp_path / "cache")
        retriever.use_query_runtime(runtime, tmp_path / "cache")
        path = export_path(tmp_path / "cache", "query", fingerprint(retriever.identity()))
        assert retriever.query_runtime == runtime and path.is_file()
        for batch in (queries[:1], queries):  # one query (serving) and a batch of several lengths
            got = retriever.query_vectors(batch)
            assert got.dtype == torch.float32 and (got - want[:len(batch)]).abs().max() < tolerance
        assert torch.equal(retriever.encode_docs(["film 0", "film 1"]), docs)
        mtime = path.stat().st_mtime_ns
        query_retriever(tiny_bert, tmp_path / "cache").use_query_runtime(runtime, tmp_path / "cache")
        assert path.stat().st_mtime_ns == mtime  # read, not exported again


def test_openvino_static_shapes_compute_the_dynamic_models_output(reranker, tmp_path, monkeypatch, one_thread):
    """StaticShapes pads each batch to its width rounded up to WIDTH_STEP (masked, as the batch's own padding),
    compiles one model per width for one row and one model of dynamic rows and width for every batch of several
    rows, reuses them and keeps the last MAX_SHAPES; the export leaves the model's own attention implementation as
    it was."""
    pytest.importorskip("openvino")
    pytest.importorskip("onnx")
    from persrag_lightning.models import exported
    from persrag_lightning.models.reranker import export_onnx

    before = reranker.encoder.config._attn_implementation
    path = export_onnx(reranker, tmp_path / "reranker.onnx")
    assert reranker.encoder.config._attn_implementation == before
    dynamic, static = exported.openvino_session(path, width_step=None), exported.openvino_session(path)
    assert isinstance(static, exported.StaticShapes)
    batches = [reranker.tokenize_pairs(texts(n, n), texts(n, n + 1, high=h))
               for n, h in ((3, 8), (3, 12), (5, 60), (1, 8), (1, 60), (4, 8))]
    widths = [b["input_ids"].shape[1] for b in batches]
    for batch in batches:
        assert torch.allclose(static(batch), dynamic(batch), atol=1e-2)
    ones = {(1, -(-w // exported.WIDTH_STEP) * exported.WIDTH_STEP) for b, w in zip(batches, widths)
            if b["input_ids"].shape[0] == 1}
    several = {-(-w // exported.WIDTH_STEP) * exported.WIDTH_STEP for b, w in zip(batches, widths)
               if b["input_ids"].shape[0] > 1}
    assert len(ones) == 2 and len(several) > 1  # batches of several widths...
    assert set(static.requests) == ones | {exported.BATCH_SHAPE}  # ...all in one model
    compiled = dict(static.requests)
    static(batches[0])  # a shape met before: no new model
    assert static.requests == compiled
    monkeypatch.setattr(exported, "MAX_SHAPES", 1)
    bounded = exported.openvino_session(path)
    bounded(batches[3])
    bounded(batches[2])
    assert list(bounded.requests) == [exported.BATCH_SHAPE]


def test_a_served_query_never_waits_for_an_openvino_compile(tiny_bert, tmp_path, one_thread):
    """warm_query_shapes compiles one query's shape at every width up to the query encoder's max_length and the
    model batches take, so a query of any length and a batch of any size then find their model compiled; in
    another runtime it does nothing."""
    pytest.importorskip("openvino")
    pytest.importorskip("onnx")
    from persrag_lightning.models import exported

    retriever = query_retriever(tiny_bert, tmp_path / "cache")
    assert retriever.warm_query_shapes() == 0  # torch fp32: nothing to compile
    retriever.use_query_runtime("openvino", tmp_path / "cache")
    session, max_length = retriever._query_session, retriever.query_encoder().max_length
    warmed = retriever.warm_query_shapes()
    assert warmed == -(-max_length // exported.WIDTH_STEP) + 1 and len(session.requests) == warmed
    assert set(session.requests) == {(1, w) for w in range(exported.WIDTH_STEP, (warmed - 1) * exported.WIDTH_STEP + 1,
                                                           exported.WIDTH_STEP)} | {exported.BATCH_SHAPE}
    compiled = dict(session.requests)
    for query in texts(1, 1, high=5) + texts(1, 1, high=60) + [" ".join(["film"] * (2 * max_length))]:
        retriever.query_vectors([query])
    for n, high in ((2, 5), (3, 5), (7, 60)):  # batches of every size and width
        retriever.query_vectors(texts(n, n, high=high))
    assert session.requests.keys() == compiled.keys() and all(session.requests[s] is compiled[s] for s in compiled)


def test_the_distillation_comparison_reads_one_runs_teacher_and_students():
    """configs/evaluate_distilled.yaml: every CFRAG row is the same run's stage 1 and retriever; the rerankers are
    the teacher, the bundle cfrag_reranker_distilled.yaml exports and its two-layer variant, against the teacher."""
    import yaml

    from tests.conftest import REPO, evaluate_config_rows

    cfg, run, rows = evaluate_config_rows("evaluate_distilled.yaml")
    rows = {name: row for name, row in rows.items() if "retriever" in row}  # the CFRAG rows
    assert cfg.evaluation.init_args.split == "test" and cfg.evaluation.init_args.reference == "CFRAG"
    assert {r.user_encoder for r in rows.values()} == {f"{run}/user_encoder"}
    assert {r.retriever for r in rows.values()} == {f"{run}/retriever"}
    stage = yaml.safe_load((REPO / "configs" / "cfrag_reranker_distilled.yaml").read_text())
    assert stage["stage_name"] == "reranker_distilled" and stage["model"]["init_args"]["config"]["num_layers"] == 1
    assert stage["model"]["init_args"]["init_from"] == stage["data"]["init_args"]["feedback"]["teacher"] \
        == "{run_dir}/reranker"
    assert [rows[n].reranker for n in ("CFRAG", "CFRAG (distilled reranker)", "CFRAG (distilled reranker, 2 layers)",
                                       "w/o reranker tuning")] == \
        [f"{run}/reranker", f"{run}/reranker_distilled", f"{run}/reranker_distilled_l2", None]
