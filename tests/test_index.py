"""Exact faiss search: the BLAS path the project switches on for batches (index.py) returns the same top-k as a
numpy reference and as one-query calls."""

import faiss
import numpy as np

from persrag_lightning.retrieval.index import (BLAS_MIN_QUERIES, FAISS_DEFAULT_BLAS_THRESHOLD, build_index,
                                               normalized, search)


def test_importing_retrieval_sets_the_blas_threshold_below_faiss_default():
    import persrag_lightning.retrieval  # noqa: F401

    assert faiss.cvar.distance_compute_blas_threshold == BLAS_MIN_QUERIES * 384 < FAISS_DEFAULT_BLAS_THRESHOLD


def test_batched_exact_search_matches_numpy_and_single_queries():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((3000, 384)).astype(np.float32)
    queries = rng.standard_normal((64, 384)).astype(np.float32)
    index = build_index(table, "flat")
    ref = np.argsort(-(normalized(queries) @ normalized(table).T), axis=1)[:, :6]
    batch_scores, batch_ids = search(index, queries, 6)          # 64·384 ≥ threshold: BLAS
    single = np.concatenate([search(index, q, 6)[1] for q in queries])  # one query: SIMD path
    assert (batch_ids == ref).all() and (single == ref).all()
    assert np.allclose(batch_scores, np.take_along_axis(normalized(queries) @ normalized(table).T, ref, 1), atol=1e-5)
