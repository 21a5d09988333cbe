"""ClusterRAG's cluster-level doc index: top-B search, restriction to candidate docs, B clamping, persistence."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # shared 2-core machine: faiss must not spawn threads

import warnings

import faiss
import numpy as np
import pytest

from persrag_lightning.retrieval.cluster_index import (
    ClusterIndex,
    ClusterIndexSettings,
    ClusterIndexWarning,
    default_n_clusters,
)

faiss.omp_set_num_threads(1)
DIM = 8


def topical_docs(per_topic: int = 10, topics: int = 4, seed: int = 0) -> np.ndarray:
    """Docs in `topics` tight groups along orthogonal axes: the clusters are unambiguous."""
    rng = np.random.default_rng(seed)
    return np.vstack([np.eye(DIM)[t] + rng.normal(scale=0.02, size=(per_topic, DIM))
                      for t in range(topics)]).astype(np.float32)


def test_default_search_within_visits_one_group_and_returns_fewer_when_it_is_small():
    # the seed's B = 1 and its code's "fewer" rule, as behaviour: with no setting passed, the candidates' best
    # cluster alone is searched, even when it holds fewer than k docs
    x = topical_docs()
    index = ClusterIndex.build(x, ClusterIndexSettings(method="hdbscan"))
    candidates = np.array([0, 1, 2, 12, 13, 14, 15, 16, 17])  # topic 0: 3 docs, topic 1: 6 docs
    found = index.search_within(np.eye(DIM)[0], candidates, k=5).rows[0]
    assert set(found) == {0, 1, 2}


def test_fill_next_cluster_tops_up_a_small_top_cluster_to_k():
    x = topical_docs()
    index = ClusterIndex.build(x, ClusterIndexSettings(method="hdbscan"))
    candidates = np.array([0, 1, 2, 12, 13, 14, 15, 16, 17, 35])
    q = np.eye(DIM)[0] + 0.3 * np.eye(DIM)[1]
    filled = index.search_within(q, candidates, k=5, fill="next_cluster").rows[0]
    assert len(filled) == 5 and {0, 1, 2} <= set(filled) and set(filled) - {0, 1, 2} <= set(range(12, 18))
    # k within the top cluster: the same as "fewer"
    assert list(index.search_within(q, candidates, k=2, fill="next_cluster").rows[0]) == \
        list(index.search_within(q, candidates, k=2).rows[0])
    # fewer candidates than k: all of them, no error
    assert set(index.search_within(q, np.array([0, 35]), k=5, fill="next_cluster").rows[0]) == {0, 35}
    with pytest.raises(ValueError, match="fill"):
        index.search_within(q, candidates, k=5, fill="more")
    # a query-time setting: not part of the build key (the persisted index is shared)
    assert ClusterIndex.key(x, ClusterIndexSettings(fill="next_cluster")) == ClusterIndex.key(x, ClusterIndexSettings())


def test_default_n_clusters_follows_the_ivf_rule():
    assert default_n_clusters(10) == 1
    assert default_n_clusters(10_000) == 256  # n/39 = 256 < 4·√n = 400
    assert default_n_clusters(1_000_000) == 4000


def test_top_b_search_finds_the_docs_of_the_query_topic():
    x = topical_docs()
    index = ClusterIndex.build(x, ClusterIndexSettings(n_clusters=4))
    res = index.search(np.eye(DIM)[2], k=5, top_b=1)
    assert set(res.rows[0]) <= set(range(20, 30))
    assert list(res.scores[0]) == sorted(res.scores[0], reverse=True)


def test_b_equal_to_all_clusters_is_the_exact_search():
    x = topical_docs(seed=1)
    index = ClusterIndex.build(x, ClusterIndexSettings(n_clusters=4))
    q = np.random.default_rng(2).normal(size=(3, DIM)).astype(np.float32)
    got = index.search(q, k=6, top_b=4).rows
    flat = faiss.IndexFlatIP(DIM)
    xn, qn = x / np.linalg.norm(x, axis=1, keepdims=True), q / np.linalg.norm(q, axis=1, keepdims=True)
    flat.add(xn)
    np.testing.assert_array_equal(got, flat.search(qn, 6)[1])


def test_b_larger_than_the_clusters_is_clamped_with_a_warning():
    index = ClusterIndex.build(topical_docs(), ClusterIndexSettings(n_clusters=4, top_b=9))
    with pytest.warns(ClusterIndexWarning, match="B=9 is larger than the 4 clusters"):
        res = index.search(np.eye(DIM)[0], k=3)
    assert res.rows.shape == (1, 3)
    assert index.index.nprobe == 4
    with pytest.warns(ClusterIndexWarning):
        assert len(index.search_within(np.eye(DIM)[0], np.arange(40), k=3, top_b=7).rows[0]) == 3


def test_b_below_one_is_an_error():
    index = ClusterIndex.build(topical_docs(), ClusterIndexSettings(n_clusters=4))
    with pytest.raises(ValueError, match="B"):
        index.search(np.eye(DIM)[0], k=3, top_b=0)


def test_search_within_keeps_the_top_b_groups_of_the_candidates_only():
    x = topical_docs()
    index = ClusterIndex.build(x, ClusterIndexSettings(method="hdbscan"))  # exactly the 4 topics (k-means
    assert index.n_clusters == 4  # with one random start may merge two of them, seed-dependent)
    candidates = np.array([0, 1, 12, 13, 35])  # topics 0, 1, 3 (no topic-2 doc among them)
    q = np.eye(DIM)[1] + 0.6 * np.eye(DIM)[3]
    one = index.search_within(q, candidates, k=5, top_b=1).rows[0]
    assert set(one) == {12, 13}  # the topic-1 group only, though k = 5
    two = index.search_within(q, candidates, k=5, top_b=2).rows[0]
    assert set(two) == {12, 13, 35}
    assert set(index.search_within(q, candidates, k=5, top_b=4).rows[0]) == set(candidates)
    assert index.search_within(q, np.array([], np.int64), k=5).rows.shape == (1, 0)


def test_more_clusters_than_docs_is_clamped():
    with pytest.warns(ClusterIndexWarning, match="n_clusters=50 > 6 docs"):
        index = ClusterIndex.build(topical_docs(per_topic=3, topics=2), ClusterIndexSettings(n_clusters=50))
    assert index.n_clusters == 6


def test_hdbscan_doc_clusters_as_the_seed():
    index = ClusterIndex.build(topical_docs(), ClusterIndexSettings(method="hdbscan"))
    assert index.n_clusters == 4
    assert set(index.search(np.eye(DIM)[3], k=4).rows[0]) <= set(range(30, 40))


def test_second_run_loads_without_rebuilding(tmp_path):
    x = topical_docs()
    settings = ClusterIndexSettings(n_clusters=4)
    before = ClusterIndex.builds
    first = ClusterIndex.build_or_load(x, tmp_path, settings)
    assert ClusterIndex.builds == before + 1 and not first.loaded
    files = sorted(tmp_path.iterdir())
    mtimes = [p.stat().st_mtime_ns for p in files]
    second = ClusterIndex.build_or_load(x, tmp_path, ClusterIndexSettings(n_clusters=4, top_b=3))
    assert ClusterIndex.builds == before + 1  # nothing trained
    assert second.loaded and second.settings.top_b == 3  # B is a query-time setting, not a rebuild
    assert [p.stat().st_mtime_ns for p in sorted(tmp_path.iterdir())] == mtimes
    q = np.eye(DIM)[1]
    np.testing.assert_array_equal(first.search(q, 5, top_b=2).rows, second.search(q, 5, top_b=2).rows)


def test_changed_data_or_settings_rebuild(tmp_path):
    x = topical_docs()
    settings = ClusterIndexSettings(n_clusters=4)
    a = ClusterIndex.build_or_load(x, tmp_path, settings)
    before = ClusterIndex.builds
    y = x.copy()
    y[5] += 0.01  # one doc's embedding changed
    b = ClusterIndex.build_or_load(y, tmp_path, settings)
    assert ClusterIndex.builds == before + 1 and not b.loaded and b.fingerprint != a.fingerprint
    ClusterIndex.build_or_load(x, tmp_path, ClusterIndexSettings(n_clusters=3))
    assert ClusterIndex.builds == before + 2
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_data_key_replaces_hashing_the_vectors(tmp_path):
    x = topical_docs()
    ClusterIndex.build_or_load(x, tmp_path, ClusterIndexSettings(n_clusters=4), data_key="corpus-v1")
    before = ClusterIndex.builds
    assert ClusterIndex.build_or_load(x, tmp_path, ClusterIndexSettings(n_clusters=4), data_key="corpus-v1").loaded
    ClusterIndex.build_or_load(x, tmp_path, ClusterIndexSettings(n_clusters=4), data_key="corpus-v2")
    assert ClusterIndex.builds == before + 1


def test_interrupted_save_is_not_loaded(tmp_path):
    """The meta file is written last: an index file without it is rebuilt, not trusted."""
    x = topical_docs()
    first = ClusterIndex.build_or_load(x, tmp_path, ClusterIndexSettings(n_clusters=4))
    first.path.with_suffix(".json").unlink()
    before = ClusterIndex.builds
    again = ClusterIndex.build_or_load(x, tmp_path, ClusterIndexSettings(n_clusters=4))
    assert not again.loaded and ClusterIndex.builds == before + 1


def test_no_warning_for_sane_settings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClusterIndex.build(topical_docs(), ClusterIndexSettings(n_clusters=4, top_b=2)).search(np.eye(DIM)[0], 3)
