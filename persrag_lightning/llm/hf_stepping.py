"""Greedy decoding whose rows join and leave between two tokens (continuous batching), for the
transformers causal-LM backend.

`HFLLM.generate` runs a batch from its first token to its last, so a prompt that arrives meanwhile
waits for the whole batch, and the batch is as slow as its longest reply. `GreedyRows` keeps one KV
cache for the rows in flight instead: `admit` prefills new prompts (one left-padded forward) and
appends them to the cache, left-padding whichever side is shorter; `step` feeds every row its
latest token and hands back the rows that ended (an end-of-turn token or their budget), whose
places the next `admit` fills. A row decodes as `generate` decodes it: its padding is masked and
its positions count its own tokens only (as `generate` derives them from the attention mask).
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # a transformers release before layered caches: stepping_unsupported says so
    DynamicLayer = object

if TYPE_CHECKING:
    from persrag_lightning.llm.hf import HFLLM

__all__ = ["Ended", "GreedyRows", "stepping_unsupported"]


@dataclass
class Ended:
    """A row that ended: its key and its reply (stripped, as `generate` returns it)."""

    key: Hashable
    text: str


@dataclass
class _Row:
    key: Hashable
    budget: int
    tokens: list[int] = field(default_factory=list)


def stepping_unsupported(llm: Any) -> str | None:
    """Why `llm` cannot decode in `GreedyRows` (None when it can): a transformers causal LM decoding
    greedily, whose cache (transformers' DynamicCache with `layers`) holds full-length layers."""
    from persrag_lightning.llm.hf import HFLLM

    if not isinstance(llm, HFLLM):
        return f"the {getattr(llm, 'backend', type(llm).__name__)} backend generates whole batches only"
    if llm.num_beams != 1:
        return f"{llm.num_beams}-beam search"
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=llm.model.config)
    except (ImportError, TypeError) as err:
        return f"this transformers release's cache: {err}"
    kinds = {type(layer) for layer in getattr(cache, "layers", [])}
    if kinds != {DynamicLayer}:
        return f"the model's cache layers are {sorted(k.__name__ for k in kinds) or 'not listed'}"
    return None


