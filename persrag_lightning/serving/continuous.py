"""Continuous batching of the chats' LLM replies: a chat's prompt joins the replies in flight between
two tokens, instead of waiting for a whole batch to end (the micro-batcher's way: a batch is as slow
as its longest reply, and a chat that arrives while it runs waits for all of it).

One worker thread loops: it takes the prompts queued (up to `max_rows` in flight), prefills them,
generates one token for every row (llm/hf_stepping.py) and hands back the replies that ended. It
holds the model lock for one prefill or one token at a time and, after each, lets the threads
waiting for it in first (serving/model_lock.py), so other chats retrieve between two tokens and
join the replies in flight.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.hf_stepping import Ended, GreedyRows, stepping_unsupported
from persrag_lightning.serving.batcher import QueueWorker
from persrag_lightning.serving.model_lock import ModelLock

__all__ = ["ContinuousReplies", "ContinuousStats"]

log = logging.getLogger(__name__)
Reply = tuple[str, tuple[int, int]]  # (reply, (the prompt's tokens, the reply's))


@dataclass
class ContinuousStats:
    """What the worker did, for benchmarks and logs.

    Args:
        calls: prefills (each admits the prompts queued together).
        steps: decoding steps (one token for every row in flight).
        items: replies handed back.
        largest: the most rows in flight at once.
        prefill_s: seconds the prefills took (the model lock held), where a chat's prompt is read.
        step_s: seconds the decoding steps took (the model lock held).
        stepped_rows: rows over all steps (over `steps`: the mean rows a step decodes).
    """

    calls: int = 0
    steps: int = 0
    items: int = 0
    largest: int = 0
    prefill_s: float = 0.0
    step_s: float = 0.0
    stepped_rows: int = 0

    def describe(self, items: str) -> str:
        mean = self.stepped_rows / self.steps if self.steps else 0.0
        return (f"continuous: {self.calls} prefills and {self.steps} steps for {self.items} {items}, at most "
                f"{self.largest} in flight; prefills took {self.prefill_s:.1f} s, steps {self.step_s:.1f} s "
                f"({mean:.1f} rows a step on average)")


class ContinuousReplies(QueueWorker):
    """`prompt -> (reply, usage)` for concurrent chats, decoded together as they come and go.

    Args:
        llm: the pipeline's LLM, loaded on first use.
        lock: the service's model lock.
        budget: the most tokens a reply has.
        max_rows: the most replies in flight; a prompt beyond them waits for a row to end.
        whole_batches: the replies of prompts queued together, in one call that takes the lock itself
            (`ChatAnswerer._reply_many`): what an LLM that cannot decode row by row gets
            (llm/hf_stepping.stepping_unsupported names why, once, in the log).
        name: the worker thread's name.
    """

    def __init__(self, llm: Callable[[], LLM], lock: ModelLock, budget: int, max_rows: int,
                 whole_batches: Callable[[list[str]], list[Reply]], name: str = "persrag-generation") -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        super().__init__(name)
        self._llm, self._model_lock, self.budget, self.max_rows = llm, lock, budget, max_rows
        self._whole_batches = whole_batches
        self.stats = ContinuousStats()
        self._rows: GreedyRows | None = None
        self._stepping: bool | None = None  # whether the LLM decodes row by row (known at its first prompt)
        self._waiting: dict[int, tuple[Future, int]] = {}  # a row's key: its future, its prompt's tokens

    def __call__(self, prompt: str) -> Reply:
        return self.submit(prompt).result()

    def submit(self, prompt: str) -> Future:
        """A future of the prompt's reply; refused (RuntimeError) once closed (`close` finishes the
        replies in flight and those queued)."""
        return self._enqueue(prompt)

    def _loop(self) -> None:
        stopping = False
        while True:
            # nothing in flight: sleep until a prompt comes; otherwise take only what is queued
            arrived, stop = self._take(block=not self._waiting and not stopping)
            stopping = stopping or stop
            if arrived:
                self._admit(arrived)
            if self._waiting:
                self._step()
            elif stopping and self._queue.empty():
                return

    def _take(self, block: bool) -> tuple[list[tuple[str, Future]], bool]:
        """The prompts queued, up to the free rows (blocking for the first when `block`); (prompts,
        whether the stop mark was met)."""
        taken: list[tuple[str, Future]] = []
        while len(self._waiting) + len(taken) < self.max_rows:
            try:
                entry = self._queue.get() if block and not taken else self._queue.get_nowait()
            except queue.Empty:
                break
            if entry is self._stop:
                return taken, True
            taken.append(entry)
        return taken, False

    def _admit(self, arrived: list[tuple[str, Future]]) -> None:
        """Prefill the prompts as new rows; if that fails, each alone, so only a failing prompt's chat
        gets the error."""
        prompts, futures = [p for p, _ in arrived], [f for _, f in arrived]
        try:
            if not self._can_step():
                self._answer_whole(futures, self._whole_batches(prompts))
                return
            keys = [id(f) for f in futures]
            with self._model_lock:
                counts = [self._rows.llm.count_tokens(p) for p in prompts]
                start = time.perf_counter()
                admitted = self._rows.admit(keys, prompts, self.budget)
                self.stats.prefill_s += time.perf_counter() - start
                ended = self._ended(admitted)
        except Exception as e:  # noqa: BLE001  (handed to the futures: a waiting chat never hangs)
            if len(arrived) == 1:
                futures[0].set_exception(e)
            else:
                for one in arrived:
                    self._admit([one])
            return
        self.stats.calls += 1
        self._waiting.update({key: (f, n) for key, f, n in zip(keys, futures, counts)})
        self.stats.largest = max(self.stats.largest, len(self._waiting))
        self._deliver(ended)

    def _can_step(self) -> bool:
        """Whether the LLM decodes row by row; asked once, the reason it cannot logged."""
        if self._stepping is None:
            with self._model_lock:
                llm = self._llm()
                why = stepping_unsupported(llm)
                self._stepping = why is None
                if self._stepping:
                    self._rows = GreedyRows(llm)
            if why is not None:
                log.warning("continuous batching is off for this LLM (%s): replies queued together are "
                            "generated in one call", why)
        return self._stepping

    def _step(self) -> None:
        """One token for every row in flight; if it fails, every row in flight gets the error (their
        cache is one)."""
        try:
            with self._model_lock:
                rows, start = len(self._rows), time.perf_counter()
                stepped = self._rows.step()
                self.stats.step_s += time.perf_counter() - start
                ended = self._ended(stepped)
            self._model_lock.yield_to_waiters()
        except Exception as e:
            log.exception("continuous batching: a decoding step failed; %d replies in flight fail",
                          len(self._waiting))
            for future, _ in self._waiting.values():
                future.set_exception(e)
            self._waiting.clear()
            self._rows = GreedyRows(self._rows.llm)
            return
        self.stats.steps += 1
        self.stats.stepped_rows += rows
        self._deliver(ended)

    def _ended(self, ended: list[Ended]) -> list[tuple[int, str, int]]:
        """(key, reply, the reply's tokens as the LLM's tokenizer counts them) of rows that ended;
        the caller holds the model lock (the tokenizer is the LLM's)."""
        return [(e.key, e.text, self._rows.llm.count_tokens(e.text)) for e in ended]

    def _deliver(self, ended: list[tuple[int, str, int]]) -> None:
        for key, text, tokens in ended:
            future, prompt_tokens = self._waiting.pop(key)
            self.stats.items += 1
            future.set_result((text, (prompt_tokens, tokens)))

    def _answer_whole(self, futures: list[Future], replies: list[Reply]) -> None:
        """The replies of one whole-batch call (an LLM that cannot decode row by row), in order."""
        for future, reply in zip(futures, replies, strict=True):
            future.set_result(reply)
        self.stats.calls += 1
        self.stats.items += len(futures)
        self.stats.largest = max(self.stats.largest, len(futures))
