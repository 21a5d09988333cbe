"""The chat service's model lock, handed to its waiters in the order they asked.

Continuous batching (serving/continuous.py) takes the lock for every token it generates and asks
again at once. A plain `threading.Lock` lets that thread take it back before the chats waiting to
retrieve wake up, so they would wait for every reply in flight to end, and no chat could join the
batch meanwhile. A ticket lock serves them in turn: one decoding step, then whoever was waiting.
"""

from __future__ import annotations

import _thread
import threading

__all__ = ["FairLock", "ModelLock"]


class FairLock:
    """A first-come, first-served lock (a ticket lock); not reentrant."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket that holds the lock

    def acquire(self) -> bool:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._cond.wait_for(lambda: self._serving == ticket)
        return True

    def release(self) -> None:
        with self._cond:
            if self._serving == self._next:
                raise RuntimeError("release of an unlocked FairLock")
            self._serving += 1
            self._cond.notify_all()

    def locked(self) -> bool:
        with self._cond:
            return self._serving != self._next

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


ModelLock = _thread.LockType | FairLock  # what the service's model calls hold: a plain lock or a fair one
