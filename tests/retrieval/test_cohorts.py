"""User cohorts of ClusterRAG: clustering, noise policy, neighbours, assign of a new user, export, diagnostics."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # shared 2-core machine: faiss/BLAS must not spawn threads

import warnings

import numpy as np
import pytest

from persrag_lightning.retrieval import cohorts
from persrag_lightning.retrieval.cohort_settings import CohortSettings
from persrag_lightning.retrieval.cohorts import CohortModel, CohortWarning
from persrag_lightning.retrieval.user_clustering import NOISE, mean_user_vectors, normalize_rows

DIM = 8


def communities(n_per: int = 6, n_comm: int = 3, noise: int = 0, seed: int = 0):
    """Tight, well-separated communities along orthogonal axes, plus `noise` users on axes of their own."""
    rng = np.random.default_rng(seed)
    rows, truth = [], []
    for c in range(n_comm):
        centre = np.eye(DIM)[c] * 5
        rows.append(centre + rng.normal(scale=0.05, size=(n_per, DIM)))
        truth += [c] * n_per
    for j in range(noise):  # each noise user alone in its own direction: no dense region
        rows.append((np.eye(DIM)[n_comm + j] * 5)[None, :])
        truth.append(100 + j)
    x = np.vstack(rows).astype(np.float32)
    return [f"u{i:02d}" for i in range(len(x))], x, truth


def test_hdbscan_recovers_the_communities():
    ids, x, truth = communities()
    model = CohortModel(CohortSettings()).fit(ids, x)
    assert model.n_cohorts == 3
    assert model.noise_count == 0
    assert model.adjusted_rand(truth) == pytest.approx(1.0)


def test_one_cohort_is_one_neighbour_and_a_pair_is_a_cluster():
    # the seed's settings in behaviour: HDBSCAN with min_cluster_size 2 makes a cohort of two users (a pair far
    # from everyone else is a cluster, not noise), and a query user gets exactly one neighbour, the most similar
    ids, x, _ = communities(n_per=4, n_comm=2)
    pair = np.vstack([np.eye(DIM)[5] * 5, np.eye(DIM)[5] * 5 + 0.01]).astype(np.float32)
    model = CohortModel().fit(ids + ["p0", "p1"], np.vstack([x, pair]))
    assert model.cohort_of("p0") == model.cohort_of("p1") and not model.is_noise("p0")
    assert [n.user_id for n in model.neighbours("p0")] == ["p1"]
    assert len(model.neighbours(ids[0])) == 1 and model.neighbours(ids[0])[0].user_id in ids[:4]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kmeans_assignment_agrees_with_the_fit(seed):
    # overlapping, unequal-norm users: a rule that differs between fit (spherical centroids, cosine) and assign
    # (raw means, euclidean) puts some fitted users in another cohort when assigned again
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(120, DIM)) * rng.uniform(0.2, 5.0, size=(120, 1))).astype(np.float32)
    ids = [f"u{i}" for i in range(len(x))]
    model = CohortModel(CohortSettings(method="kmeans", n_clusters=7, seed=seed)).fit(ids, x)
    assert [model.assign(v).cohort for v in x] == [model.cohort_of(u) for u in ids]
    np.testing.assert_allclose(np.linalg.norm(model.centroids, axis=1), 1.0, atol=1e-5)  # spherical
    # users outside a fitted sample are placed by the same rule
    sampled = CohortModel(CohortSettings(method="kmeans", n_clusters=7, seed=seed, fit_sample=60)).fit(ids, x)
    assert [sampled.assign(v).cohort for v in x] == [sampled.cohort_of(u) for u in ids]


def test_mean_user_vectors_is_eq1_and_reports_users_without_docs():
    docs = np.array([[1, 0], [3, 0], [0, 2], [5, 5]], np.float32)
    rows = {"u0": np.array([0, 1]), "u1": np.array([], np.int64), "u2": np.array([2])}  # row 3: nobody's pool
    kept, vectors, empty = mean_user_vectors(docs, rows)
    assert kept == ["u0", "u2"] and empty == ["u1"]
    np.testing.assert_allclose(vectors, [[2, 0], [0, 2]])


def test_neighbours_are_cohort_members_ranked_by_cosine_without_self():
    ids, x, _ = communities()
    x[1] = x[0] + 0.001  # u01 is u00's closest
    model = CohortModel(CohortSettings()).fit(ids, x)
    nb = model.neighbours("u00", 3)
    assert nb[0].user_id == "u01"
    assert all(model.cohort_of(n.user_id) == model.cohort_of("u00") for n in nb)
    assert "u00" not in [n.user_id for n in nb]
    assert [n.similarity for n in nb] == sorted((n.similarity for n in nb), reverse=True)
    assert len(model.neighbours("u00")) == 1  # the seed's k = 1


def test_neighbours_in_a_big_cohort_equal_the_full_sort_ties_included():
    """`neighbours` keeps only the k best (and all tied with the k-th) before sorting by (score, id): the same list
    as sorting the whole cohort — checked on one cohort of 400 users with many exactly tied scores."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, size=(400, 4)).astype(np.float32) + 1.0  # few distinct vectors: many ties
    ids = [f"u{i:03d}" for i in range(len(x))]
    model = CohortModel(CohortSettings(method="kmeans", n_clusters=1)).fit(ids, x)
    for user in ("u000", "u123", "u399"):
        r = ids.index(user)
        others = np.array([i for i in range(len(ids)) if i != r])
        sims = (model.vectors @ model.vectors[r])[others]  # the scores neighbours computes (a cohort of everyone)
        assert len(np.unique(sims)) < len(sims) // 4  # ties everywhere
        for k in (1, 3, 25):
            want = others[np.lexsort((np.array(ids)[others], -sims))[:k]]  # the whole cohort sorted
            assert [n.user_id for n in model.neighbours(user, k)] == [ids[i] for i in want], (user, k)


