"""Content-addressed store of LLM outputs, shared by every build, shard, stage, strategy and run of
a cache folder.

A key is the sha256 of (the LLM's identity and answer settings, the kind of call, the prompt and —
for log-likelihoods — the target), so a prompt that any earlier feedback build, Slurm array task or
evaluation has already sent is never sent again. Each process appends to its own JSONL file (one
complete line per output, flushed per batch), so concurrent writers never interleave and a killed
process loses at most its last, unflushed line; readers take the union of all files and skip a torn
last line.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PROMPT_STORE", "PromptStore", "prompt_key"]

PROMPT_STORE = "llm_outputs"  # folder under a cache_dir


def prompt_key(identity: dict, kind: str, prompt: str, target: str = "") -> str:
    """Key of one LLM call: what answers (identity), how (kind: answer / loglik), to what."""
    blob = json.dumps([identity, kind, prompt, target], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


class PromptStore:
    """Outputs by key under `root`; `hits`/`misses` count lookups since creation (reported by
    evaluate)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.values: dict[str, Any] = {}
        self.hits = 0
        self.misses = 0
        self._own: Path | None = None
        self.reload()

    def reload(self) -> None:
        """Read every writer's file (another process may have added outputs since)."""
        if not self.root.is_dir():
            return
        for path in sorted(self.root.glob("*.jsonl")):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        key, value = json.loads(line)
                    except (json.JSONDecodeError, ValueError):
                        continue  # a torn last line of a killed writer
                    self.values[key] = value

    def put(self, items: dict[str, Any]) -> None:
        if not items:
            return
        if self._own is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._own = (
                self.root / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
            )
        with open(self._own, "a", encoding="utf-8") as f:
            f.writelines(
                json.dumps([key, value], ensure_ascii=False) + "\n" for key, value in items.items()
            )
            f.flush()
            os.fsync(f.fileno())
        self.values.update(items)

    def cached(self, keys: Sequence[str], compute: Callable[[list[int]], list[Any]]) -> list[Any]:
        """Values of `keys`; `compute(indices)` is called once with the first index of each missing
        distinct key and must return their values in that order."""
        missing: dict[str, int] = {}
        for i, key in enumerate(keys):
            if key in self.values or key in missing:
                self.hits += key in self.values
                continue
            missing[key] = i
        self.misses += len(missing)
        if missing:
            values = compute(list(missing.values()))
            self.put(dict(zip(missing, values)))
        return [self.values[k] for k in keys]

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else float("nan")
