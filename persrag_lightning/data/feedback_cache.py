"""On-disk format of an LLM-feedback cache: one folder per configuration fingerprint, `config.json`,
and per split JSONL chunks of `chunk_size` examples (`<split>/chunk-00000.jsonl`), each written
atomically, so a killed build resumes from its finished chunks and shards (chunk c of shard c mod n)
merge into the single-process result."""

from __future__ import annotations

import fcntl
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from persrag_lightning.data.candidates import FeedbackExample
from persrag_lightning.utils import atomic_open, atomic_write_json

__all__ = ["FeedbackCache"]


class FeedbackCache:
    """Chunk layout of one configuration's labels; knows files, not how labels are made."""

    def __init__(self, root: str | Path, chunk_size: int) -> None:
        self.root = Path(root)
        self.chunk_size = chunk_size

    def num_chunks(self, num_examples: int) -> int:
        return math.ceil(num_examples / self.chunk_size)

    def chunk_path(self, split: str, chunk: int) -> Path:
        return self.root / split / f"chunk-{chunk:05d}.jsonl"

    def missing_chunks(self, split: str, num_examples: int) -> list[int]:
        return [c for c in range(self.num_chunks(num_examples)) if not self.chunk_path(split, c).exists()]

    @contextmanager
    def build_lock(self, shard: int = 0, num_shards: int = 1) -> Iterator[None]:
        """An exclusive lock on building shard `shard` of `num_shards` of this cache (flock:
        released when its holder dies, so a killed or requeued builder never blocks the next
        one)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".build-{shard}-of-{num_shards}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def write_config(self, config: dict) -> None:
        atomic_write_json(self.root / "config.json", config)

    def write_chunk(self, split: str, chunk: int, records: list[FeedbackExample]) -> None:
        with atomic_open(self.chunk_path(split, chunk)) as f:
            for rec in records:
                f.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")

    def read(self, split: str, num_examples: int) -> list[FeedbackExample]:
        """The first `num_examples` records of the split, in example-id order (every chunk must
        exist)."""
        out: list[FeedbackExample] = []
        for c in range(self.num_chunks(num_examples)):
            path = self.chunk_path(split, c)
            for line_no, line in enumerate(path.read_text().splitlines(), 1):
                try:
                    out.append(FeedbackExample.from_json(json.loads(line)))
                except (json.JSONDecodeError, TypeError, KeyError) as err:
                    raise ValueError(
                        f"{path}: line {line_no}: corrupt feedback record ({err}); delete the file "
                        "and rebuild"
                    ) from err
        return out[:num_examples]