def test_neighbours_are_the_same_whether_the_cohort_is_gathered_or_the_whole_table_scanned(monkeypatch):
    """A big cohort (over FULL_SCAN_SHARE of the users) is scored by one product with the whole table, a small one
    by gathering its members: both give the same neighbours and similarities."""
    from persrag_lightning.retrieval import cohorts

    ids, x, _ = communities()
    model = CohortModel(CohortSettings(method="kmeans", n_clusters=2)).fit(ids, x)
    lists = {}
    for share in (0.0, 1.0):  # every cohort scanned / every cohort gathered
        monkeypatch.setattr(cohorts, "FULL_SCAN_SHARE", share)
        lists[share] = [model.neighbours(u, 5) for u in ids]
    assert [[n.user_id for n in nb] for nb in lists[0.0]] == [[n.user_id for n in nb] for nb in lists[1.0]]
    np.testing.assert_allclose([n.similarity for nb in lists[0.0] for n in nb],
                               [n.similarity for nb in lists[1.0] for n in nb], rtol=1e-6)
    assert all(len(nb) == 5 for nb in lists[0.0])


def test_noise_users_are_not_one_fake_cluster():
    """Two far-apart noise users must not become each other's neighbours (the seed's code lumps label -1)."""
    ids, x, _ = communities(noise=2)
    model = CohortModel(CohortSettings(noise="own")).fit(ids, x)
    n1, n2 = ids[-2], ids[-1]
    assert model.is_noise(n1) and model.is_noise(n2)
    assert model.cohort_of(n1) == NOISE
    assert model.neighbours(n1, 5) == []  # user-only retrieval
    assert n1 not in {n.user_id for u in ids[:-2] for n in model.neighbours(u, 20)}


