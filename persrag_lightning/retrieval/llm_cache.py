"""Content-addressed, resumable on-disk cache of LLM outputs (one JSON file per prompt, written atomically).

Why: PBR's pseudo-feedback costs two LLM generations per query; a rerun (another variant, a sweep over θ/k2/α, a
killed job) must not pay them again. The key is sha256 over (prompt digest, LLM fingerprint, generation settings),
so a different model, backend setting or token budget never reads a stale answer. Each answer is written as soon
as its batch returns, so a killed run loses at most one batch; `shard i of n` owns the prompts whose key falls in
its residue class, so a Slurm array fills disjoint parts of one cache folder without locks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from persrag_lightning.utils import atomic_write_json


class Generator(Protocol):
    """What the cache needs of an LLM: its fingerprint and greedy generation (persrag_lightning.llm.base.LLM)."""

    @property
    def fingerprint(self) -> str: ...

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]: ...


@dataclass(frozen=True)
class CacheStats:
    """What a `generate` call did: answers read from disk, prompts sent to the LLM, prompts left to other shards."""

    hits: int = 0
    calls: int = 0
    skipped: int = 0


def prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def cache_key(prompt: str, llm_fingerprint: str, max_new_tokens: int) -> str:
    """sha256 of the prompt digest, the LLM's identity and the generation settings (greedy, token budget)."""
    blob = json.dumps({"prompt": prompt_digest(prompt), "llm": llm_fingerprint,
                       "generation": {"decoding": "greedy", "max_new_tokens": max_new_tokens}}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def shard_of(key: str, num_shards: int) -> int:
    """Shard owning a key: a residue of the key's hash, so shards are disjoint and balanced."""
    return int(key[:16], 16) % num_shards


class CachedLLM:
    """An LLM behind the on-disk cache; `calls` counts prompts actually sent to the LLM in this object's life."""

    def __init__(self, llm: Generator, cache_dir: str | Path, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.llm = llm
        self.root = Path(cache_dir)
        self.batch_size = batch_size
        self.calls = 0
        self.hits = 0

    @property
    def fingerprint(self) -> str:
        return self.llm.fingerprint

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def lookup(self, prompt: str, max_new_tokens: int) -> str | None:
        """The cached answer, or None (a corrupt entry, e.g. from a disk-full write, is treated as missing)."""
        path = self.path(cache_key(prompt, self.fingerprint, max_new_tokens))
        if not path.is_file():
            return None
        try:
            return str(json.loads(path.read_text(encoding="utf-8"))["output"])
        except (json.JSONDecodeError, KeyError, OSError, UnicodeDecodeError):
            return None

    def generate(self, prompts: Sequence[str], max_new_tokens: int, shard: int = 0, num_shards: int = 1
                 ) -> tuple[list[str | None], CacheStats]:
        """Answers for `prompts`, from disk when present, else from the LLM (stored before the next batch).

        With `num_shards > 1` only this shard's missing prompts are generated; other shards' misses stay None.
        Identical prompts in one call are generated once.
        """
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
        out: list[str | None] = [None] * len(prompts)
        missing: dict[str, list[int]] = {}
        keys: dict[str, str] = {}
        hits = skipped = 0
        for i, prompt in enumerate(prompts):
            cached = self.lookup(prompt, max_new_tokens)
            if cached is not None:
                out[i] = cached
                hits += 1
                continue
            key = cache_key(prompt, self.fingerprint, max_new_tokens)
            if shard_of(key, num_shards) != shard:
                skipped += 1
                continue
            missing.setdefault(prompt, []).append(i)
            keys[prompt] = key
        todo = list(missing)
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start:start + self.batch_size]
            answers = self.llm.generate(batch, max_new_tokens)
            if len(answers) != len(batch):
                raise RuntimeError(f"LLM returned {len(answers)} answers for {len(batch)} prompts")
            self.calls += len(batch)
            for prompt, answer in zip(batch, answers):
                atomic_write_json(self.path(keys[prompt]), {
                    "key": keys[prompt], "llm": self.fingerprint, "max_new_tokens": max_new_tokens,
                    "prompt_sha256": prompt_digest(prompt), "prompt": prompt, "output": answer}, indent=None)
                for i in missing[prompt]:
                    out[i] = answer
        self.hits += hits
        return out, CacheStats(hits=hits, calls=len(todo), skipped=skipped)
