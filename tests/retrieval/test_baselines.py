"""Non-collaborative baselines on a 20-user SynthLaMP (Dense on a tiny random BERT) and the user index."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from persrag_lightning.data.records import HistoryDoc, LampDataset, User
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.models.corpus_embeddings import load_corpus_embeddings
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.baselines import BM25, Dense, RandomDocs, Recency, ZeroShot
from persrag_lightning.retrieval.user_index import UserIndex, torch_topk_users

K = 5


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> DocStore:
    source = LampSource("LaMP-2", None, SynthConfig(num_users=20), str(tmp_path_factory.mktemp("synth")))
    source.prepare()
    return DocStore(source.load())


@pytest.fixture(scope="module")
def queries(store: DocStore) -> list[Query]:
    return [Query(e.user_id, e.query, e.input, e.example_id) for e in store.dataset.examples["dev"]]


@pytest.fixture(scope="module")
def dense_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dense_cache"))


def make(name: str, store: DocStore, tiny_bert: str, cache_dir: str, **kwargs):
    strategy = {
        "zero_shot": lambda: ZeroShot(),
        "random": lambda: RandomDocs(**kwargs),
        "recency": lambda: Recency(**kwargs),
        "bm25": lambda: BM25(**kwargs),
        "dense": lambda: Dense(tiny_bert, cache_dir, max_length=64, **kwargs),
    }[name]()
    strategy.prepare(store)
    return strategy


@pytest.mark.parametrize("name", ["zero_shot", "random", "recency", "bm25", "dense"])
def test_strategies_return_own_distinct_docs_deterministically(name, store, queries, tiny_bert, dense_cache):
    results = make(name, store, tiny_bert, dense_cache).retrieve(queries, K)
    again = make(name, store, tiny_bert, dense_cache).retrieve(queries[::-1], K)[::-1]
    assert len(results) == len(queries)
    for query, docs, docs_again in zip(queries, results, again):
        own = set(store.rows(query.user_id).tolist())
        if name == "zero_shot":
            assert docs == []
            continue
        assert len(docs) == min(K, len(own))
        assert {d.owner for d in docs} == {query.user_id}
        assert {d.row for d in docs} <= own and len({d.row for d in docs}) == len(docs)
        assert all(d.doc_id == store.corpus.doc_ids[d.row] for d in docs)
        assert docs == docs_again or all(math.isnan(d.retriever_score) for d in docs)
        assert [d.row for d in docs] == [d.row for d in docs_again]
        if name in ("bm25", "dense"):
            scores = [d.retriever_score for d in docs]
            assert scores == sorted(scores, reverse=True)
        else:
            assert all(math.isnan(d.retriever_score) for d in docs)


@pytest.mark.parametrize("name", ["random", "recency", "bm25", "dense"])
def test_users_with_fewer_than_k_docs_get_all_of_them(name, store, queries, tiny_bert, dense_cache):
    strategy = make(name, store, tiny_bert, dense_cache, max_history=3)
    for query, docs in zip(queries[:5], strategy.retrieve(queries[:5], K)):
        assert sorted(d.row for d in docs) == store.rows(query.user_id, 3).tolist()
    assert strategy.retrieve(queries[:2], 0) == [[], []]


def test_recency_returns_latest_docs_most_recent_first(store, queries):
    strategy = Recency()
    strategy.prepare(store)
    for query, docs in zip(queries, strategy.retrieve(queries, K)):
        assert [d.row for d in docs] == store.rows(query.user_id)[::-1][:K].tolist()
        dates = [store.history_doc(d.row).date for d in docs]
        assert dates == sorted(dates, reverse=True)
        oldest_kept = dates[-1]
        others = set(store.rows(query.user_id).tolist()) - {d.row for d in docs}
        assert all(store.history_doc(r).date <= oldest_kept for r in others)


def test_random_depends_on_seed_and_query_only(store, queries):
    a, b = RandomDocs(seed=0), RandomDocs(seed=1)
    a.prepare(store)
    b.prepare(store)
    ra, rb = a.retrieve(queries, K), b.retrieve(queries, K)
    assert any([d.row for d in x] != [d.row for d in y] for x, y in zip(ra, rb))
    alone = a.retrieve(queries[3:4], K)[0]
    assert [d.row for d in alone] == [d.row for d in ra[3]]


def toy_store() -> DocStore:
    """Two users: one u1 doc has the rare word 'zyxophone'; u2's docs have it too (must not leak into u1)."""
    texts = {
        "u1": ["a heist crew robs a casino vault in las vegas",
               "a lonely astronaut repairs the reactor of the ship",
               "the zyxophone quartet plays at a jazz club in paris", "a casino heist goes wrong in paris",
               "jazz in paris during a snowy winter"],
        "u2": ["the zyxophone factory burns down", "zyxophone zyxophone zyxophone"],
    }
    users = {uid: User(uid, [HistoryDoc(f"{uid}-{i}", (2020, 1, i + 1), {"description": t, "tag": "comedy"})
                             for i, t in enumerate(docs)]) for uid, docs in texts.items()}
    return DocStore(LampDataset("LaMP-2", users))