def test_noise_users_get_their_nearest_cohort_by_default():
    """Three close cohorts and one user far from all (farther than they are from each other, so HDBSCAN calls it
    noise), yet nearest to cohort 1: the default policy gives it cohort 1's members as neighbours."""
    rng = np.random.default_rng(0)
    centres = [np.eye(DIM)[0], np.eye(DIM)[0] + 0.5 * np.eye(DIM)[1], np.eye(DIM)[0] + 0.5 * np.eye(DIM)[2]]
    x = np.vstack([c + rng.normal(scale=0.003, size=(5, DIM)) for c in centres]
                  + [(np.eye(DIM)[3] + 0.3 * np.eye(DIM)[1])[None, :]]).astype(np.float32)
    ids = [f"u{i:02d}" for i in range(len(x))]
    model = CohortModel(CohortSettings()).fit(ids, x)
    assert model.n_cohorts == 3
    assert model.is_noise("u15")
    assert model.cohort_of("u15") == model.cohort_of("u05")  # cohort 1
    nb = model.neighbours("u15", 2)
    assert len(nb) == 2 and {n.user_id for n in nb} <= {f"u{i:02d}" for i in range(5, 10)}
    assert model.sizes.sum() == len(ids)  # the noise user counts in its cohort, not in a fake one


def test_all_users_in_noise_warns_and_leaves_everyone_user_only():
    ids, x, _ = communities(n_per=0, n_comm=0, noise=4)
    with pytest.warns(CohortWarning, match="all 4 users are noise"):
        model = CohortModel(CohortSettings()).fit(ids, x)
    assert model.n_cohorts == 0
    assert all(model.cohort_of(u) == NOISE and model.neighbours(u) == [] for u in ids)
    assert model.assign(x[0]).cohort == NOISE
    assert "noise users: 4" in model.summary()


def test_cohort_of_one_warns_and_has_no_neighbours():
    ids, x, _ = communities(n_per=3, n_comm=2, noise=1)
    with pytest.warns(CohortWarning, match="cohort"):
        model = CohortModel(CohortSettings(method="kmeans", n_clusters=3)).fit(ids, x)
    alone = ids[-1]
    assert model.sizes[model.cohort_of(alone)] == 1
    assert model.neighbours(alone, 3) == []


def test_unknown_user_is_a_clear_key_error():
    ids, x, _ = communities()
    model = CohortModel().fit(ids, x)
    with pytest.raises(KeyError, match="nobody"):
        model.neighbours("nobody")


def test_assign_new_user_without_reclustering(monkeypatch):
    ids, x, _ = communities()
    model = CohortModel().fit(ids, x)
    def no_refit(*_a, **_k):
        raise AssertionError("assign must not re-cluster")

    monkeypatch.setattr(cohorts, "hdbscan_labels", no_refit)
    new = np.eye(DIM)[1] * 5 + 0.01
    a = model.assign(new)
    assert a.label == a.cohort == model.cohort_of(ids[6])  # community 1
    far = np.eye(DIM)[6] * 5  # no cohort near: noise, then the policy
    b = model.assign(far)
    assert b.label == NOISE and b.cohort >= 0
    model.add("new", new)
    assert model.neighbours("new", 1)[0].user_id in ids[6:12]
    assert "new" in {n.user_id for n in model.neighbours(ids[6], 6)}


def test_fit_sample_assigns_the_rest_to_the_clusters_of_the_sample(monkeypatch):
    ids, x, truth = communities(n_per=10)
    seen: list[int] = []
    real = cohorts.hdbscan_labels
    monkeypatch.setattr(cohorts, "hdbscan_labels", lambda xs, s: (seen.append(len(xs)), real(xs, s))[1])
    model = CohortModel(CohortSettings(fit_sample=15)).fit(ids, x)
    assert seen == [15]
    # users outside the sample may land beyond a cohort's sampled radius (noise), but their cohort is right
    assert model.adjusted_rand(truth, after_policy=True) == pytest.approx(1.0)


def test_kmeans_alternative_has_no_noise():
    ids, x, truth = communities()
    model = CohortModel(CohortSettings(method="kmeans", n_clusters=3)).fit(ids, x)
    assert model.noise_count == 0 and model.adjusted_rand(truth) == pytest.approx(1.0)


