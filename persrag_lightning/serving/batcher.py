"""A micro-batcher: requests that arrive together share one model call. Each request's thread
submits its item and waits on a future; one worker thread gathers the queued items (up to
`max_batch`, waiting at most `max_wait_ms` after the first), runs the batched function once and
resolves every future with its own result. A batch that fails is run again one item at a time, so
an exception reaches only the request that caused it, never its batch-mates. `max_batch` 1 calls the
function in the caller's thread (the unbatched path, no worker).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Self, TypeVar

__all__ = ["ANSWER_BATCHING", "REPLY_BATCHING", "BatchStats", "Batching", "MicroBatcher", "QueueWorker", "ReplyBatching"]

T = TypeVar("T")
R = TypeVar("R")
_STOP = object()  # the worker's end-of-queue mark


@dataclass(frozen=True)
class Batching:
    """How the service batches concurrent retrievals (`persrag serve --max_batch --max_wait_ms`).

    Args:
        max_batch: the most requests one batched call takes (1: no batching, each request alone).
        max_wait_ms: how long the first request of a batch waits for batch-mates (0: only those
            already queued, which under load are the ones that arrived during the previous call).
    """

    # off by default: on 2 cores batching measured no gain (docs/serving/chat-service.md#many-users-at-once)
    max_batch: int = 1
    max_wait_ms: float = 5.0

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be 0 or more, got {self.max_wait_ms}")


# POST /v1/answers' default, on: concurrent questions measured faster batched, retrieval and reading
# both (docs/serving/chat-service.md#many-users-at-once); no wait: the questions queued meanwhile
ANSWER_BATCHING = Batching(max_batch=16, max_wait_ms=0.0)


@dataclass(frozen=True)
class ReplyBatching(Batching):
    """How the service batches concurrent chats' LLM replies (`persrag serve --llm_max_batch
    --llm_max_wait_ms --llm_batching`).

    Args:
        continuous: True: a reply joins the replies in flight between two tokens and leaves when it
            ends, at most `max_batch` in flight (serving/continuous.py; `max_wait_ms` unused); False:
            whole batches, each generated from its first token to its last (the micro-batcher).
    """

    continuous: bool = True


# the LLM replies' default, on: concurrent chats' replies measured faster batched, and a lone chat's no
# slower (docs/serving/chat-service.md#many-users-at-once)
REPLY_BATCHING = ReplyBatching(max_batch=16, max_wait_ms=5.0, continuous=True)


@dataclass
class BatchStats:
    """What the batcher did, for benchmarks and logs.

    Args:
        calls: calls that succeeded (a failed batch's one-by-one retries count one each).
        items: items answered.
        largest: the largest batch.
    """

    calls: int = 0
    items: int = 0
    largest: int = 0

    def describe(self, items: str) -> str:
        return f"{self.calls} calls for {self.items} {items}, largest {self.largest}"


class QueueWorker:
    """One worker thread behind a queue of (item, future): started on first use (a service that
    never chats has no thread), stopped by `close` once what is queued is done. The micro-batcher's
    and continuous batching's (serving/continuous.py); a subclass's `_loop` takes the queue until
    it meets `_stop`.

    Args:
        name: the worker thread's name.
    """

    _stop = _STOP  # what `close` queues last

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closed = False

    def _refuse_if_closed(self) -> None:
        """The caller holds `_lock`."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")

    def _enqueue(self, item: object) -> Future:
        """A future of the item's result, once the worker takes it; refused once closed."""
        future: Future = Future()
        with self._lock:
            self._refuse_if_closed()
            if self._worker is None:
                self._worker = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._worker.start()
            self._queue.put((item, future))
        return future

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new items, finish those queued, stop the worker; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            if worker is not None:
                self._queue.put(_STOP)
        if worker is not None:
            worker.join(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        raise NotImplementedError


class MicroBatcher(QueueWorker, Generic[T, R]):
    """`fn(items) -> results` (one result per item, in order) behind a per-item `submit`.

    Args:
        fn: the batched function.
        batching: its bounds (default Batching()).
        name: the worker thread's name.
    """

    def __init__(self, fn: Callable[[list[T]], Sequence[R]], batching: Batching | None = None,
                 name: str = "micro-batcher") -> None:
        super().__init__(name)
        self.fn, self.batching = fn, batching or Batching()
        self.stats = BatchStats()

    def __call__(self, item: T) -> R:
        """The item's result (or its exception), batched with whatever arrives with it."""
        return self.submit(item).result()

    def submit(self, item: T) -> Future:
        """A future of the item's result; refused (RuntimeError) once the batcher is closed."""
        if self.batching.max_batch > 1:
            return self._enqueue(item)
        with self._lock:  # the unbatched path: this thread, no queue
            self._refuse_if_closed()
        future: Future = Future()
        self._run([item], [future])
        return future

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is _STOP:
                return
            batch, stopping = self._gather(first)
            self._run([i for i, _ in batch], [f for _, f in batch])

    def _gather(self, first: tuple) -> tuple[list[tuple], bool]:
        """`first` and the items queued with it: up to max_batch, waiting at most max_wait_ms;
        (batch, whether the stop mark was met)."""
        batch = [first]
        deadline = time.monotonic() + self.batching.max_wait_ms / 1000
        while len(batch) < self.batching.max_batch:
            try:
                left = deadline - time.monotonic()
                entry = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if entry is _STOP:
                return batch, True
            batch.append(entry)
        return batch, False

    def _run(self, items: list[T], futures: list[Future]) -> None:
        """One call for the batch; if it fails, each item alone, so each future gets its own
        outcome."""
        try:
            results = list(self.fn(items))
            if len(results) != len(items):
                raise RuntimeError(f"{self.name}: {len(results)} results for {len(items)} items")
        except BaseException as e:  # noqa: BLE001  (handed to the futures: a waiting request never hangs)
            if len(items) == 1:
                futures[0].set_exception(e)
                return
            for item, future in zip(items, futures):
                self._run([item], [future])
            return
        with self._lock:
            self.stats.calls += 1
            self.stats.items += len(items)
            self.stats.largest = max(self.stats.largest, len(items))
        for future, result in zip(futures, results):
            future.set_result(result)