def test_bm25_ranks_the_doc_sharing_the_rare_word_first():
    store = toy_store()
    bm25 = BM25(cache_users=1)
    bm25.prepare(store)
    query = Query("u1", "a zyxophone concert in paris", example_id="q1")
    docs = bm25.retrieve([query], K)[0]
    assert store.text(docs[0].row).startswith("the zyxophone quartet")
    assert docs[0].retriever_score > docs[1].retriever_score > 0  # 'paris' alone scores lower
    assert {d.owner for d in docs} == {"u1"}
    # the LRU keeps one index; switching users and back gives the same ranking
    bm25.retrieve([Query("u2", "zyxophone")], K)
    assert [user for user, _ in bm25._indexes] == ["u2"]  # one index per (user, profile)
    assert bm25.retrieve([query], K)[0] == docs
    # a query of stopwords only scores 0 everywhere and falls back to the most recent docs
    stop = bm25.retrieve([Query("u1", "the and of")], 2)[0]
    assert [d.row for d in stop] == store.rows("u1")[::-1][:2].tolist()
    assert all(d.retriever_score == 0 for d in stop)


def test_dense_equals_manual_cosine_ranking(store, queries, tiny_bert, dense_cache):
    dense = make("dense", store, tiny_bert, dense_cache)
    results = dense.retrieve(queries, K)
    table = load_corpus_embeddings(dense_cache, store.corpus, tiny_bert, 64)
    q = TextEncoder.from_pretrained(tiny_bert, max_length=64).encode([x.query for x in queries])
    for query, vector, docs in zip(queries, q, results):
        rows = store.rows(query.user_id)
        cos = torch.nn.functional.cosine_similarity(table[torch.from_numpy(rows)], vector[None], dim=-1)
        order = torch.argsort(cos, descending=True, stable=True)[:K]
        assert [d.row for d in docs] == rows[order.numpy()].tolist()
        np.testing.assert_allclose([d.retriever_score for d in docs], cos[order].numpy(), rtol=1e-5,
                                   atol=1e-6)


def clustered(n: int, dim: int = 32, clusters: int = 20, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim))
    return (centers[rng.integers(clusters, size=n)] + 0.3 * rng.normal(size=(n, dim))).astype(np.float32)


def test_flat_user_index_equals_torch_scan():
    table = clustered(500)
    queries = clustered(30, seed=1)
    index = UserIndex.build([f"u{i}" for i in range(len(table))], table, "flat")
    scores, rows = index.search_rows(queries, 6)
    t_scores, t_rows = torch_topk_users(torch.from_numpy(table), torch.from_numpy(queries), 6)
    assert np.array_equal(rows, t_rows.numpy())
    np.testing.assert_allclose(scores, t_scores.numpy(), atol=1e-5)
    _, ids = index.search(queries, 6)
    assert ids == [[f"u{r}" for r in row] for row in t_rows.tolist()]


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_user_index_recall(kind):
    table, queries, m = clustered(4000), clustered(200, seed=1), 6
    _, exact = torch_topk_users(torch.from_numpy(table), torch.from_numpy(queries), m)
    knobs = {"ef_search": 128} if kind == "hnsw" else {}  # 0.86 at index.HNSW_EF_SEARCH = 64: too near the bar
    _, rows = UserIndex.build([str(i) for i in range(len(table))], table, kind, **knobs).search_rows(queries, m)
    recall = np.mean([len(set(a) & set(b)) / m for a, b in zip(rows.tolist(), exact.tolist())])
    assert recall >= 0.85, recall  # measured 0.99 (IVF, nprobe 16) and 0.95 (HNSW, efSearch 128)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_added_user_is_retrievable_at_once(kind):
    table = clustered(2000)
    index = UserIndex.build([f"u{i}" for i in range(len(table))], table, kind)
    new = clustered(2, seed=7)
    index.add(["new0", "new1"], new)
    assert len(index) == 2002 and "new1" in index
    scores, ids = index.search(new, 3)
    assert [row[0] for row in ids] == ["new0", "new1"]
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)
    with pytest.raises(ValueError):
        index.add(["new0"], new[:1])
