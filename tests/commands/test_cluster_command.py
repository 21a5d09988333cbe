"""`persrag cluster`: the cohort export (files, settings, sizes, noise), the ARI of MEAN vs contrastive user vectors
on SynthLaMP, the whole-folder replacement, and bad input as one line with exit code 2."""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch

from persrag_lightning.cli import main
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig, load_communities
from persrag_lightning.models.user_encoder import UserEncoder, UserEncoderConfig
from persrag_lightning.retrieval.cohorts import CohortModel

USERS = 16


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_bert):
    """A SynthLaMP of 16 users and a user-encoder export whose table places each user at its true community's
    axis (a perfect contrastive encoder, so its ARI must be 1)."""
    root = tmp_path_factory.mktemp("cluster_cmd")
    cache = root / ".cache" / "persrag"
    source = LampSource("LaMP-2", None, SynthConfig(num_users=USERS), str(cache))
    communities = load_communities(source.prepare())
    ids = sorted(communities)
    rng = np.random.default_rng(0)
    table = np.eye(8, dtype=np.float32)[[communities[u] for u in ids]] * 5 + rng.normal(0, 0.01, (len(ids), 8))
    encoder = UserEncoder(UserEncoderConfig(dim=8, num_docs=1, text_encoder=tiny_bert))
    encoder.index_users(ids, torch.from_numpy(table.astype(np.float32)))
    encoder.save_pretrained(root / "checkpoints" / "r" / "user_encoder")
    return root, communities


def cluster(workdir, tiny_bert, *extra: str, run: str = "r") -> None:
    root, _ = workdir
    main(["cluster", "--run_name", run, "--export_root", str(root / "checkpoints"), "--num_users", str(USERS),
          "--cache_dir", str(root / ".cache" / "persrag"), "--encoder", tiny_bert, *extra])


def test_export_holds_assignments_centroids_settings_sizes_noise_and_ari(workdir, tiny_bert, capsys):
    root, communities = workdir
    stale = root / "checkpoints" / "r" / "clusters" / "stale.txt"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("from an older export")
    cluster(workdir, tiny_bert)
    out = capsys.readouterr().out
    export = root / "checkpoints" / "r" / "clusters"
    assert not stale.exists()  # the folder is replaced whole, not written into
    meta = json.loads((export / "cohorts.json").read_text())
    assert meta["settings"]["method"] == "hdbscan" and meta["settings"]["min_cluster_size"] == 2
    assert meta["settings"]["user_vectors"] == "mean" and meta["users"] == USERS
    assert sum(meta["sizes"]) == USERS - (meta["noise"] if meta["settings"]["noise"] == "own" else 0)
    model = CohortModel.load(export)
    assert sorted(model.user_ids) == sorted(communities) and model.centroids.shape[0] == meta["cohorts"]
    assert (export / "assignments.tsv").read_text().startswith("user_id\tcohort\tlabel\n")
    diagnostics = json.loads((export / "diagnostics.json").read_text())
    assert diagnostics["ari"]["encoder"]["clusters"] == pytest.approx(1.0)  # the perfect table of the fixture
    assert -1.0 <= diagnostics["ari"]["mean"]["clusters"] <= 1.0
    assert f"{USERS} users" in out and "noise users:" in out
    k = len(set(communities.values()))
    assert f"| contrastive (CFRAG stage 1) | {k} | 0 | 1.000 |" in out and "| MEAN (Eq. 1) |" in out


def test_encoder_vectors_and_kmeans(workdir, tiny_bert, capsys):
    root, communities = workdir
    k = len(set(communities.values()))
    cluster(workdir, tiny_bert, "--vectors", "encoder", "--method", "kmeans", "--n_clusters", str(k), run="r")
    capsys.readouterr()
    model = CohortModel.load(root / "checkpoints" / "r" / "clusters")
    assert model.settings.user_vectors == "encoder" and model.n_cohorts == k and model.noise_count == 0
    assert json.loads((root / "checkpoints" / "r" / "clusters" / "diagnostics.json").read_text())["ari"]["encoder"][
        "n_cohorts"] == k  # the ARI table fits each kind of vectors with the same settings


def test_without_a_user_encoder_the_table_names_the_command(workdir, tiny_bert, capsys):
    cluster(workdir, tiny_bert, run="no-encoder")
    out = capsys.readouterr().out
    assert "| contrastive (CFRAG stage 1) | - | - | not exported: `python train.py fit --config " \
           "cfrag_user_encoder.yaml`" in out


@pytest.mark.parametrize("args, words", [
    (["--min_cluster_size", "1"], "--min_cluster_size must be ≥ 2"),
    (["--method", "dbscan"], "invalid choice: 'dbscan'"),
    (["--n_clusters", "0"], "--n_clusters must be ≥ 1"),
    (["--task", "LaMP-9"], "unknown task 'LaMP-9'"),
    (["--vectors", "encoder", "--run_name", "untrained"], "cfrag_user_encoder.yaml"),
    (["--data_dir", "/nonexistent/lamp"], "/nonexistent/lamp does not exist"),
    (["--fit_sample", "zero"], "invalid int value: 'zero'"),
])
def test_bad_input_is_one_line_and_exit_code_2(workdir, tiny_bert, capsys, args, words):
    root, _ = workdir
    before = sorted(p.name for p in (root / "checkpoints").iterdir())
    with pytest.raises(SystemExit) as exit_info:
        main(["cluster", "--export_root", str(root / "checkpoints"), "--cache_dir", str(root / ".cache" / "persrag"),
              "--encoder", tiny_bert, "--num_users", str(USERS), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and err[0].startswith("persrag")
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == before  # nothing exported
