"""Accounts and secrets of `persrag serve`: bearer tokens kept only as sha256 hashes, the account
store `accounts.jsonl` (one line per account, mode 0600, appended at a sign-up's commit point,
rewritten only to forget a user), and the 0700 state folder and 0600 secret files the service
writes."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from persrag_lightning.serving.validation import ServiceError

__all__ = ["ACCOUNTS", "Account", "AccountStore", "Caller", "hash_token", "private_dir", "write_secret"]

log = logging.getLogger(__name__)

ACCOUNTS = "accounts.jsonl"
# written whole by earlier versions: turned into accounts.jsonl at start
LEGACY_ACCOUNTS = "accounts.json"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Account:
    """One line of the account store.

    Args:
        user_id: the user the account is.
        token_sha256: the hash of their bearer token (the token itself is never kept).
        share: whether similar users' prompts may quote their docs.
        created_at: when they signed up (seconds since the epoch).
    """

    user_id: str
    token_sha256: str
    share: bool = True
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: a user (by token) or the admin; a user's token hash is checked
    again when the request starts its work, so a token revoked in between (a deletion) is refused.

    Args:
        user_id: the token's user; None for the admin.
        admin: whether the admin token was sent.
        token_sha256: the hash of the user's token, checked again under the gate.
    """

    user_id: str | None
    admin: bool = False
    token_sha256: str | None = None


def private_dir(path: Path) -> Path:
    """The state folder, 0700: memories, histories and token hashes are the users' alone."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def write_secret(path: Path, text: str) -> None:
    """Write a file created 0600 from the start (never readable by others, not even for an instant),
    then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class AccountStore:
    """The accounts of one state folder, in memory (by user and by token hash) and on disk:
    append-only lines, rewritten only to forget a user. Not locked: the service calls it under its
    state lock.

    Args:
        state: the service's state folder, holding `accounts.jsonl`.
        admin_token_hash: sha256 of the admin token.
    """

    def __init__(self, state: Path, admin_token_hash: str) -> None:
        self.path = state / ACCOUNTS
        self.admin_token_hash = admin_token_hash
        self.accounts: dict[str, Account] = {}
        self._by_hash: dict[str, str] = {}

    def load(self) -> None:
        """Read the store (an earlier version's accounts.json converted; a torn last line, a sign-up
        killed mid-append, dropped)."""
        legacy = self.path.with_name(LEGACY_ACCOUNTS)
        if legacy.is_file() and not self.path.is_file():
            for uid, a in json.loads(legacy.read_text()).items():
                self.accounts[uid] = Account(uid, a["token_sha256"], bool(a.get("share", True)),
                                             float(a.get("created_at", 0.0)))
            self.save()
            legacy.unlink()
        elif self.path.is_file():
            self._read_lines()
        self._by_hash = {a.token_sha256: uid for uid, a in self.accounts.items()}

    def _read_lines(self) -> None:
        lines = self.path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                a = json.loads(line)
            except ValueError:
                # a sign-up killed mid-append: never committed; drop the torn line
                if i == len(lines) - 1:
                    log.warning("%s: dropping a torn last line (a sign-up cut short)", self.path)
                    self.save()
                    return
                raise ValueError(
                    f"{self.path}: line {i + 1} is not JSON; the account store is damaged"
                ) from None
            self.accounts[a["user_id"]] = Account(a["user_id"], a["token_sha256"], bool(a.get("share", True)),
                                                  float(a.get("created_at", 0.0)))

    @staticmethod
    def _line(a: Account) -> str:
        return json.dumps({"user_id": a.user_id, "token_sha256": a.token_sha256, "share": a.share,
                           "created_at": a.created_at}, ensure_ascii=False) + "\n"

    def append(self, account: Account) -> None:
        """The commit point of a sign-up: one line appended (0600, fsynced); the file is never
        rewritten for it."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(self._line(account))
            f.flush()
            os.fsync(f.fileno())

    def save(self) -> None:
        """The whole store rewritten (atomic, 0600): only to forget a user, whose line must leave no
        byte."""
        write_secret(self.path, "".join(self._line(a) for a in self.accounts.values()))

    def add(self, account: Account) -> None:
        """An account committed on disk (append), now known in memory: its token works from here
        on."""
        self.accounts[account.user_id] = account
        self._by_hash[account.token_sha256] = account.user_id

    def revoke(self, user_id: str) -> None:
        """The user's token refused from now on (a deletion under way); the account is still on
        disk."""
        account = self.accounts.get(user_id)
        if account is not None:
            self._by_hash.pop(account.token_sha256, None)

    def forget(self, user_id: str) -> None:
        """The account gone, in memory and on disk (idempotent)."""
        self.revoke(user_id)
        self.accounts.pop(user_id, None)
        self.save()

    def authenticate(self, authorization: str | None) -> Caller:
        """`Authorization: Bearer <token>` → the caller; 401 without a valid token."""
        if not authorization or not authorization.startswith("Bearer ") or not authorization[7:].strip():
            raise ServiceError(401, "missing bearer token (header `Authorization: Bearer <token>`)")
        digest = hash_token(authorization[7:].strip())
        if hmac.compare_digest(digest, self.admin_token_hash):
            return Caller(None, admin=True)
        uid = self._by_hash.get(digest)
        if uid is None or uid not in self.accounts:
            raise ServiceError(401, "invalid or revoked token")
        return Caller(uid, token_sha256=digest)

    def holds(self, caller: Caller, user_id: str) -> bool:
        """Whether the caller's user token is still `user_id`'s (not revoked since it was
        authenticated)."""
        return caller.token_sha256 is not None and self._by_hash.get(caller.token_sha256) == user_id
