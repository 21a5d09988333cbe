"""Faiss indexes: the BLAS path the project switches on for batches (index.py) returns the same top-k as a
numpy reference and as one-query calls; `auto` picks exact or HNSW by the number of users; an index's parameters
survive a rebuild (index_params) and a purge of the export."""

import json

import faiss
import numpy as np
import pytest
import torch

from persrag_lightning import index as index_module
from persrag_lightning.index import (
    BLAS_MIN_QUERIES,
    FAISS_DEFAULT_BLAS_THRESHOLD,
    TorchFlatIndex,
    build_index,
    index_kind,
    index_params,
    load_index,
    normalized,
    resolve_kind,
    save_index,
    search,
)


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


def test_auto_is_exact_up_to_the_threshold_and_hnsw_above(monkeypatch):
    monkeypatch.setattr(index_module, "AUTO_EXACT_MAX_USERS", 10)
    assert resolve_kind("auto", 10) == "flat" and resolve_kind("auto", 11) == "hnsw"
    assert resolve_kind("ivf", 5) == "ivf"
    x = np.random.default_rng(0).standard_normal((11, 8)).astype(np.float32)
    assert index_kind(build_index(x[:10], "auto")) == "flat"
    assert index_kind(build_index(x, "auto")) == "hnsw"
    with pytest.raises(ValueError, match="unknown index kind"):
        build_index(x, "exact")


def test_hnsw_links_every_vector_with_the_requested_ef_construction(monkeypatch):
    """efConstruction is set before the vectors are added (faiss applies it while linking each one)."""
    seen = []

    class Recording(faiss.IndexHNSWFlat):
        def add(self, x):
            seen.append(self.hnsw.efConstruction)
            super().add(x)

    monkeypatch.setattr(faiss, "IndexHNSWFlat", Recording)
    x = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    index = build_index(x, "hnsw", hnsw_m=8, ef_construction=120, ef_search=20)
    assert seen == [120] and index.ntotal == 50
    assert (index.hnsw.nb_neighbors(1), index.hnsw.efConstruction, index.hnsw.efSearch) == (8, 120, 20)


@pytest.mark.parametrize("kind, params", [("flat", {}), ("ivf", {"nlist": 8, "nprobe": 3}),
                                          ("hnsw", {"hnsw_m": 12, "ef_construction": 70, "ef_search": 24})])
def test_index_params_rebuild_the_same_kind_with_the_same_parameters(kind, params, tmp_path):
    x = np.random.default_rng(0).standard_normal((400, 8)).astype(np.float32)
    index = build_index(x, kind, **params)
    assert index_params(index) == {"kind": kind, **params}
    save_index(index, tmp_path / "users.faiss")
    loaded = load_index(tmp_path / "users.faiss")
    assert index_params(loaded) == {"kind": kind, **params}
    assert index_params(build_index(x[:300], **index_params(loaded))) == {"kind": kind, **params}


def test_a_purged_user_index_keeps_its_parameters(tmp_path):
    from safetensors.torch import save_file

    from persrag_lightning.serving.purge import _stage_user_table

    ids = [f"u{i}" for i in range(40)]
    table = torch.randn(40, 8)
    save_file({"embeddings": table}, str(tmp_path / "user_embeddings.safetensors"))
    (tmp_path / "user_ids.json").write_text(json.dumps(ids))
    params = {"kind": "hnsw", "hnsw_m": 6, "ef_construction": 55, "ef_search": 21}
    save_index(build_index(table.numpy(), **params), tmp_path / "users.faiss")
    _stage_user_table(tmp_path, {"u3", "u7"}, lambda target: target)  # staged in place
    purged = load_index(tmp_path / "users.faiss")
    assert purged.ntotal == 38 and json.loads((tmp_path / "user_ids.json").read_text())[3] == "u4"
    assert index_params(purged) == params


def test_torch_flat_index_searches_adds_and_saves_like_faiss_flat(tmp_path):
    """The GPU fallback of a flat index (index.py, when faiss has no GPUs), exercised on the CPU here and on CUDA in
    tests/training/test_gpu.py: the same neighbours and scores as IndexFlatIP, appends, and saves as a faiss index."""
    rng = np.random.default_rng(0)
    table, queries = rng.standard_normal((600, 384)).astype(np.float32), rng.standard_normal((40, 384)).astype(np.float32)
    flat = build_index(table, "flat")
    index = TorchFlatIndex(flat, device="cpu")
    TorchFlatIndex.QUERY_CHUNK, chunk = 16, TorchFlatIndex.QUERY_CHUNK  # several chunks per batch
    try:
        (ts, ti), (fs, fi) = search(index, queries, 6), search(flat, queries, 6)
    finally:
        TorchFlatIndex.QUERY_CHUNK = chunk
    np.testing.assert_array_equal(ti, fi)
    np.testing.assert_allclose(ts, fs, atol=1e-5)
    assert index_kind(index) == "flat" and index_params(index) == {"kind": "flat"} and index.d == 384
    new = normalized(rng.standard_normal((3, 384)).astype(np.float32))
    for row in new:  # one at a time: the buffer grows, the rows stay in order
        index.add(row[None])
    assert index.ntotal == 603 and search(index, new, 1)[1].ravel().tolist() == [600, 601, 602]
    np.testing.assert_array_equal(index.table.numpy(), np.concatenate([normalized(table), new]))
    assert search(index, queries[:0], 6)[1].shape == (0, 6)
    save_index(index, tmp_path / "i.faiss")
    loaded = load_index(tmp_path / "i.faiss")
    assert isinstance(loaded, faiss.IndexFlatIP) and loaded.ntotal == 603
    np.testing.assert_array_equal(search(loaded, queries, 6)[1], search(index, queries, 6)[1])
    with pytest.raises(ValueError, match="inner-product"):
        TorchFlatIndex(faiss.IndexFlatL2(4), device="cpu")


def test_without_a_gpu_indexes_stay_faiss_cpu_indexes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flat = build_index(np.eye(4, dtype=np.float32), "flat")
    assert index_module.to_gpu_if_available(flat) is flat
