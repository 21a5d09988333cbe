"""The chat service's logic without HTTP: accounts and hashed tokens, sign-up, chat turns with memories and CFRAG
docs, privacy (`share: false`), deletion, and the state that survives a restart. `serving/app.py` puts FastAPI on
top of it; tests call both.

State lives in one folder (default `<run>/serve/`), every file written atomically:
- `memory/`: the LanceDB memory bank (memories, sessions); each write is one LanceDB version;
- `users/<hash>.npz`: a user added (or given a new history) online: their docs, the retriever's doc vectors and
  their user vectors, so a restart re-attaches them without re-encoding;
- `accounts.jsonl`: one line per account (user id, sha256 of their bearer token, share flag), mode 0600; a sign-up
  APPENDS its line LAST (the commit point), so a user the bank or `users/` holds without an account line is an
  unfinished sign-up and is removed at start (an exported user given a new history by the admin is kept); a
  deletion rewrites the file without the user's line (no byte of the id is left);
- `admin.token` (when generated): created 0600; the folder itself is made 0700;
- `purge.json`: only while a deletion is under way (serving/purge.py): the users being deleted; a deletion cut
  short is finished at the next start, before the run is loaded. A finished deletion leaves no trace of the user
  here or in the run: the export's files are rewritten without them and the memory bank's old versions removed.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import math
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from persrag_lightning.data.docstore import history_from_json
from persrag_lightning.data.records import User
from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.memory.bank import MemoryBank, MemorySettings, UserExistsError, check_text
from persrag_lightning.memory.extract import questionnaire_turns
from persrag_lightning.memory.store import InvalidIdError, validate_id
from persrag_lightning.retrieval.base import RetrievedDoc
from persrag_lightning.retrieval.memory import memory_doc
from persrag_lightning.serving import purge
from persrag_lightning.serving.pipeline import CFRAGPipeline
from persrag_lightning.serving.prompt import build_serving_prompt
from persrag_lightning.utils import atomic_replace

log = logging.getLogger(__name__)

MAX_HISTORY_DOCS = 200  # docs of one history (sign-up or replacement): more is a 413, encoded never
MAX_FIELD_NAME_CHARS = 64
MAX_DATE_CHARS = 64
MAX_MODEL_CHARS = 256
HISTORY_TURNS = 4  # earlier turns of the request's `messages` put in the prompt
MAX_MESSAGES = 1000  # turns of one request (OpenAI clients resend the conversation; the body's 1 MiB bounds it too)
ACCOUNTS = "accounts.jsonl"
LEGACY_ACCOUNTS = "accounts.json"  # written whole by earlier versions: turned into accounts.jsonl at start


class ServiceError(Exception):
    """A request the service refuses; `status` is the HTTP status (4xx), the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message: str) -> ServiceError:
    return ServiceError(400, message)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Account:
    user_id: str
    token_sha256: str
    share: bool = True
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: a user (by token) or the admin; a user's token hash is checked again when the
    request starts its work, so a token revoked in between (a deletion) is refused."""

    user_id: str | None
    admin: bool = False
    token_sha256: str | None = None


def addressable_id(value: object, what: str = "user_id") -> str:
    """A user id the URL paths can address: validate_id's rules, and no `/` (the router matches the decoded
    path, so `a/b` could never be listed or deleted) nor a bare `.` or `..` (clients fold dot segments)."""
    value = validate_id(value, what)
    if "/" in value or value in (".", ".."):
        raise InvalidIdError(f"{what} {value!r} cannot be addressed in a URL path (no '/', not '.' or '..')")
    return value


def private_dir(path: Path) -> Path:
    """The state folder, 0700: memories, histories and token hashes are the users' alone."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def write_secret(path: Path, text: str) -> None:
    """Write a file created 0600 from the start (never readable by others, not even for an instant), then rename
    it over `path`."""
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


