"""`<state>/users/<hash>.npz`: a user added (or given a new history) online — their docs, the
retriever's doc vectors and their user vectors — so a restart re-attaches them without re-encoding.
Named by a hash of the id, so no file name carries it."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import torch

from persrag_lightning.data.docstore import history_from_json
from persrag_lightning.data.records import User
from persrag_lightning.utils import atomic_replace

__all__ = ["read_user_file", "user_file", "write_user_file"]


def user_file(state: Path, user_id: str) -> Path:
    return state / "users" / f"{hashlib.sha256(user_id.encode()).hexdigest()[:32]}.npz"


def write_user_file(state: Path, user: User, history: list[dict], doc_vectors: torch.Tensor,
                    user_vectors: torch.Tensor, cohort: dict | None = None) -> None:
    """`cohort`: the cohort the user was assigned to (users="cluster"), kept so a restart reuses
    it."""
    buf = io.BytesIO()
    meta = json.dumps(
        {"user_id": user.user_id, "docs": history, "cohort": cohort}, ensure_ascii=False
    )
    np.savez(buf, meta=np.array(meta), doc_vectors=doc_vectors.float().numpy(),
             user_vectors=user_vectors.float().numpy())
    with atomic_replace(user_file(state, user.user_id)) as tmp, open(tmp, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())


def read_user_file(path: Path) -> tuple[User, torch.Tensor, torch.Tensor, dict | None]:
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        return (User(meta["user_id"], history_from_json(meta["docs"])), torch.from_numpy(z["doc_vectors"]),
                torch.from_numpy(z["user_vectors"]), meta.get("cohort"))