def test_save_load_round_trip(tmp_path):
    ids, x, _ = communities(noise=1)
    model = CohortModel(CohortSettings(noise="own", top_k_users=2)).fit(ids, x)
    model.save(tmp_path / "clusters")
    names = sorted(p.name for p in (tmp_path / "clusters").iterdir())
    assert names == ["assignments.tsv", "centroids.npy", "cohorts.json", "radii.npy", "vectors.npy"]
    back = CohortModel.load(tmp_path / "clusters")
    assert back.settings == model.settings
    assert back.data_fingerprint == model.data_fingerprint
    assert back.summary() == model.summary()
    assert back.neighbours("u00") == model.neighbours("u00")
    np.testing.assert_array_equal(back.labels, model.labels)
    with pytest.raises(FileNotFoundError, match="cohorts.json"):
        CohortModel.load(tmp_path / "missing")


def test_adjusted_rand_counts_noise_users_as_singletons():
    ids, x, truth = communities(noise=2)
    model = CohortModel(CohortSettings(noise="own")).fit(ids, x)
    assert model.adjusted_rand(truth) == pytest.approx(1.0)  # two noise users = two true singletons


def test_no_warnings_on_a_clean_fit():
    ids, x, _ = communities()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CohortModel().fit(ids, x)


def test_nearest_cohort_in_chunks_equals_one_pass(monkeypatch):
    """Assignment of many users runs in chunks (1M users × K centroids would need GiBs at once): any chunking
    gives the one-pass answer, chunk boundaries included."""
    ids, x, _ = communities(n_per=7, noise=2)
    model = CohortModel(CohortSettings()).fit(ids, x)
    xn = normalize_rows(x)
    whole = model._nearest(xn)
    monkeypatch.setattr(cohorts, "ASSIGN_CHUNK", 5)  # 5 // 3 centroids = 1 user per chunk
    for got, want in zip(model._nearest(xn), whole):
        np.testing.assert_array_equal(got, want)
    d2 = ((xn[:, None, :] - model.centroids[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(whole[1], d2.argmin(1))


def test_remove_recomputes_the_cohort_without_the_user_and_an_emptied_cohort_takes_nobody():
    ids, x, _ = communities()
    model = CohortModel().fit(ids, x)
    c = model.cohort_of(ids[6])
    members = [u for u in ids if model.cohort_of(u) == c]
    assert model.remove([ids[6], "nobody"]) == [ids[6]]
    assert ids[6] not in model and ids[6] not in {n.user_id for n in model.neighbours(ids[7], 10)}
    rest = model.vectors[[model.user_ids.index(u) for u in members[1:]]]
    np.testing.assert_allclose(model.centroids[c], rest.mean(0), atol=1e-6)  # no trace of the removed vector
    assert model.assign(np.eye(DIM)[1] * 5).cohort == c  # the cohort still takes users near it
    model.remove(members[1:])
    assert model.radii[c] == -1 and not model.centroids[c].any()
    assert model.assign(np.eye(DIM)[1] * 5).cohort != c  # emptied: the nearest *other* cohort
    with pytest.raises(ValueError, match="names a cohort"):
        model.add("x", x[0], cohorts.Assignment(0, model.n_cohorts + 3, 0.0))


def test_a_cfrag_row_on_a_cohort_export_is_keyed_by_the_export_content(tmp_path):
    from persrag_lightning.retrieval.cfrag import CFRAG
    from persrag_lightning.retrieval.strategies import strategy_config

    ids, x, _ = communities()
    CohortModel().fit(ids, x).save(tmp_path / "clusters")
    make = lambda: CFRAG("ue", users="cluster", cohort_export=str(tmp_path / "clusters"))
    first = strategy_config(make())
    assert first["cohort_export"] == {"bundle": first["cohort_export"]["bundle"]}
    model = CohortModel.load(tmp_path / "clusters")
    model.remove(ids[:1])
    model.save(tmp_path / "clusters")
    assert strategy_config(make()) != first  # a deletion (or a new clustering) is a new key
    assert "cohort_export" not in strategy_config(CFRAG("ue", users="cluster"))  # other rows keep their keys
    with pytest.raises(ValueError, match="cohort_export applies only"):
        CFRAG("ue", users="encoder", cohort_export=str(tmp_path / "clusters"))
