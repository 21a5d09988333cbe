"""Deleting users from an exported run for real: the run's files are rewritten without them, through
a journal.

What a deletion rewrites (each file staged beside its target as `<name>.purge-new`, then renamed
over it):
- `docstore/users.jsonl`: their lines;
- every bundle's user table (`user_ids.json`, `user_embeddings.safetensors`, and `users.faiss`,
  rebuilt as the same kind of index with the same parameters): the user encoder's, a retriever's
  fine-tuned one;
- the user encoder's doc table (`model.safetensors`, `config.json`'s num_docs): the rows of their
  docs (row r + 2 is docstore corpus row r, so the remaining rows keep matching the rewritten
  docstore);
- the cohort export (`clusters/`): their assignment and vector; their cohort's centroid and radius
  recomputed;
- the corpus-embedding caches of the docstore's corpus (`<cache>/embeddings/<key>/`, every encoder):
  a cache of the new corpus is written from the kept rows (no re-embedding) and the old folder is
  removed;
- a trained reader's doc-vector caches (`<cache>/reader-docs/`, reading/doc_vectors.py): removed,
  made again at the next start.

The journal (`purge.json` in the service state) makes it all-or-nothing as the service sees it:
phase `begin` (the users, written first) → the files are staged → phase `commit` (the list of
renames) → the renames → phase `exported` → the caller's own state (memory bank, accounts) → the
journal is removed. A crash before `commit` leaves the old export untouched (staged files are
dropped and the purge is redone at the next start); a crash after it is rolled forward at the next
start, before the run is loaded. Every step is idempotent.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import faiss
import numpy as np
import torch
from safetensors.torch import load_file

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.docstore import USERS_FILE, read_docstore
from persrag_lightning.data.histories import FIRST_DOC_ID
from persrag_lightning.index import build_index, index_params, load_index
from persrag_lightning.models.corpus_embeddings import (
    EMBEDDINGS_FILE,
    corpus_embedding_dir,
    corpus_embedding_key,
)
from persrag_lightning.reading.doc_vectors import READER_DOCS
from persrag_lightning.retrieval.cohorts import CohortModel
from persrag_lightning.utils import atomic_replace, atomic_save_tensors, atomic_write_json, atomic_write_text

__all__ = ["begin", "done", "pending", "purge_export"]

log = logging.getLogger(__name__)

JOURNAL = "purge.json"
STAGED = ".purge-new"
COHORT_STAGING = ".purge-staging"  # a folder inside clusters/ that CohortModel.save writes into


def pending(state_dir: str | Path) -> dict | None:
    """The unfinished purge recorded in the state folder, or None."""
    path = Path(state_dir) / JOURNAL
    return json.loads(path.read_text()) if path.is_file() else None


def begin(state_dir: str | Path, users: Iterable[str]) -> dict:
    """Record the users to purge (added to any purge already pending) before anything is changed."""
    journal = pending(state_dir) or {"users": [], "phase": "begin"}
    journal = {"users": sorted(set(journal["users"]) | set(users)), "phase": "begin"}
    atomic_write_json(Path(state_dir) / JOURNAL, journal)
    return journal


def done(state_dir: str | Path) -> None:
    (Path(state_dir) / JOURNAL).unlink(missing_ok=True)


def purge_export(run_dir: str | Path, state_dir: str | Path, cache_dir: str | Path) -> None:
    """Take the pending purge to phase `exported`: (re)stage and commit it if it was not committed,
    then do the renames and removals. Nothing to do without a pending purge."""
    state_dir = Path(state_dir)
    journal = pending(state_dir)
    if journal is None or journal["phase"] == "exported":
        return
    if journal["phase"] == "begin":
        _drop_staged(run_dir)
        moves, removes = stage(run_dir, journal["users"], cache_dir)
        journal = {**journal, "phase": "commit", "moves": moves, "remove": removes}
        atomic_write_json(state_dir / JOURNAL, journal)  # the commit point
    apply(journal)
    atomic_write_json(state_dir / JOURNAL, {"users": journal["users"], "phase": "exported"})


def apply(journal: dict) -> None:
    """The committed renames (a staged file already moved is skipped) and removals, in order."""
    for src, dst in journal["moves"]:
        if Path(src).exists():
            _replace(src, dst)
    for path in journal["remove"]:
        shutil.rmtree(path, ignore_errors=True)


def _replace(src: str, dst: str) -> None:
    os.replace(src, dst)


def _drop_staged(run_dir: str | Path) -> None:
    """Staged files of a purge cut short before its commit: the old export stays as it was."""
    for path in Path(run_dir).rglob(f"*{STAGED}"):
        path.unlink()
    shutil.rmtree(Path(run_dir) / "clusters" / COHORT_STAGING, ignore_errors=True)


def _stage_path(target: Path) -> Path:
    return target.with_name(target.name + STAGED)


def stage(run_dir: str | Path, users: Iterable[str], cache_dir: str | Path) -> tuple[list, list]:
    """Write every rewritten file beside its target; returns (renames, folders to remove). Changes
    nothing the run's readers see."""
    run_dir, users = Path(run_dir), set(users)
    moves: list[tuple[str, str]] = []

    def staged(target: Path) -> Path:
        moves.append((str(_stage_path(target)), str(target)))
        return _stage_path(target)

    removes: list[str] = []
    docstore = run_dir / "docstore"
    old = read_docstore(docstore)
    corpus = Corpus.from_dataset(old)
    present = [u for u in old.user_ids() if u in users]
    keep_rows = np.array([r for i, u in enumerate(corpus.user_ids) if u not in users
                          for r in corpus.user_rows(i)], np.int64)
    if present:
        with open(docstore / USERS_FILE, encoding="utf-8") as f:
            lines = [line for line in f if json.loads(line)["user_id"] not in users]
        atomic_write_text(staged(docstore / USERS_FILE), "".join(lines))
    for ids_file in sorted(run_dir.glob("*/user_ids.json")):
        _stage_user_table(ids_file.parent, users, staged)
    encoder = run_dir / "user_encoder"
    if present and (encoder / "model.safetensors").is_file():
        _stage_doc_table(encoder, corpus, keep_rows, staged)
    clusters = run_dir / "clusters"
    if (clusters / "cohorts.json").is_file():
        model = CohortModel.load(clusters)
        if model.remove(sorted(users)):
            tmp = clusters / COHORT_STAGING
            model.save(tmp)
            names = sorted(p.name for p in tmp.iterdir())
            # cohorts.json last: the export's seal
            for name in sorted(names, key=lambda n: n == "cohorts.json"):
                moves.append((str(tmp / name), str(clusters / name)))
            removes.append(str(tmp))
    if present:
        kept = read_docstore(docstore)
        for u in present:
            del kept.users[u]
            kept.private.discard(u)
        removes += _stage_embeddings(corpus, Corpus.from_dataset(kept), keep_rows, Path(cache_dir))
        removes.append(str(Path(cache_dir) / READER_DOCS))
    return moves, removes