class UserGate:
    """Requests in flight per user, and the users being deleted. A deletion refuses the user's new requests at once
    and waits for the ones in flight, so nothing it removes is written again after it; counts go with their user."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.active: dict[str, int] = {}
        self.deleting: set[str] = set()

    @contextmanager
    def request(self, user_id: str, check: Callable[[], None]) -> Iterator[None]:
        """One request acting on `user_id`; `check` (run under the gate's lock) raises when it may not start."""
        with self._cond:
            check()  # first: a user whose token the deletion revoked gets the 401 every later request gets
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
    def deletion(self, user_id: str, check: Callable[[], None], revoke: Callable[[], None]) -> Iterator[None]:
        """The deletion of `user_id`: `revoke` runs at once (new requests refused), then the requests in flight are
        waited for; one deletion of a user at a time."""
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


@dataclass
class ChatTurn:
    answer: str
    prompt: str
    docs: list[RetrievedDoc]
    memories: list[RetrievedDoc]
    stored_memory_id: str | None
    session_id: str


class ChatService:
    """Everything `persrag serve` does, thread-safe: model calls share one lock (torch modules and the LLM are not
    re-entrant), state files another, the memory bank locks per user."""

    def __init__(self, pipeline: CFRAGPipeline, bank: MemoryBank, state_dir: str | Path, admin_token_hash: str,
                 use_llm: bool = True, k: int = 5, max_message_chars: int = 8000,
                 model_lock: threading.Lock | None = None, run_dir: str | Path | None = None,
                 cache_dir: str | Path = ".cache/persrag") -> None:
        """`run_dir`: the exported run a deletion rewrites (None: the export is left alone, as in tests of the
        service logic over a run they share). `cache_dir` is resolved here, once: a deletion purges the cache
        the run was loaded with, whatever the working directory is by then."""
        self.pipeline, self.bank = pipeline, bank
        self.run_dir = Path(run_dir).resolve() if run_dir is not None else None
        self.cache_dir = Path(cache_dir).resolve()
        self.state = private_dir(Path(state_dir).resolve())
        private_dir(self.state / "users")
        self.admin_token_hash = admin_token_hash
        self.use_llm, self.k, self.max_message_chars = use_llm, k, max_message_chars
        self.exported_users = set(pipeline.store.corpus.user_ids)
        self._model_lock = model_lock or threading.Lock()
        self._state_lock = threading.RLock()
        self._gate = UserGate()
        self.accounts: dict[str, Account] = {}
        self._by_hash: dict[str, str] = {}
        self._load()

    @classmethod
    def open(cls, run_dir: str | Path, state_dir: str | Path | None = None, llm: LLMConfig | None = None,
             encoder: str = "minilm", admin_token: str | None = None, use_llm: bool = True,
             extraction: str = "llm", memory_settings: MemorySettings | None = None, cache_dir: str = ".cache/persrag",
             **pipeline_args: object) -> tuple[ChatService, str | None]:
        """Load the run's bundles, the bank and the state; returns the service and the admin token when one was
        generated now (it is written to `<state>/admin.token`, mode 0600, and kept only hashed in memory)."""
        run_dir = Path(run_dir).resolve()
        if not (run_dir / "docstore").is_dir():
            raise FileNotFoundError(f"{run_dir}: no exported run (docstore missing); train one first with "
                                    "`python train.py pipeline --preset quick`")
        cache_dir = str(Path(cache_dir).resolve())  # once: the deletion purges this cache, wherever it runs from
        state = private_dir(Path(state_dir).resolve() if state_dir else run_dir / "serve")
        llm = llm or LLMConfig(max_new_tokens=64)
        legacy = state / "deleted.json"  # deletions recorded (not done) by earlier versions: done now
        if legacy.is_file():
            purge.begin(state, json.loads(legacy.read_text()))
            legacy.unlink()
        purge.purge_export(run_dir, state, cache_dir)  # a deletion cut short: the export part, before loading it
        pipeline = CFRAGPipeline.from_pretrained(run_dir, llm=llm, cache_dir=cache_dir, **pipeline_args)
        if extraction not in ("llm", "verbatim"):
            raise ValueError(f"extraction must be llm or verbatim, got {extraction!r}")
        lock = threading.Lock()
        extractor = LockedLLM(pipeline, lock) if (use_llm and extraction == "llm") else None
        bank = MemoryBank.open(state / "memory", encoder, extractor, memory_settings)
        generated = None
        if admin_token is None:
            path = state / "admin.token"
            if path.is_file():
                admin_token = path.read_text().strip()
            else:
                admin_token = generated = secrets.token_urlsafe(32)
                write_secret(path, admin_token + "\n")
        return cls(pipeline, bank, state, hash_token(admin_token), use_llm=use_llm, model_lock=lock, run_dir=run_dir,
                   cache_dir=cache_dir), generated

    # ---- state ----------------------------------------------------------------------------------------------

    def _load(self) -> None:
        self._load_accounts()
        journal = purge.pending(self.state)
        if journal is not None:  # a deletion cut short: finish it (every step is idempotent)
            for uid in journal["users"]:
                self._forget(uid)
            if self.run_dir is not None:
                purge.purge_export(self.run_dir, self.state, self.cache_dir)
            purge.done(self.state)
        self._by_hash = {a.token_sha256: uid for uid, a in self.accounts.items()}
        for path in sorted((self.state / "users").glob("*.npz")):
            user, doc_vectors, user_vectors, cohort = self._read_user_file(path)
            uid = user.user_id
            exported = uid in self.pipeline.store
            if uid not in self.accounts and not exported:
                path.unlink()  # an unfinished sign-up (no account line)
                self.bank.purge_user(uid)
                continue
            share = self.accounts[uid].share if uid in self.accounts else self.pipeline.store.shares(uid)
            if exported:  # an exported user given a new history (by themselves or by the admin)
                self.pipeline.remove_user(uid)
            self.pipeline.attach_user(user, doc_vectors, user_vectors, cohort, share=share)
        for uid in sorted(self.bank.user_ids() - set(self.accounts)):  # a sign-up cut short before its line
            log.warning("removing the memories of an unfinished sign-up")
            self.bank.purge_user(uid)
        for uid, account in self.accounts.items():
            if not account.share and uid in self.pipeline.store:
                self.pipeline.store.set_share(uid, False)

    # ---- the account store: append-only lines, rewritten only to forget a user --------------------------------

    def _load_accounts(self) -> None:
        path, legacy = self.state / ACCOUNTS, self.state / LEGACY_ACCOUNTS
        if legacy.is_file() and not path.is_file():
            for uid, a in json.loads(legacy.read_text()).items():
                self.accounts[uid] = Account(uid, a["token_sha256"], bool(a.get("share", True)),
                                             float(a.get("created_at", 0.0)))
            self._save_accounts()
            legacy.unlink()
            return
        if not path.is_file():
            return
        lines = path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                a = json.loads(line)
            except ValueError:
                if i == len(lines) - 1:  # a sign-up killed mid-append: never committed; drop the torn line
                    log.warning("%s: dropping a torn last line (a sign-up cut short)", path)
                    self._save_accounts()
                    return
                raise ValueError(f"{path}: line {i + 1} is not JSON; the account store is damaged") from None
            self.accounts[a["user_id"]] = Account(a["user_id"], a["token_sha256"], bool(a.get("share", True)),
                                                  float(a.get("created_at", 0.0)))

    @staticmethod
    def _account_line(a: Account) -> str:
        return json.dumps({"user_id": a.user_id, "token_sha256": a.token_sha256, "share": a.share,
                           "created_at": a.created_at}, ensure_ascii=False) + "\n"

    def _append_account(self, account: Account) -> None:
        """The commit point of a sign-up: one line appended (0600, fsynced); the file is never rewritten for it."""
        fd = os.open(self.state / ACCOUNTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(self._account_line(account))
            f.flush()
            os.fsync(f.fileno())

    def _save_accounts(self) -> None:
        """The whole store rewritten (atomic, 0600): only to forget a user, whose line must leave no byte."""
        write_secret(self.state / ACCOUNTS, "".join(self._account_line(a) for a in self.accounts.values()))

    def _user_file(self, user_id: str) -> Path:
        return self.state / "users" / f"{hashlib.sha256(user_id.encode()).hexdigest()[:32]}.npz"

    def _write_user_file(self, user: User, history: list[dict], doc_vectors: torch.Tensor,
                         user_vectors: torch.Tensor, cohort: dict | None = None) -> None:
        """`cohort`: the cohort the user was assigned to (users="cluster"), kept so a restart reuses it."""
        buf = io.BytesIO()
        meta = json.dumps({"user_id": user.user_id, "docs": history, "cohort": cohort}, ensure_ascii=False)
        np.savez(buf, meta=np.array(meta), doc_vectors=doc_vectors.float().numpy(),
                 user_vectors=user_vectors.float().numpy())
        with atomic_replace(self._user_file(user.user_id)) as tmp, open(tmp, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _read_user_file(path: Path) -> tuple[User, torch.Tensor, torch.Tensor, dict | None]:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            return (User(meta["user_id"], history_from_json(meta["docs"])), torch.from_numpy(z["doc_vectors"]),
                    torch.from_numpy(z["user_vectors"]), meta.get("cohort"))

    # ---- auth -----------------------------------------------------------------------------------------------

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

    def authorize(self, caller: Caller, user_id: str, admin_ok: bool = True) -> None:
        """A token reads and writes only its own user; the admin token may act on anyone."""
        if caller.admin and admin_ok:
            if user_id not in self.accounts and user_id not in self.pipeline.store:
                raise ServiceError(404, f"unknown user {user_id!r}")
            return
        if caller.user_id != user_id:
            raise ServiceError(403, "this token belongs to another user")

    def _still_valid(self, caller: Caller, user_id: str) -> Callable[[], None]:
        """The check a request makes when it starts its work (under the gate): the token is still the user's
        (not revoked by a deletion since it was authenticated), or the admin's user still exists."""
        def check() -> None:
            if caller.admin:
                if user_id not in self.accounts and user_id not in self.pipeline.store:
                    raise ServiceError(404, f"unknown user {user_id!r}")
            elif caller.token_sha256 is None or self._by_hash.get(caller.token_sha256) != user_id:
                raise ServiceError(401, "invalid or revoked token")
        return check

    def _acting_on(self, caller: Caller, user_id: str):
        """The gate a request on `user_id` passes: refused while the user is deleted, waited for by a deletion."""
        return self._gate.request(user_id, self._still_valid(caller, user_id))

    # ---- sign-up and users ----------------------------------------------------------------------------------

    def sign_up(self, body: Mapping, caller: Caller | None) -> dict:
        """`{"user_id", "answers": {category: text}, "share": true, "history": [docs]}` → a new account and token.
        Claiming a user of the exported run (whose history is already there) needs the admin token. A sign-up
        that fails after its first write is undone before the error is answered."""
        user_id = self._user_id(body.get("user_id"))
        answers = body.get("answers", {})
        if not isinstance(answers, dict):
            raise bad_request("field `answers` must be an object of questionnaire category → text")
        share = body.get("share", True)
        if not isinstance(share, bool):
            raise bad_request("field `share` must be true or false")
        history = body.get("history")
        try:
            pairs = questionnaire_turns(answers)
            for category, text in answers.items():
                check_text(text, f"answer to {category!r}", self.max_message_chars)
        except (TypeError, ValueError) as e:
            raise bad_request(f"field `answers`: {e}") from None
        if not pairs and history is None:
            raise bad_request("field `answers` must answer at least one questionnaire category")
        if history is not None:
            self._check_history(history)

        def refuse_taken() -> bool:
            if user_id in self.accounts:
                raise ServiceError(409, f"user {user_id!r} already exists")
            if user_id in self._gate.deleting:
                raise ServiceError(409, f"user {user_id!r} is being deleted; sign up again when it is done")
            exported = user_id in self.pipeline.store
            if exported and not (caller and caller.admin):
                raise ServiceError(409, f"user {user_id!r} already exists (an exported user: claiming it needs "
                                        "the admin token)")
            if history is not None and exported:
                raise bad_request("field `history`: this user already has a history; replace it with "
                                  f"POST /v1/users/{user_id}/history")
            return exported

        with self._state_lock:
            refuse_taken()
        # the history is encoded outside the state lock (sign-ups and deletions of others go on meanwhile)
        encoded = self._encode_history(user_id, history) if history is not None else None
        with self._state_lock:
            refuse_taken()  # again: a concurrent sign-up of the same id may have won meanwhile
            try:
                self.bank.add_user(user_id, answers)
            except UserExistsError:
                raise ServiceError(409, f"user {user_id!r} already has memories") from None
            try:
                if encoded is not None:
                    cohort = self.pipeline.cohort_assignment(encoded[2])
                    self._write_user_file(encoded[0], history, encoded[1], encoded[2], cohort)
                    with self._model_lock:  # private before visible: one step under the lock retrieval takes
                        self.pipeline.attach_user(*encoded, cohort, share=share)
                token = secrets.token_urlsafe(32)
                account = Account(user_id, hash_token(token), share)
                self._append_account(account)  # the commit point of a sign-up
            except Exception:
                self._undo_sign_up(user_id, attached=encoded is not None)
                raise
            self.accounts[user_id] = account
            self._by_hash[account.token_sha256] = user_id
            if not share and user_id in self.pipeline.store:
                with self._model_lock:
                    self.pipeline.store.set_share(user_id, False)  # a claimed exported user
        return {"user_id": user_id, "access_token": token, "token_type": "bearer", "share": share,
                "memories": len(self.bank.list(user_id)), "history_docs": len(history or [])}

    def _undo_sign_up(self, user_id: str, attached: bool) -> None:
        """What a failed sign-up wrote: its memories, user file and docs (nothing else has seen the user)."""
        log.warning("a sign-up failed after its first write; undoing it")
        self.bank.purge_user(user_id)
        self._user_file(user_id).unlink(missing_ok=True)
        if attached:
            with self._model_lock:
                if user_id in self.pipeline.store:
                    self.pipeline.remove_user(user_id)

    def _user_id(self, value: object) -> str:
        try:
            return addressable_id(value)
        except InvalidIdError as e:
            raise bad_request(f"field `user_id`: {e}") from None

    def _check_history(self, history: object) -> None:
        """A history's shape and size, before anything is encoded or stored: 413 past MAX_HISTORY_DOCS."""
        if not isinstance(history, list) or not history:
            raise bad_request("field `history` must be a non-empty list of {id, date, fields} docs")
        if len(history) > MAX_HISTORY_DOCS:
            raise ServiceError(413, f"field `history` has {len(history)} docs, more than the limit of "
                                    f"{MAX_HISTORY_DOCS}")
        for i, d in enumerate(history):
            if not isinstance(d, dict) or not isinstance(d.get("fields"), dict) or "id" not in d or "date" not in d:
                raise bad_request(f"field `history[{i}]` must be an object with id, date and fields")
            try:
                doc_id = d["id"]
                validate_id(str(doc_id) if type(doc_id) is int else doc_id, f"history[{i}].id")
            except InvalidIdError as e:
                raise bad_request(f"field {e}") from None
            date = d["date"]
            if not isinstance(date, str) or not 0 < len(date) <= MAX_DATE_CHARS or not is_utf8(date):
                raise bad_request(f"field `history[{i}].date` must be a date text of 1 to {MAX_DATE_CHARS} "
                                  "characters")
            if not d["fields"]:
                raise bad_request(f"field `history[{i}].fields` must name at least one field")
            for key, value in d["fields"].items():
                if not 0 < len(key) <= MAX_FIELD_NAME_CHARS or not is_utf8(key):
                    raise bad_request(f"field `history[{i}].fields`: a field name must be 1 to "
                                      f"{MAX_FIELD_NAME_CHARS} characters of valid text")
                if not isinstance(value, str) or not value.strip():
                    raise bad_request(f"field `history[{i}].fields.{key}` must be non-empty text")
                try:
                    check_text(value, f"history[{i}].fields.{key}", self.max_message_chars)
                except ValueError as e:
                    raise bad_request(str(e)) from None

    def _encode_history(self, user_id: str, history: list, replace: bool = False):
        try:
            with self._model_lock:
                return self.pipeline.encode_user(user_id, history, replace=replace)
        except (KeyError, ValueError) as e:
            raise bad_request(f"field `history`: {e}") from None

    def set_history(self, caller: Caller, user_id: str, body: Mapping) -> dict:
        """Replace a user's history (docs, vectors, user index), persisted before it becomes visible; the user's
        own token, or the admin's (an exported user's replaced history is kept across restarts too)."""
        self.authorize(caller, user_id)
        history = body.get("history")
        self._check_history(history)
        with self._acting_on(caller, user_id):
            user, doc_vectors, user_vectors = self._encode_history(user_id, history, replace=True)
            with self._state_lock:
                cohort = self.pipeline.cohort_assignment(user_vectors)
                self._write_user_file(user, history, doc_vectors, user_vectors, cohort)
                with self._model_lock:
                    share = self.pipeline.store.shares(user_id)
                    if user_id in self.accounts:
                        share = self.accounts[user_id].share
                    if user_id in self.pipeline.store:
                        self.pipeline.remove_user(user_id)
                    self.pipeline.attach_user(user, doc_vectors, user_vectors, cohort, share=share)
        return {"user_id": user_id, "history_docs": len(user.docs)}

    def delete_user(self, caller: Caller, user_id: str) -> dict:
        """The user everywhere: memories and session turns (gone from LanceDB's files too), docs, vectors, user
        index or cohort, account and token, and — for a user of the exported run — the run's files (docstore,
        user tables and index, doc table, cohort export, corpus-embedding caches; serving/purge.py). Journaled:
        a crash at any step is finished at the next start. The token is revoked first; the user's requests in
        flight are waited for, so none of their writes lands after the purge.

        Not reached: answers other users received (and their session logs) that quoted this user's shared docs
        — theirs, not this user's (docs/serving/security.md)."""
        self.authorize(caller, user_id)

        def revoke() -> None:
            account = self.accounts.get(user_id)
            if account is not None:
                self._by_hash.pop(account.token_sha256, None)

        with self._gate.deletion(user_id, self._still_valid(caller, user_id), revoke), self._state_lock:
            purge.begin(self.state, [user_id])  # a crash from here on: finished at the next start
            memories, turns = self._forget(user_id)
            if self.run_dir is not None and user_id in self.exported_users:
                purge.purge_export(self.run_dir, self.state, self.cache_dir)
                self.exported_users.discard(user_id)
            purge.done(self.state)
        return {"user_id": user_id, "deleted": True, "memories": memories, "turns": turns}

    def _forget(self, user_id: str) -> tuple[int, int]:
        """What the service itself keeps of a user, idempotent: bank rows (purged), their user file, the
        in-memory pipeline, the account and token."""
        memories, turns = self.bank.purge_user(user_id)
        self._user_file(user_id).unlink(missing_ok=True)
        with self._model_lock:
            if user_id in self.pipeline.store:
                self.pipeline.remove_user(user_id)
        account = self.accounts.pop(user_id, None)
        if account is not None:
            self._by_hash.pop(account.token_sha256, None)
        self._save_accounts()
        return memories, turns

    def memories(self, caller: Caller, user_id: str) -> list[dict]:
        self.authorize(caller, user_id)
        with self._acting_on(caller, user_id):
            return [{"id": m.id, "text": m.text,
                     "tags": {d: list(getattr(m.tags, d)) for d in
                              ("topics", "entities", "query_type", "intent", "preferences")},
                     "usage_count": m.usage_count, "created_at": m.created_at, "last_used_at": m.last_used_at,
                     "source": m.source} for m in self.bank.list(user_id)]

    def delete_memory(self, caller: Caller, user_id: str, memory_id: str) -> None:
        self.authorize(caller, user_id)
        try:
            validate_id(memory_id, "memory id")
        except InvalidIdError as e:
            raise bad_request(str(e)) from None
        with self._acting_on(caller, user_id):
            if not self.bank.delete_memory(user_id, memory_id):
                raise ServiceError(404, f"user {user_id!r} has no memory {memory_id!r}")

    # ---- chat -----------------------------------------------------------------------------------------------

    def check_messages(self, messages: object) -> str:
        """Every message's shape, size and text (earlier turns enter the prompt too); returns the last one."""
        if not isinstance(messages, list) or not messages:
            raise bad_request("field `messages` must be a non-empty list of {role, content}")
        if len(messages) > MAX_MESSAGES:
            raise bad_request(f"field `messages` has {len(messages)} turns, more than the limit of {MAX_MESSAGES}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise bad_request(f"field `messages[{i}]` must be {{role: system|user|assistant, content: text}}")
            if len(m["content"]) > self.max_message_chars:
                raise bad_request(f"field `messages[{i}].content` has {len(m['content'])} characters, more than "
                                  f"the limit of {self.max_message_chars}")
            if not is_utf8(m["content"]):
                raise bad_request(f"field `messages[{i}].content` is not valid UTF-8 text (a lone surrogate)")
        if messages[-1]["role"] != "user":
            raise bad_request("the last of `messages` must be the user's")
        try:
            return check_text(messages[-1]["content"], "messages[-1].content", self.max_message_chars)
        except ValueError as e:
            raise bad_request(str(e)) from None

    def chat(self, caller: Caller, body: Mapping) -> ChatTurn:
        """One turn: CFRAG docs of the caller (privacy-checked before anything is generated or stored), remember +
        recall (one extraction), prompt with every retrieved text marked as data, answer, log it."""
        if caller.user_id is None:
            raise ServiceError(403, "chat needs a user's token (the admin token has no user)")
        user_id = caller.user_id
        messages = body.get("messages")
        message = self.check_messages(messages)
        session_id = body.get("session_id", "default")
        try:
            validate_id(session_id, "session_id")
        except InvalidIdError as e:
            raise bad_request(f"field `session_id`: {e}") from None
        history = [(m["role"], m["content"]) for m in messages[:-1] if m["role"] != "system"][-HISTORY_TURNS:]
        with self._acting_on(caller, user_id):
            with self._model_lock:
                docs = self.pipeline.retrieve(user_id, message, self.k) if user_id in self.pipeline.store else []
                docs = self._shareable(user_id, docs)  # the privacy guard, before anything is generated or stored
            turn = self.bank.remember_and_recall(user_id, message, session_id)
            memories = [memory_doc(r) for r in turn.recalled]
            foreign = [m for m in memories if m.owner != user_id]
            if foreign:  # recall filters on the user: this would be a bug of the bank
                log.error("privacy guard: %d memories of other users dropped", len(foreign))
                memories = [m for m in memories if m.owner == user_id]
            with self._model_lock:
                if self.use_llm:
                    llm = self.pipeline.llm
                    prompt = build_serving_prompt(message, [m.text for m in memories], [d.text for d in docs],
                                                  history, llm.count_tokens, self.pipeline.llm_config.max_prompt_tokens)
                    answer = self.pipeline.llm_config.chat(llm, [prompt])[0]
                else:
                    prompt = build_serving_prompt(message, [m.text for m in memories], [d.text for d in docs],
                                                  history, lambda t: len(t.split()), 512)
                    answer = (f"(no LLM) I remember {len(memories)} thing(s) about you and found {len(docs)} "
                              "related item(s).")
            if answer.strip() and is_utf8(answer):
                self.bank.log_turn(user_id, session_id, "assistant", answer[: self.max_message_chars])
        return ChatTurn(answer, prompt, docs, memories, turn.memory.id if turn.memory else None, session_id)

    def _shareable(self, user_id: str, docs: list[RetrievedDoc]) -> list[RetrievedDoc]:
        """The caller's own docs and those of users who share and are still there; anything else is dropped (and
        logged: the retrieval's own filter should never let it through)."""
        store = self.pipeline.store
        kept = [d for d in docs if d.owner == user_id or (d.owner in store and store.shares(d.owner))]
        if len(kept) != len(docs):
            log.error("privacy guard: %d docs of users who do not share dropped before the prompt",
                      len(docs) - len(kept))
        return kept

    def completion(self, turn: ChatTurn, model: str, user_id: str) -> dict:
        """The OpenAI chat.completion object, plus `provenance`."""
        own = [d for d in turn.docs if d.owner == user_id]
        others = [d for d in turn.docs if d.owner != user_id]
        prompt_tokens = len(turn.prompt.split())
        completion_tokens = len(turn.answer.split())
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": turn.answer},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "session_id": turn.session_id,
            "provenance": {
                "own_docs": [_doc(d) for d in own],
                "other_users_docs": [{**_doc(d), "owner": d.owner, "user_similarity": d.user_sim} for d in others],
                "memories_used": [{"id": m.doc_id, "text": m.text, "score": m.retriever_score} for m in turn.memories],
                "memory_stored": turn.stored_memory_id,
            },
        }

    def health(self) -> dict:
        return {"status": "ok", "users": self.pipeline.store.corpus.num_users, "accounts": len(self.accounts),
                "llm": self.use_llm}


def _doc(d: RetrievedDoc) -> dict:
    return {"doc_id": d.doc_id, "text": d.text, "retriever_score": _num(d.retriever_score),
            "reranker_score": _num(d.reranker_score)}


def is_utf8(text: str) -> bool:
    """False for text no file or response can hold (a lone surrogate, as JSON's "\\ud800" decodes to)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)  # NaN (a stage not run) → null in JSON


class LockedLLM(LLM):
    """The pipeline's LLM (loaded on first use) behind the service's model lock, for the memory extraction that
    runs outside the chat's locked section: one model, one caller at a time."""

    def __init__(self, pipeline: CFRAGPipeline, lock: threading.Lock) -> None:
        super().__init__(batch_size=pipeline.llm_config.batch_size)
        self.pipeline, self.lock = pipeline, lock
        self.backend = pipeline.llm_config.backend

    @property
    def name(self) -> str:
        return self.pipeline.llm_config.model

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        with self.lock:
            return self.pipeline.llm.generate(prompts, max_new_tokens)

    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        with self.lock:
            return self.pipeline.llm.score(prompts, targets)

    def count_tokens(self, text: str) -> int:
        with self.lock:
            return self.pipeline.llm.count_tokens(text)
