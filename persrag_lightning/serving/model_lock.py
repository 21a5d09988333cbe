"""The chat service's model lock: a plain lock that counts the threads waiting for it, so that a
thread taking it again and again can let them in first.

Continuous batching (serving/continuous.py) takes the lock for every token it generates and asks
again at once. With a plain `threading.Lock` that thread mostly takes it back before the chats
waiting to retrieve wake up, so they would wait for every reply in flight to end, and no chat could
join the batch meanwhile. So after each token the worker calls `yield_to_waiters`: if a thread is
waiting, it pauses until one of them holds the lock (a bounded wait). Everyone else takes the lock
as a plain lock: a first-come, first-served lock (a ticket lock on a condition variable, which
wakes every waiter at every release) was measured slower on the answers route's unbatched server
under many clients (docs/serving/chat-service.md).
"""

from __future__ import annotations

import threading
import time

__all__ = ["ModelLock"]


class ModelLock:
    """A non-reentrant lock, `with`-able, that knows how many threads wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()  # guards `waiting`
        self.waiting = 0  # threads blocked in `acquire`

    def acquire(self) -> bool:
        if self._lock.acquire(blocking=False):  # free: no bookkeeping
            return True
        with self._count:
            self.waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self.waiting -= 1
        return True

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def yield_to_waiters(self, at_most_s: float = 0.02) -> None:
        """Called by a thread that just released the lock and will take it again: while threads wait
        and none of them holds it yet, give them the processor (at most `at_most_s`)."""
        deadline = time.monotonic() + at_most_s
        while self.waiting and not self._lock.locked() and time.monotonic() < deadline:
            time.sleep(0)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