def _stage_user_table(bundle: Path, users: set[str], staged) -> None:
    ids = json.loads((bundle / "user_ids.json").read_text())
    keep = [i for i, u in enumerate(ids) if u not in users]
    if len(keep) == len(ids):
        return
    table = load_file(str(bundle / "user_embeddings.safetensors"))["embeddings"][keep].contiguous()
    atomic_save_tensors({"embeddings": table}, staged(bundle / "user_embeddings.safetensors"))
    if (bundle / "users.faiss").is_file():
        index = build_index(
            table.float().numpy(), **index_params(load_index(bundle / "users.faiss"))
        )
        with atomic_replace(staged(bundle / "users.faiss")) as tmp:
            faiss.write_index(index, str(tmp))
    # ids last, as save_pretrained
    atomic_write_json(staged(bundle / "user_ids.json"), [ids[i] for i in keep])


def _stage_doc_table(encoder: Path, corpus: Corpus, keep_rows: np.ndarray, staged) -> None:
    config = json.loads((encoder / "config.json").read_text())
    if config["num_docs"] != len(corpus):
        raise ValueError(f"{encoder}/config.json: num_docs {config['num_docs']} but the docstore has {len(corpus)} "
                         "docs; the export is inconsistent (re-export stage 1)")
    weights = load_file(str(encoder / "model.safetensors"))
    table = weights["doc_table.weight"]
    rows = torch.cat([torch.arange(FIRST_DOC_ID), torch.as_tensor(keep_rows) + FIRST_DOC_ID])
    weights["doc_table.weight"] = table[rows].contiguous()
    atomic_save_tensors(weights, staged(encoder / "model.safetensors"))
    atomic_write_json(staged(encoder / "config.json"), {**config, "num_docs": len(keep_rows)})


def _stage_embeddings(
    old: Corpus, new: Corpus, keep_rows: np.ndarray, cache_dir: Path
) -> list[str]:
    """Each embedding cache of the old corpus (any encoder) → a cache of the new one from the kept
    rows (written now under the new corpus' key, which nothing reads yet); the old folders are
    returned for removal."""
    removes = []
    root = cache_dir / "embeddings"
    if not root.is_dir():
        return removes
    for folder in sorted(p for p in root.iterdir() if (p / "meta.json").is_file()):
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("rows") != len(old):
            continue
        # a cache made before precision was recorded is float32
        args = (meta["encoder"], meta["max_length"], meta["pooling"], meta.get("precision", "fp32"))
        if folder.name != corpus_embedding_key(old, *args):
            continue
        removes.append(str(folder))
        if not len(new):
            continue
        out = corpus_embedding_dir(cache_dir, corpus_embedding_key(new, *args))
        if (out / EMBEDDINGS_FILE).is_file():
            continue
        table = load_file(str(folder / EMBEDDINGS_FILE))["embeddings"][
            torch.as_tensor(keep_rows)
        ].contiguous()
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            out / "meta.json", {**meta, "rows": len(new), "unique_texts": len(set(new.texts))}
        )
        # last: its presence means complete
        atomic_save_tensors({"embeddings": table}, out / EMBEDDINGS_FILE)
    return removes