class GreedyRows:
    """The rows in flight of greedy decoding, over one KV cache.

    Args:
        llm: the backend whose model and tokenizer decode (`stepping_unsupported(llm)` must be None).
            The caller serializes `admit` and `step` with every other use of the model.
    """

    def __init__(self, llm: HFLLM) -> None:
        why = stepping_unsupported(llm)
        if why is not None:
            raise ValueError(f"continuous batching is not available: {why}")
        self.llm = llm
        params = inspect.signature(llm.model.forward).parameters
        # transformers 5 names the cache argument `cache`; earlier releases `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.rows: list[_Row] = []
        self._budget = 1  # the largest budget admitted: the room each cache layer keeps
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long)  # (rows, cached positions): 1 where a row has a token
        self._last = torch.zeros(0, dtype=torch.long)  # each row's latest token, not yet in the cache

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def admit(self, keys: Sequence[Hashable], prompts: Sequence[str], budget: int) -> list[Ended]:
        """Prefill `prompts` (through the chat template, as `generate` encodes them) as new rows of at
        most `budget` tokens; returns those that end at their first token."""
        if budget < 1:
            raise ValueError(f"budget must be at least 1, got {budget}")
        if not prompts:
            return []
        from transformers import DynamicCache

        ids, mask = self.llm._left_pad(self.llm._encode_prompts(list(prompts)))
        cache = DynamicCache(config=self.llm.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        first = self._forward(ids, mask, positions, cache)
        start = len(self.rows)
        self._budget = max(budget, self._budget)
        self._append([_Row(key, budget) for key in keys], cache, mask.cpu(), first)
        return self._collect(start)

    @torch.inference_mode()
    def step(self) -> list[Ended]:
        """One token for every row; returns the rows that ended with it."""
        if not self.rows:
            return []
        positions = self._mask.sum(-1, keepdim=True)  # a row's next position: its tokens so far
        mask = torch.cat([self._mask, torch.ones((len(self.rows), 1), dtype=torch.long)], dim=1)
        device = self.llm.device
        nxt = self._forward(self._last[:, None].to(device), mask.to(device), positions.to(device), self._cache)
        self._mask, self._last = mask, nxt
        return self._collect(0)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """The greedy next token of every row (the float32 argmax of its last logits, as `generate`)."""
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": positions, self._cache_kw: cache,
                                  "use_cache": True}
        if self.llm._keep_kw is not None:
            kwargs[self.llm._keep_kw] = 1
        logits = self.llm.model(input_ids=ids, **kwargs).logits[:, -1, :]
        return logits.float().argmax(-1).cpu()

    def _append(self, rows: list[_Row], cache: Any, mask: torch.Tensor, first: torch.Tensor) -> None:
        """New rows after those in flight, their cache and mask left-padded to a common width."""
        if self._cache is None or not self.rows:
            cache.layers = [_RoomyLayer(layer.keys, layer.values, self._budget) for layer in cache.layers]
            self._cache, self._mask, self._last, self.rows = cache, mask, first, rows
            return
        width = max(self._mask.shape[1], mask.shape[1])
        self._cache.layers = [
            _RoomyLayer(torch.cat([_pad_left(old.keys, width, 2), _pad_left(new.keys, width, 2)]),
                        torch.cat([_pad_left(old.values, width, 2), _pad_left(new.values, width, 2)]), self._budget)
            for old, new in zip(self._cache.layers, cache.layers)]
        self._mask = torch.cat([_pad_left(self._mask, width, 1), _pad_left(mask, width, 1)])
        self._last = torch.cat([self._last, first])
        self.rows += rows

    def _collect(self, start: int) -> list[Ended]:
        """Append the new token (`_last`) of each row from `start` on; rows ending with it (an
        end-of-turn token or the budget spent) leave, and so do the cache positions no remaining
        row uses."""
        eos = set(self.llm._eos_ids)
        ended, kept = [], list(range(start))
        for i, token in enumerate(self._last[start:].tolist(), start):
            row = self.rows[i]
            if token not in eos:
                row.tokens.append(token)
            if token in eos or len(row.tokens) >= row.budget:
                ended.append(Ended(row.key, self.llm.reply_text(row.tokens)))
            else:
                kept.append(i)
        if ended:
            self._keep(kept)
        return ended

    def _keep(self, kept: list[int]) -> None:
        self.rows = [self.rows[i] for i in kept]
        if not kept:
            self._cache, self._mask, self._last = None, self._mask[:0, :0], self._last[:0]
            return
        index = torch.tensor(kept, dtype=torch.long)
        used = self._mask[index].any(0).nonzero()
        start = int(used[0]) if len(used) else 0  # leading positions all padding: dropped
        at = index.to(self.llm.device)
        self._cache.layers = [_RoomyLayer(layer.keys[at, :, start:], layer.values[at, :, start:], self._budget)
                              for layer in self._cache.layers]
        self._mask, self._last = self._mask[index, start:], self._last[index]


class _RoomyLayer(DynamicLayer):
    """transformers' DynamicLayer whose keys and values sit in a buffer with `room` positions to
    spare: a decoding step writes its token in place, where DynamicLayer concatenates (copies) the
    whole cache at every token (benchmarks/profile_reply_steps.py times the two)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        # not DynamicLayer's __init__: `keys` and `values` are views of the buffers here
        self.device, self.is_initialized = keys.device, True
        self._room = max(room, 1)
        self._fill(keys, values)

    def _fill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        b, h, n, d = keys.shape
        self._keys = keys.new_empty((b, h, n + self._room, d))
        self._values = values.new_empty((b, h, n + self._room, values.shape[-1]))
        self._keys[:, :, :n], self._values[:, :, :n] = keys, values
        self._n = n

    @property
    def keys(self) -> torch.Tensor:  # type: ignore[override]
        return self._keys[:, :, :self._n]

    @property
    def values(self) -> torch.Tensor:  # type: ignore[override]
        return self._values[:, :, :self._n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self._n + new > self._keys.shape[2]:  # out of room: a bigger buffer, once
            self._fill(self.keys, self.values)
        self._keys[:, :, self._n:self._n + new] = key_states
        self._values[:, :, self._n:self._n + new] = value_states
        self._n += new
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._n + query_length, 0

    def get_max_length(self) -> int:
        return -1


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros before it along `dim`, up to `width`."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
