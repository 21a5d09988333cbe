"""Generation through the project's prompt store (data/prompt_store.py), with Slurm-array sharding.

Why: PBR's pseudo-feedback costs two LLM generations per query; a rerun (another variant, a sweep
over θ/k2/α, a killed job) must not pay them again. The key is sha256 over (prompt, LLM fingerprint,
generation settings), so a different model, backend setting or token budget never reads a stale
answer. Each batch's answers are stored as soon as it returns, so a killed run loses at most one
batch; `shard i of n` owns the prompts whose key falls in its residue class, so a Slurm array fills
disjoint parts of one store folder without locks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from persrag_lightning.data.prompt_store import PromptStore, prompt_key
from persrag_lightning.progress import Progress

__all__ = ["CachedLLM", "Generator"]


class Generator(Protocol):
    """What the cache needs of an LLM: its fingerprint and greedy generation
    (persrag_lightning.llm.base.LLM)."""

    @property
    def fingerprint(self) -> str: ...

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]: ...


@dataclass(frozen=True)
class CacheStats:
    """What a `generate` call did: answers read from disk, prompts sent to the LLM, prompts left to
    other shards."""

    hits: int = 0
    calls: int = 0
    skipped: int = 0


def cache_key(prompt: str, llm_fingerprint: str, max_new_tokens: int) -> str:
    """The prompt store's key of a greedy generation: prompt, LLM identity and token budget."""
    return prompt_key({"llm": llm_fingerprint, "decoding": "greedy", "max_new_tokens": max_new_tokens}, "generate",
                      prompt)


def _shard_of(key: str, num_shards: int) -> int:
    """Shard owning a key: a residue of the key's hash, so shards are disjoint and balanced."""
    return int(key[:16], 16) % num_shards


class CachedLLM:
    """An LLM behind the prompt store; `calls` counts prompts actually sent to the LLM in this
    object's life."""

    def __init__(self, llm: Generator, cache_dir: str | Path, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.llm = llm
        self.store = PromptStore(cache_dir)
        self.batch_size = batch_size
        self.calls = 0
        self.hits = 0

    @property
    def fingerprint(self) -> str:
        return self.llm.fingerprint

    def generate(self, prompts: Sequence[str], max_new_tokens: int, shard: int = 0, num_shards: int = 1,
                 phase: str | None = None) -> tuple[list[str | None], CacheStats]:
        """Answers for `prompts`, from the store when present, else from the LLM (stored batch by
        batch).

        With `num_shards > 1` only this shard's missing prompts are generated; other shards' misses
        stay None. Identical prompts in one call are generated once. A named `phase` prints progress
        with an ETA.
        """
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
        out: list[str | None] = [None] * len(prompts)
        missing: dict[str, list[int]] = {}
        keys: dict[str, str] = {}
        hits = skipped = 0
        for i, prompt in enumerate(prompts):
            key = cache_key(prompt, self.fingerprint, max_new_tokens)
            cached = self.store.values.get(key)
            if isinstance(cached, str):
                out[i] = cached
                hits += 1
            elif _shard_of(key, num_shards) != shard:
                skipped += 1
            else:
                missing.setdefault(prompt, []).append(i)
                keys[prompt] = key
        todo = list(missing)
        bar = (
            Progress(phase, len(todo), "prompts") if phase and len(todo) > self.batch_size else None
        )
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start:start + self.batch_size]
            answers = self.llm.generate(batch, max_new_tokens)
            if len(answers) != len(batch):
                raise RuntimeError(f"LLM returned {len(answers)} answers for {len(batch)} prompts")
            self.calls += len(batch)
            self.store.put({keys[prompt]: answer for prompt, answer in zip(batch, answers)})
            for prompt, answer in zip(batch, answers):
                for i in missing[prompt]:
                    out[i] = answer
            if bar is not None:
                bar.advance(len(batch))
        self.hits += hits
        return out, CacheStats(hits=hits, calls=len(todo), skipped=skipped)
