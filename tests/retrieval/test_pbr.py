"""PBR: PageRank, graph, fusion, P-PRF parsing, the LLM cache (resume, shards), small users, the eval loop."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import scipy.sparse as sp

from persrag_lightning.data.prompt_store import PromptStore
from persrag_lightning.retrieval.llm_cache import CachedLLM, cache_key
from persrag_lightning.retrieval.pbr import (
    PBRRetriever,
    PBRSettings,
    expand_query,
    fusion_weight,
    personal_history,
)
from persrag_lightning.retrieval.pbr_anchor import (
    anchor_embedding,
    cosine_similarity_matrix,
    pagerank,
    sparse_adjacency,
    transition_matrix,
)
from persrag_lightning.retrieval.pbr_prompts import parse_utterances, utterance_prompt

DIM = 16


def fake_encode(texts: list[str]) -> np.ndarray:
    """Deterministic unit vectors from a hash of each text (no model needed)."""
    rows = []
    for t in texts:
        seed = int(hashlib.sha256(t.encode()).hexdigest()[:8], 16)
        v = np.random.default_rng(seed).standard_normal(DIM)
        rows.append(v / np.linalg.norm(v))
    return np.asarray(rows, dtype=np.float32).reshape(len(texts), DIM)


class CountingLLM:
    """Answers every prompt with valid JSON (utterance prompts) or a text; counts prompts; optionally dies."""

    def __init__(self, fingerprint: str = "fake:llm:1", fail_after: int | None = None, answer: str | None = None):
        self._fingerprint = fingerprint
        self.fail_after = fail_after
        self.answer = answer
        self.calls = 0
        self.batches: list[int] = []

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            if self.fail_after is not None and self.calls >= self.fail_after:
                raise RuntimeError("killed")
            self.calls += 1
            digest = hashlib.sha256(p.encode()).hexdigest()[:6]
            if self.answer is not None:
                out.append(self.answer)
            elif "candidates" in p:
                out.append(json.dumps({"candidates": [f"utterance {digest} {i}" for i in range(3)]}))
            else:
                out.append(f"step 1 reasoning {digest}")
        return out


USERS = {f"u{u}": [f"user {u} chunk {i} about topic {i % 3}" for i in range(6 + u)] for u in range(3)}
QUERIES = {u: [f"question {j} of {u}" for j in range(3)] for u in USERS}
PROMPTS_PER_RUN = 2 * sum(len(q) for q in QUERIES.values())  # one utterance + one reasoning prompt per query


def run_all(llm: CountingLLM, cache_dir, settings: PBRSettings | None = None, batch_size: int = 2):
    retriever = PBRRetriever(fake_encode, settings or PBRSettings(theta=0.0),
                             CachedLLM(llm, cache_dir, batch_size=batch_size))
    out = {}
    for user, texts in USERS.items():
        retriever.add_user(user, texts)
        out[user] = [r.indices for r in retriever.retrieve(user, QUERIES[user])]
    return out, retriever


# ------------------------------------------------------------------------------------------------- PageRank

P_SMALL = np.array([[0.2, 0.8, 0.0], [0.3, 0.4, 0.3], [0.5, 0.0, 0.5]])


def test_pagerank_without_damping_is_the_stationary_distribution():
    # closed form: π Pᵀ-fixed point with Σπ = 1, from the linear system (Pᵀ − I) π = 0 plus the sum row
    a = np.vstack([P_SMALL.T - np.eye(3), np.ones(3)])
    expected = np.linalg.lstsq(a, np.array([0, 0, 0, 1.0]), rcond=None)[0]
    result = pagerank(sp.csr_matrix(P_SMALL), damping=1.0, max_iter=50, tol=1e-12)
    np.testing.assert_allclose(result.pi, expected, atol=1e-8)
    assert result.pi.sum() == pytest.approx(1.0)


def test_pagerank_with_damping_matches_closed_form():
    alpha = 0.85
    expected = (1 - alpha) / 3 * np.linalg.solve(np.eye(3) - alpha * P_SMALL.T, np.ones(3))
    result = pagerank(sp.csr_matrix(P_SMALL), damping=alpha, max_iter=50, tol=1e-12)
    np.testing.assert_allclose(result.pi, expected, atol=1e-8)
    undamped = pagerank(sp.csr_matrix(P_SMALL), damping=1.0, max_iter=50, tol=1e-12).pi
    assert np.abs(result.pi - undamped).max() > 1e-3  # damping must change the answer


def test_pagerank_stops_at_max_iter_and_tolerance():
    assert pagerank(sp.csr_matrix(P_SMALL), damping=1.0, max_iter=3, tol=1e-12).steps == 3
    stopped = pagerank(sp.csr_matrix(P_SMALL), damping=1.0, max_iter=3, tol=1e-12)
    assert not stopped.converged and stopped.residual > 1e-12
    loose = pagerank(sp.csr_matrix(P_SMALL), damping=1.0, max_iter=50, tol=1e-2)
    assert loose.converged and loose.steps < 50 and loose.residual < 1e-2


def test_non_converged_anchor_is_warned_with_its_residual_and_counted(caplog):
    # through the retriever: a graph whose π moves away from uniform, with one step allowed, cannot converge
    embs = np.array([[1, 0], [0.6, 0.8], [0, 1]], dtype=np.float32)
    stopped = PBRRetriever(lambda t: np.zeros((len(t), 2), np.float32),
                           PBRSettings(use_prf=False, theta=-1.0, k2=2, damping=1.0, max_iter=1, tol=1e-12))
    stopped.add_user("v", ["x", "y", "z"], embs)
    with caplog.at_level("WARNING", logger="persrag_lightning.retrieval.pbr"):
        stopped.anchor("v")
    assert stopped.stats.pagerank_not_converged == 1
    assert stopped.stats.pagerank_residuals[0] > 1e-12
    assert "did not converge" in caplog.text and "L1 change" in caplog.text
    # the same graph with the default budget converges: nothing counted
    fine = PBRRetriever(lambda t: np.zeros((len(t), 2), np.float32), PBRSettings(use_prf=False))
    fine.add_user("v", ["x", "y", "z"], embs)
    fine.anchor("v")
    assert fine.stats.pagerank_not_converged == 0


def test_graph_threshold_topk_self_loops_and_row_normalisation():
    e = np.array([[1, 0], [0.9, math.sqrt(1 - 0.81)], [0, 1], [-1, 0]], dtype=np.float32)
    s = cosine_similarity_matrix(e)
    a = sparse_adjacency(s, theta=0.5, k2=2).toarray()
    # row 0: itself (1.0) and row 1 (0.9); row 2 is below θ against row 0, row 3 negative
    assert a[0, 0] == pytest.approx(1.0) and a[0, 1] == pytest.approx(0.9) and a[0, 2] == 0 and a[0, 3] == 0
    # row 3 is only similar to itself: the self-loop keeps the row non-empty
    assert a[3].nonzero()[0].tolist() == [3]
    # authors' code: the chunk is one of its own k2, so k2 = 1 keeps only the self-loop everywhere
    assert (sparse_adjacency(s, theta=0.0, k2=1, self_in_top_k2=True).toarray() == np.diag(np.diag(s))).all()
    # Eq. 8's neighbours are other chunks: k2 = 1 keeps the self-loop and the one nearest other chunk
    one = sparse_adjacency(s, theta=0.0, k2=1).toarray()
    assert (np.diag(one) == pytest.approx(1.0)) and [int((row != 0).sum()) for row in one] == [2, 2, 2, 1]
    assert one[0, 1] == pytest.approx(0.9) and one[1, 0] == pytest.approx(0.9)
    # k2 = 2: two real neighbours per row (where above θ), not one real neighbour and the node itself
    e5 = np.array([[1, 0, 0], [0.99, 0.14, 0], [0.98, 0, 0.2], [0.97, 0.17, 0.17], [0, 0, 1]], dtype=np.float32)
    s5 = cosine_similarity_matrix(e5)
    assert int((sparse_adjacency(s5, theta=0.5, k2=2).toarray()[0] != 0).sum()) == 3  # self + 2 others
    assert int((sparse_adjacency(s5, theta=0.5, k2=2, self_in_top_k2=True).toarray()[0] != 0).sum()) == 2
    p = transition_matrix(sp.csr_matrix(a)).toarray()
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    assert p[0, 1] == pytest.approx(0.9 / 1.9)


def test_anchor_is_pi_weighted_sum():
    e = np.eye(3, dtype=np.float32)
    np.testing.assert_allclose(anchor_embedding(np.array([0.5, 0.3, 0.2]), e), [0.5, 0.3, 0.2], atol=1e-7)


# --------------------------------------------------------------------------------------------------- fusion

def test_fusion_weights_on_hand_made_vectors():
    q = np.array([1.0, 0, 0], dtype=np.float32)
    c = np.array([0, 1.0, 0], dtype=np.float32)
    f = np.array([1.0, 1.0, 0], dtype=np.float32) / math.sqrt(2)
    r = np.array([0, 0, 1.0], dtype=np.float32)
    assert fusion_weight(q, c, f) == pytest.approx(2.0)  # (q + c)/2 is parallel to f
    assert fusion_weight(q, c, r) == pytest.approx(1.0)  # orthogonal
    assert fusion_weight(q, c, -f) == pytest.approx(0.0, abs=1e-6)  # opposite
    s2 = math.sqrt(2)
    np.testing.assert_allclose(expand_query(q, c, f, r), [1 + s2, 1 + s2, 1.0], atol=1e-6)
    # w/o P-Anchor: weights from q alone (cos(q/2, f) = 1/√2), no c term
    w1 = 1 + 1 / s2
    np.testing.assert_allclose(expand_query(q, None, f, r), q + w1 * f + 1.0 * r, atol=1e-6)
    # w/o P-PRF: q* = q + c; Base: q* = q
    np.testing.assert_allclose(expand_query(q, c), q + c)
    np.testing.assert_allclose(expand_query(q), q)


# ---------------------------------------------------------------------------------------------------- P-PRF

def test_llm_answer_that_is_not_json_falls_back_to_one_utterance():
    assert parse_utterances("Sure! Here you go: I like cats.") == ["Sure! Here you go: I like cats."]
    assert parse_utterances('{"candidates": ["a b", " c "]}') == ["a b", "c"]
    assert parse_utterances('```json\n{"candidates": ["a"]}\n```') == ["a"]
    assert parse_utterances('{"other": 1}') == ['{"other": 1}']  # valid JSON, no candidates: raw text
    assert parse_utterances('{"candidates": [1, 2]}') == ['{"candidates": [1, 2]}']
    assert parse_utterances("   ") == []
    assert parse_utterances('{"candidates": ["a", "b", "c"]}', max_utterances=2) == ["a", "b"]


def test_non_json_answer_is_embedded_as_the_single_utterance(tmp_path):
    llm = CountingLLM(answer="just some words")
    retriever = PBRRetriever(fake_encode, PBRSettings(use_anchor=False), CachedLLM(llm, tmp_path))
    retriever.add_user("u", USERS["u0"])
    q_star, weights, feedback = retriever.expanded_queries("u", ["what?"])
    assert feedback[0].utterances == ("just some words",)
    q = fake_encode(["what?"])[0]
    f = fake_encode(["just some words"])[0]
    np.testing.assert_allclose(q_star[0], expand_query(q, None, f, f), atol=1e-5)
    assert weights[0][0] == pytest.approx(1 + float(q @ f) / float(np.linalg.norm(q) * np.linalg.norm(f)),
                                          abs=1e-5)


def test_default_averages_the_papers_m_5_utterances(tmp_path):
    ten = json.dumps({"candidates": [f"utterance number {i} about topic {i % 3}" for i in range(10)]})
    llm = CachedLLM(CountingLLM(answer=ten), tmp_path)
    r = PBRRetriever(fake_encode, PBRSettings(), llm)
    assert r.settings.max_utterances == 5
    r.add_user("u", USERS["u1"])
    (fb,) = r.pseudo_feedback("u", ["q"], fake_encode(["q"]))
    assert list(fb.utterances) == json.loads(ten)["candidates"][:5]
    every = PBRRetriever(fake_encode, PBRSettings(max_utterances=None), llm)
    every.users = r.users
    assert len(every.pseudo_feedback("u", ["q"], fake_encode(["q"]))[0].utterances) == 10
    with pytest.raises(ValueError, match="max_utterances"):
        PBRSettings(max_utterances=0)


class SchemaLLM(CountingLLM):
    """A backend that can constrain decoding: free answers echo the template, constrained ones are valid JSON."""

    supports_json_schema = True

    def __init__(self) -> None:
        super().__init__("fake:schema:1", answer='{ "candidates": [...", "...", "..."] }')
        self.schemas: list[dict | None] = []

    def generate(self, prompts: list[str], max_new_tokens: int, json_schema: dict | None = None) -> list[str]:
        self.schemas.append(json_schema)
        if json_schema is None:
            return super().generate(prompts, max_new_tokens)
        self.calls += len(prompts)
        n = json_schema["properties"]["candidates"]["maxItems"]
        return [json.dumps({"candidates": [f"constrained {i} {hashlib.sha256(p.encode()).hexdigest()[:4]}"
                                           for i in range(n)]}) for p in prompts]


def test_utterances_are_decoded_under_the_json_schema_and_cached_apart(tmp_path):
    from persrag_lightning.retrieval.pbr import utterance_schema

    schema = utterance_schema(5, 512)
    items = schema["properties"]["candidates"]
    assert items["maxItems"] == 5 and items["items"]["type"] == "string" and schema["required"] == ["candidates"]
    assert 5 * items["items"]["maxLength"] * 1 <= 512 * 3  # m strings fit the token budget at 3 chars per token
    raw = SchemaLLM()
    llm = CachedLLM(raw, tmp_path)
    r = PBRRetriever(fake_encode, PBRSettings(), llm)
    r.add_user("u", USERS["u1"])
    (fb,) = r.pseudo_feedback("u", ["q"], fake_encode(["q"]))
    assert r.json_constrained and fb.parsed_json and len(fb.utterances) == 5
    assert raw.schemas[0] == utterance_schema(5, r.settings.utterance_tokens)  # the utterance prompt: constrained
    assert raw.schemas[1] is None  # the reasoning prompt: free text
    free = PBRRetriever(fake_encode, PBRSettings(json_schema=False), llm)
    free.users = r.users
    (fb_free,) = free.pseudo_feedback("u", ["q"], fake_encode(["q"]))
    assert not free.json_constrained and not fb_free.parsed_json  # a separate cache entry, not the constrained one
    # a backend that cannot constrain: free decoding, said once
    plain = PBRRetriever(fake_encode, PBRSettings(), CachedLLM(CountingLLM(), tmp_path / "plain"))
    assert not plain.json_constrained


def test_prompt_is_the_seeds_with_history_and_query():
    p = utterance_prompt("HIST", "QUERY")
    assert "User dialogue history (for style imitation): HIST" in p
    assert "Current question (to inspire the utterances): QUERY" in p
    assert '{ "candidates": [ "...", "...", "..."] }' in p


def test_user_with_fewer_chunks_than_k1_and_k2(tmp_path):
    llm = CountingLLM()
    settings = PBRSettings(k1=5, k2=10, theta=0.0)
    retriever = PBRRetriever(fake_encode, settings, CachedLLM(llm, tmp_path))
    retriever.add_user("small", ["only chunk", "second chunk"])
    assert len(personal_history(fake_encode(["q"])[0], retriever.users["small"].embeddings, 5)) == 2
    [ranking] = retriever.retrieve("small", ["q"], k=5)
    assert sorted(ranking.indices) == [0, 1]
    assert len(ranking.feedback.history) == 2
    anchor = retriever.anchor("small")
    assert np.isfinite(anchor).all() and np.linalg.norm(anchor) > 0
    one = PBRRetriever(fake_encode, settings.for_variant("PBR w/o P-PRF"))
    one.add_user("one", ["lonely chunk"])
    assert one.retrieve("one", ["q"], k=5)[0].indices == (0,)


# ---------------------------------------------------------------------------------------------------- cache

def test_second_run_makes_zero_llm_calls(tmp_path):
    first_llm = CountingLLM()
    first, _ = run_all(first_llm, tmp_path)
    assert first_llm.calls == PROMPTS_PER_RUN
    second_llm = CountingLLM()
    second, retriever = run_all(second_llm, tmp_path)
    assert second_llm.calls == 0
    assert retriever.stats.llm_calls == 0 and retriever.stats.llm_hits == PROMPTS_PER_RUN
    assert first == second


def test_killed_run_resumes_with_only_the_remaining_calls(tmp_path):
    dying = CountingLLM(fail_after=5)
    with pytest.raises(RuntimeError, match="killed"):
        run_all(dying, tmp_path, batch_size=1)
    assert dying.calls == 5
    assert len(PromptStore(tmp_path).values) == 5  # every answer returned before the kill is on disk
    rerun = CountingLLM()
    run_all(rerun, tmp_path, batch_size=1)
    assert rerun.calls == PROMPTS_PER_RUN - 5


def test_cache_key_separates_llms_and_generation_settings(tmp_path):
    run_all(CountingLLM("fake:a"), tmp_path)
    other = CountingLLM("fake:b")
    run_all(other, tmp_path)
    assert other.calls == PROMPTS_PER_RUN  # another model never reads the first one's answers
    longer = CountingLLM("fake:a")
    run_all(longer, tmp_path, PBRSettings(theta=0.0, reasoning_tokens=999))
    assert longer.calls == PROMPTS_PER_RUN // 2  # only the reasoning prompts changed key
    assert cache_key("p", "fake:a", 1) != cache_key("p", "fake:a", 2) != cache_key("p", "fake:b", 2)


def test_shards_fill_disjoint_parts(tmp_path):
    counts = []
    for shard in range(2):
        llm = CountingLLM()
        retriever = PBRRetriever(fake_encode, PBRSettings(theta=0.0), CachedLLM(llm, tmp_path))
        for user, texts in USERS.items():
            retriever.add_user(user, texts)
            retriever.fill_cache(user, QUERIES[user], shard=shard, num_shards=2)
        counts.append(llm.calls)
    assert sum(counts) == PROMPTS_PER_RUN and all(c > 0 for c in counts)
    final = CountingLLM()
    run_all(final, tmp_path)
    assert final.calls == 0


def test_corrupt_cache_entry_is_regenerated(tmp_path):
    run_all(CountingLLM(), tmp_path)
    victim = next(tmp_path.rglob("*.jsonl"))  # a writer killed mid-line leaves a torn last line
    lines = victim.read_text().splitlines(keepends=True)
    victim.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    again = CountingLLM()
    run_all(again, tmp_path)
    assert again.calls == 1


# -------------------------------------------------------------------------------------------- anchors, variants

def test_anchor_memoised_per_user_and_settings_and_on_disk(tmp_path):
    r = PBRRetriever(fake_encode, PBRSettings(use_prf=False, theta=0.0), anchor_dir=tmp_path)
    r.add_user("u", USERS["u1"])
    a1 = r.anchor("u")
    r.anchor("u")
    assert r.stats.anchors_built == 1 and r.stats.anchor_hits == 1
    r2 = r.with_settings(PBRSettings(use_prf=False, theta=0.0, damping=1.0))
    r2.anchor("u")
    assert r.stats.anchors_built == 2  # other settings, other anchor
    fresh = PBRRetriever(fake_encode, PBRSettings(use_prf=False, theta=0.0), anchor_dir=tmp_path)
    fresh.add_user("u", USERS["u1"])
    np.testing.assert_allclose(fresh.anchor("u"), a1)
    assert fresh.stats.anchors_built == 0


def test_base_variant_is_plain_dense_and_variants_differ(tmp_path):
    llm = CachedLLM(CountingLLM(), tmp_path)
    base = PBRRetriever(fake_encode, PBRSettings().for_variant("Base"))
    texts = USERS["u2"]
    base.add_user("u", texts)
    q = QUERIES["u2"]
    emb = fake_encode(texts)
    expected = [tuple(int(i) for i in np.argsort(-(emb @ v), kind="stable")[:5]) for v in fake_encode(q)]
    assert [r.indices for r in base.retrieve("u", q)] == expected
    q_stars = {}
    for name in ("PBR", "PBR w/o P-PRF", "PBR w/o P-Anchor", "Base"):
        view = PBRRetriever(fake_encode, PBRSettings(theta=0.0).for_variant(name), llm)
        view.users = base.users
        q_stars[name] = view.expanded_queries("u", q)[0]
    names = list(q_stars)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not np.allclose(q_stars[a], q_stars[b]), (a, b)
    with pytest.raises(ValueError, match="needs an LLM"):
        PBRRetriever(fake_encode, PBRSettings())
    with pytest.raises(ValueError, match="unknown PBR variant"):
        PBRSettings().for_variant("HyDE")


def test_evaluate_variants_table_and_outputs(tmp_path):
    from persrag_lightning.data.personabench import load_personabench
    from persrag_lightning.evaluation.personabench_eval import PersonaBenchEvalConfig, evaluate_variants
    from tests.data.test_personabench import write_community

    community = load_personabench(write_community(tmp_path / "c0"))
    llm = CountingLLM()
    config = PersonaBenchEvalConfig(data_dir=str(tmp_path / "c0"), out_dir=str(tmp_path / "out"),
                                    bootstrap_samples=50, pbr=PBRSettings(theta=0.0))
    report = evaluate_variants(community, fake_encode, config, CachedLLM(llm, tmp_path / "cache"), "fake")
    assert [s.variant for s in report.summaries] == ["PBR", "PBR w/o P-PRF", "PBR w/o P-Anchor", "Base"]
    by = {s.variant: s for s in report.summaries}
    assert by["PBR"].llm_calls_per_query == 2.0  # cold: two prompts per question
    assert by["PBR w/o P-Anchor"].llm_calls_per_query == 0.0  # same prompts as PBR: already cached
    assert by["Base"].llm_calls_per_query == 0.0 and by["PBR"].warm_llm_calls == 0
    assert llm.calls == 4  # 2 questions x 2 prompts, once for the whole evaluation
    assert all(s.questions == 2 for s in report.summaries)
    for s in report.summaries:
        assert s.recall_ci[0] <= s.recall <= s.recall_ci[1]
    out = report.write(tmp_path / "out")
    assert (out / "table.png").stat().st_size > 0
    assert "| PBR w/o P-PRF |" in (out / "table.md").read_text()
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 8 and {"q_id", "retrieved", "recall", "ndcg"} <= set(rows[0])


def test_strategy_on_synthlamp_returns_own_docs_and_base_equals_plain_dense(tmp_path):
    from persrag_lightning.data.source import LampSource
    from persrag_lightning.data.synth import SynthConfig
    from persrag_lightning.retrieval.base import DocStore, Query
    from persrag_lightning.retrieval.pbr_strategy import PBRStrategy

    source = LampSource("LaMP-2", None, SynthConfig(num_users=6), str(tmp_path / "synth"))
    source.prepare()
    store = DocStore(source.load())
    queries = [Query(e.user_id, e.query, e.input, e.example_id) for e in store.dataset.examples["dev"]][:6]
    llm = CountingLLM()
    pbr = PBRStrategy(variant="PBR", cache_dir=str(tmp_path / "cache"), encode=fake_encode, llm=llm)
    pbr.prepare(store)
    results = pbr.retrieve(queries, 3)
    assert llm.calls == 2 * len({(q.user_id, q.query) for q in queries})
    # one question per user: prompts are batched across users (prefetch), not one LLM call per user
    assert llm.batches == [len(queries), len(queries)] and pbr.retriever.stats.llm_calls == llm.calls
    for q, docs in zip(queries, results):
        own = set(store.rows(q.user_id).tolist())
        assert 0 < len(docs) <= 3 and {d.row for d in docs} <= own
    base = PBRStrategy(variant="Base", encode=fake_encode, cache_dir=str(tmp_path / "cache"))
    base.prepare(store)
    for q, docs in zip(queries, base.retrieve(queries, 3)):
        rows = store.rows(q.user_id)
        scores = fake_encode([store.text(int(r)) for r in rows]) @ fake_encode([q.query])[0]
        assert [d.row for d in docs] == [int(rows[i]) for i in np.argsort(-scores, kind="stable")[:3]]


def test_prf_diagnostics_flag_template_echo(tmp_path):
    """An LLM that echoes the prompt's JSON template gives query-independent feedback: the report must say so."""
    from persrag_lightning.data.personabench import load_personabench
    from persrag_lightning.evaluation.personabench_eval import PersonaBenchEvalConfig, evaluate_variants
    from tests.data.test_personabench import write_community

    community = load_personabench(write_community(tmp_path / "c0"))
    echo = CountingLLM(answer='{ "candidates": [...", "...", "..."] }')
    config = PersonaBenchEvalConfig(variants=["PBR"], warm_rerun=False, bootstrap_samples=20,
                                    pbr=PBRSettings(theta=0.0))
    [summary] = evaluate_variants(community, fake_encode, config, CachedLLM(echo, tmp_path / "cache")).summaries
    assert summary.prf_json_rate == 0.0
    assert summary.prf_distinct_rate == 0.5  # 2 questions, 1 distinct feedback
    good = CountingLLM("fake:good")
    [summary] = evaluate_variants(community, fake_encode, config, CachedLLM(good, tmp_path / "cache")).summaries
    assert summary.prf_json_rate == 1.0 and summary.prf_distinct_rate == 1.0
    assert summary.prf_json_constrained is False  # CountingLLM cannot constrain: reported as free decoding
    report = evaluate_variants(community, fake_encode, config, CachedLLM(SchemaLLM(), tmp_path / "cache"))
    assert report.summaries[0].prf_json_constrained and report.summaries[0].prf_json_rate == 1.0
    assert "parsed as JSON candidates (constrained to the JSON schema" in report.markdown()


def test_evaluation_counts_non_converged_anchors(tmp_path):
    from persrag_lightning.data.personabench import load_personabench
    from persrag_lightning.evaluation.personabench_eval import PersonaBenchEvalConfig, evaluate_variants
    from tests.data.test_personabench import write_community

    community = load_personabench(write_community(tmp_path / "c0"))
    config = PersonaBenchEvalConfig(variants=["PBR w/o P-PRF"], warm_rerun=False, bootstrap_samples=20,
                                    pbr=PBRSettings(theta=-1.0, damping=1.0, max_iter=1, tol=1e-12))
    [summary] = evaluate_variants(community, fake_encode, config).summaries
    assert summary.pagerank_not_converged == len(community.people)
    assert summary.pagerank_max_residual > 1e-12
    report = evaluate_variants(community, fake_encode, config)
    assert "PageRank did not converge for" in report.markdown()
    ok = PersonaBenchEvalConfig(variants=["PBR w/o P-PRF"], warm_rerun=False, bootstrap_samples=20)
    assert evaluate_variants(community, fake_encode, ok).summaries[0].pagerank_not_converged == 0
