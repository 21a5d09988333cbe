"""CFRAG's inference-time settings (issue 15, serving latency) on tiny random models: cached doc tokenisation and a
first cut that covers every candidate return exactly the baseline's docs, int8, ONNX Runtime and OpenVINO stay
within tolerance, the first cut keeps first-stage order after the reranked head, bf16 queries are embedded in bf16 and
scored in float32, and only non-default settings enter the evaluation cache key."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from persrag_lightning.models.reranker import PersonalizedReranker
from persrag_lightning.retrieval.base import Query, RetrievedDoc
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.retrieval.evaluate import strategy_config

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


def strategy(reranker: PersonalizedReranker, docs: list[str], **settings) -> CFRAG:
    """A CFRAG with its reranker in place and no other stage (rerank only reads the store, e_u and the reranker)."""
    s = CFRAG("unused", **settings)
    s.store, s._reranker = Store(docs), reranker
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
    from persrag_lightning.serving import pipeline

    installed = {"openvino", "onnx"}
    monkeypatch.setattr(pipeline.importlib.util, "find_spec", lambda name: object() if name in installed else None)
    monkeypatch.setattr(pipeline, "cpu_has_native_bf16", lambda: True)
    assert pipeline.serving_reranker_runtime() == "openvino"
    installed.clear()
    assert pipeline.serving_reranker_runtime() == "bf16"
    monkeypatch.setattr(pipeline, "cpu_has_native_bf16", lambda: False)
    assert pipeline.serving_reranker_runtime() == "fp32"


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


def test_bf16_queries_embed_in_bf16_and_score_in_float32(tiny_bert, one_thread):
    """query_runtime bf16: the query encoder runs under bf16 autocast, the vectors and first-stage scores stay
    float32 and close to the float32 ones."""
    from types import SimpleNamespace

    from persrag_lightning.models.text_encoder import TextEncoder
    from persrag_lightning.retrieval.candidates import CandidateSource

    encoder, seen = TextEncoder.from_pretrained(tiny_bert), []
    docs = encoder.encode(texts(6, 0))

    def query_vectors(queries: list[str]) -> torch.Tensor:
        seen.append(("embed", torch.is_autocast_enabled("cpu")))
        return encoder.encode(queries)

    def score(q: torch.Tensor, rows: list[int], e_u: None) -> torch.Tensor:
        seen.append(("score", torch.is_autocast_enabled("cpu")))
        return docs[torch.as_tensor(rows)] @ q

    retriever = SimpleNamespace(query_vectors=query_vectors, score=score)
    store = SimpleNamespace(shares=lambda u: True, rows=lambda owner, query=None: list(range(6)),
                            doc=lambda row, **kw: (row, kw["retriever_score"]))
    queries = [Query("u", t, t) for t in texts(3, 1)]
    out = {bf16: CandidateSource(store, retriever, lambda u: [("u", 1.0)], lambda u: None, 3,
                                 bf16_queries=bf16).propose(queries) for bf16 in (False, True)}
    assert seen == [("embed", False)] + [("score", False)] * 3 + [("embed", True)] + [("score", False)] * 3
    for fp32, half in zip(out[False], out[True]):
        assert all(isinstance(s, float) for _, s in half)
        assert [s for _, s in half] == pytest.approx([s for _, s in fp32], abs=0.05)


def test_the_distillation_comparison_reads_one_runs_teacher_and_students():
    """configs/evaluate_distilled.yaml: every CFRAG row is the same run's stage 1 and retriever; the rerankers are
    the teacher, the bundle cfrag_reranker_distilled.yaml exports and its two-layer variant, against the teacher."""
    import yaml

    from tests.conftest import REPO, evaluate_config_rows

    cfg, run, rows = evaluate_config_rows("evaluate_distilled.yaml")
    rows = {name: row for name, row in rows.items() if "retriever" in row}  # the CFRAG rows
    assert cfg.evaluation.split == "test" and cfg.evaluation.reference == "CFRAG"
    assert {r.user_encoder for r in rows.values()} == {f"{run}/user_encoder"}
    assert {r.retriever for r in rows.values()} == {f"{run}/retriever"}
    stage = yaml.safe_load((REPO / "configs" / "cfrag_reranker_distilled.yaml").read_text())
    assert stage["stage_name"] == "reranker_distilled" and stage["model"]["init_args"]["num_layers"] == 1
    assert stage["model"]["init_args"]["init_from"] == stage["data"]["init_args"]["teacher"] == "{run_dir}/reranker"
    assert [rows[n].reranker for n in ("CFRAG", "CFRAG (distilled reranker)", "CFRAG (distilled reranker, 2 layers)",
                                       "w/o reranker tuning")] == \
        [f"{run}/reranker", f"{run}/reranker_distilled", f"{run}/reranker_distilled_l2", None]
