"""The per-user gate of the chat service: a deletion refuses the user's new requests at once and
waits for the ones in flight, so nothing it removes is written again after it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from persrag_lightning.serving.validation import ServiceError

__all__ = ["UserGate"]


class UserGate:
    """Requests in flight per user, and the users being deleted; counts go with their user (none is
    kept for a user with nothing in flight)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.active: dict[str, int] = {}
        self.deleting: set[str] = set()

    @contextmanager
    def request(self, user_id: str, check: Callable[[], None]) -> Iterator[None]:
        """One request acting on `user_id`; `check` (run under the gate's lock) raises when it may
        not start."""
        with self._cond:
            # first: a user whose token the deletion revoked gets the 401 every later request gets
            check()
            if user_id in self.deleting:
                raise ServiceError(409, f"user {user_id!r} is being deleted")
            self.active[user_id] = self.active.get(user_id, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                left = self.active.pop(user_id) - 1
                if left:
                    self.active[user_id] = left
                self._cond.notify_all()

    @contextmanager
    def deletion(
        self, user_id: str, check: Callable[[], None], revoke: Callable[[], None]
    ) -> Iterator[None]:
        """The deletion of `user_id`: `revoke` runs at once (new requests refused), then the
        requests in flight are waited for; one deletion of a user at a time."""
        with self._cond:
            if user_id in self.deleting:
                raise ServiceError(409, f"a deletion of user {user_id!r} is already under way")
            check()
            self.deleting.add(user_id)
            revoke()
            self._cond.wait_for(lambda: not self.active.get(user_id))
        try:
            yield
        finally:
            with self._cond:
                self.deleting.discard(user_id)
                self._cond.notify_all()
