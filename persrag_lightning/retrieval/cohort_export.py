"""A CohortModel's export (a run's `clusters/`): assignments.tsv, centroids.npy, vectors.npy,
radii.npy and cohorts.json, each written atomically, cohorts.json last, so a folder with cohorts.json
is complete; read back whole or refused with the file named."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from persrag_lightning.retrieval.cohort_settings import CohortSettings
from persrag_lightning.utils import atomic_replace, atomic_write_json, atomic_write_text

__all__ = ["FORMAT", "CohortMeta", "array_digest", "read_cohorts", "write_cohorts"]

FORMAT = "persrag-cohorts/v1"


@dataclass(frozen=True)
class CohortMeta:
    """cohorts.json: what a reader needs to trust the export (settings, counts, the data fingerprint)."""

    format: str
    settings: CohortSettings
    fingerprint: str
    users: int
    cohorts: int
    sizes: list[int]
    noise: int
    dim: int
    encoder: str = ""  # MEAN vectors' text encoder (absent in exports written before it was recorded)


def array_digest(x: np.ndarray) -> str:
    """The sha256 of an array's bytes: a fitted model's data fingerprint covers its vectors."""
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


class FittedCohorts(Protocol):
    """What an export reads of a fitted cohort model (retrieval/cohorts.CohortModel), named here so
    this module does not import the model that imports it."""

    user_ids: list[str]
    cohorts: np.ndarray
    labels: np.ndarray
    centroids: np.ndarray
    vectors: np.ndarray
    radii: np.ndarray
    settings: CohortSettings
    data_fingerprint: str
    n_cohorts: int
    sizes: np.ndarray
    noise_count: int
    dim: int
    encoder: str

    def __len__(self) -> int: ...


def write_cohorts(model: FittedCohorts, directory: str | Path) -> Path:
    """Export `model` to `directory`: assignments.tsv, centroids.npy, vectors.npy, radii.npy,
    cohorts.json (settings, sizes, noise count, fingerprint), cohorts.json last.

    Args:
        model: the fitted cohort model.
        directory: the export folder, created if missing.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["user_id\tcohort\tlabel"] + [f"{u}\t{c}\t{lab}" for u, c, lab in
                                           zip(model.user_ids, model.cohorts, model.labels)]
    atomic_write_text(out / "assignments.tsv", "\n".join(lines) + "\n")
    for name, arr in (("centroids", model.centroids), ("vectors", model.vectors), ("radii", model.radii)):
        with atomic_replace(out / f"{name}.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, arr)
    meta = CohortMeta(FORMAT, model.settings, model.data_fingerprint, len(model), model.n_cohorts,
                      model.sizes.tolist(), model.noise_count, model.dim, model.encoder)
    atomic_write_json(out / "cohorts.json", asdict(meta))
    return out


def read_cohorts(directory: str | Path) -> dict[str, Any]:
    """The fields of the CohortModel exported to `directory` (`CohortModel.load` builds it); a
    missing or foreign folder is an error naming the file.

    Args:
        directory: a folder written by `write_cohorts`.
    """
    d = Path(directory)
    meta_path = d / "cohorts.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no cohort export at {meta_path} (written last by CohortModel.save)")
    raw = json.loads(meta_path.read_text())
    meta = CohortMeta(**{**raw, "settings": CohortSettings(**raw.get("settings", {}))})
    if meta.format != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.format!r}, expected {FORMAT!r}")
    parts = [r.split("\t") for r in (d / "assignments.tsv").read_text().splitlines()[1:]]
    fields = {"settings": meta.settings, "user_ids": [p[0] for p in parts], "vectors": np.load(d / "vectors.npy"),
              "labels": np.array([int(p[2]) for p in parts], np.int64),
              "cohorts": np.array([int(p[1]) for p in parts], np.int64),
              "centroids": np.load(d / "centroids.npy"), "radii": np.load(d / "radii.npy"),
              "data_fingerprint": meta.fingerprint, "encoder": meta.encoder}
    if len(parts) != meta.users:
        raise ValueError(f"{d}: assignments.tsv has {len(parts)} users, cohorts.json says {meta.users}")
    return fields
