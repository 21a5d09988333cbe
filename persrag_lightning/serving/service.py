"""The chat service's logic without HTTP: accounts and hashed tokens, sign-up, chat turns with memories and CFRAG
docs, privacy (`share: false`), deletion, and the state that survives a restart. `serving/app.py` puts FastAPI on
top of it; tests call both.

State lives in one folder (default `<run>/serve/`), every file written atomically:
- `memory/`: the LanceDB memory bank (memories, sessions); each write is one LanceDB version;
- `users/<hash>.npz`: a user added (or given a new history) online: their docs, the retriever's doc vectors and
  their user vectors, so a restart re-attaches them without re-encoding;
- `accounts.json`: user id → sha256 of their bearer token, share flag; written LAST at sign-up, so a user without
  an account line is an unfinished sign-up and is removed at start;
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from persrag_lightning.data.docstore import history_from_json
from persrag_lightning.data.records import User
from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.prompts import build_chat_prompt
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.memory.bank import MemoryBank, MemorySettings, UserExistsError, check_text
from persrag_lightning.memory.extract import questionnaire_turns
from persrag_lightning.memory.store import InvalidIdError, validate_id
from persrag_lightning.retrieval.base import RetrievedDoc
from persrag_lightning.retrieval.memory import memory_doc
from persrag_lightning.serving import purge
from persrag_lightning.serving.pipeline import CFRAGPipeline
from persrag_lightning.utils import atomic_replace, atomic_write_json

log = logging.getLogger(__name__)

MAX_HISTORY_DOCS = 1000
HISTORY_TURNS = 4  # earlier turns of the request's `messages` put in the prompt


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
    """Who a request comes from: a user (by token) or the admin."""

    user_id: str | None
    admin: bool = False


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
        service logic over a run they share)."""
        self.pipeline, self.bank = pipeline, bank
        self.run_dir, self.cache_dir = (Path(run_dir) if run_dir is not None else None), Path(cache_dir)
        self.state = Path(state_dir)
        (self.state / "users").mkdir(parents=True, exist_ok=True)
        self.admin_token_hash = admin_token_hash
        self.use_llm, self.k, self.max_message_chars = use_llm, k, max_message_chars
        self.exported_users = set(pipeline.store.corpus.user_ids)
        self._model_lock = model_lock or threading.Lock()
        self._state_lock = threading.RLock()
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
        run_dir = Path(run_dir)
        if not (run_dir / "docstore").is_dir():
            raise FileNotFoundError(f"{run_dir}: no exported run (docstore missing); train one first with "
                                    "`python train.py pipeline --preset quick`")
        state = Path(state_dir) if state_dir else run_dir / "serve"
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
                state.mkdir(parents=True, exist_ok=True)
                with atomic_replace(path) as tmp:
                    tmp.write_text(admin_token + "\n")
                    os.chmod(tmp, 0o600)
                os.chmod(path, 0o600)
        return cls(pipeline, bank, state, hash_token(admin_token), use_llm=use_llm, model_lock=lock, run_dir=run_dir,
                   cache_dir=cache_dir), generated

    # ---- state ----------------------------------------------------------------------------------------------

    def _load(self) -> None:
        if (self.state / "accounts.json").is_file():
            for uid, a in json.loads((self.state / "accounts.json").read_text()).items():
                self.accounts[uid] = Account(uid, a["token_sha256"], bool(a.get("share", True)),
                                             float(a.get("created_at", 0.0)))
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
            if user.user_id not in self.accounts:
                path.unlink()  # an unfinished sign-up (no account line)
                self.bank.purge_user(user.user_id)
                continue
            if user.user_id in self.pipeline.store:  # an exported user given a new history
                self.pipeline.remove_user(user.user_id)
            self.pipeline.attach_user(user, doc_vectors, user_vectors, cohort)
        for uid, account in self.accounts.items():
            if not account.share and uid in self.pipeline.store:
                self.pipeline.store.set_share(uid, False)

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

    def _save_accounts(self) -> None:
        atomic_write_json(self.state / "accounts.json", {
            uid: {"token_sha256": a.token_sha256, "share": a.share, "created_at": a.created_at}
            for uid, a in self.accounts.items()})

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
        return Caller(uid)

    def authorize(self, caller: Caller, user_id: str, admin_ok: bool = True) -> None:
        """A token reads and writes only its own user; the admin token may act on anyone."""
        if caller.admin and admin_ok:
            if user_id not in self.accounts and user_id not in self.pipeline.store:
                raise ServiceError(404, f"unknown user {user_id!r}")
            return
        if caller.user_id != user_id:
            raise ServiceError(403, "this token belongs to another user")

    # ---- sign-up and users ----------------------------------------------------------------------------------

    def sign_up(self, body: Mapping, caller: Caller | None) -> dict:
        """`{"user_id", "answers": {category: text}, "share": true, "history": [docs]}` → a new account and token.
        Claiming a user of the exported run (whose history is already there) needs the admin token."""
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
        with self._state_lock:
            if user_id in self.accounts:
                raise ServiceError(409, f"user {user_id!r} already exists")
            exported = user_id in self.pipeline.store
            if exported and not (caller and caller.admin):
                raise ServiceError(409, f"user {user_id!r} already exists (an exported user: claiming it needs "
                                        "the admin token)")
            if history is not None and exported:
                raise bad_request("field `history`: this user already has a history; replace it with "
                                  f"POST /v1/users/{user_id}/history")
            encoded = self._encode_history(user_id, history) if history is not None else None
            try:
                self.bank.add_user(user_id, answers)
            except UserExistsError:
                raise ServiceError(409, f"user {user_id!r} already has memories") from None
            if encoded is not None:
                cohort = self.pipeline.cohort_assignment(encoded[2])
                self._write_user_file(encoded[0], history, encoded[1], encoded[2], cohort)
                with self._model_lock:
                    self.pipeline.attach_user(*encoded, cohort)
            token = secrets.token_urlsafe(32)
            self.accounts[user_id] = Account(user_id, hash_token(token), share)
            self._save_accounts()  # the commit point of a sign-up
            self._by_hash[self.accounts[user_id].token_sha256] = user_id
            if not share and user_id in self.pipeline.store:
                self.pipeline.store.set_share(user_id, False)
        return {"user_id": user_id, "access_token": token, "token_type": "bearer", "share": share,
                "memories": len(self.bank.list(user_id)), "history_docs": len(history or [])}

    def _user_id(self, value: object) -> str:
        try:
            return validate_id(value)
        except InvalidIdError as e:
            raise bad_request(f"field `user_id`: {e}") from None

    def _encode_history(self, user_id: str, history: object, replace: bool = False):
        if not isinstance(history, list) or not history:
            raise bad_request("field `history` must be a non-empty list of {id, date, fields} docs")
        if len(history) > MAX_HISTORY_DOCS:
            raise bad_request(f"field `history` has {len(history)} docs, more than {MAX_HISTORY_DOCS}")
        for i, d in enumerate(history):
            if not isinstance(d, dict) or not isinstance(d.get("fields"), dict) or "id" not in d or "date" not in d:
                raise bad_request(f"field `history[{i}]` must be an object with id, date and fields")
            for key, value in d["fields"].items():
                if not isinstance(value, str) or not value.strip():
                    raise bad_request(f"field `history[{i}].fields.{key}` must be non-empty text")
                try:
                    check_text(value, f"history[{i}].fields.{key}", self.max_message_chars)
                except ValueError as e:
                    raise bad_request(str(e)) from None
        try:
            with self._model_lock:
                return self.pipeline.encode_user(user_id, history, replace=replace)
        except (KeyError, ValueError) as e:
            raise bad_request(f"field `history`: {e}") from None

    def set_history(self, caller: Caller, user_id: str, body: Mapping) -> dict:
        """Replace a user's history (docs, vectors, user index), persisted before it becomes visible."""
        self.authorize(caller, user_id)
        history = body.get("history")
        with self._state_lock:
            user, doc_vectors, user_vectors = self._encode_history(user_id, history, replace=True)
            cohort = self.pipeline.cohort_assignment(user_vectors)
            self._write_user_file(user, history, doc_vectors, user_vectors, cohort)
            with self._model_lock:
                if user_id in self.pipeline.store:
                    self.pipeline.remove_user(user_id)
                self.pipeline.attach_user(user, doc_vectors, user_vectors, cohort)
                if user_id in self.accounts and not self.accounts[user_id].share:
                    self.pipeline.store.set_share(user_id, False)
        return {"user_id": user_id, "history_docs": len(user.docs)}

    def delete_user(self, caller: Caller, user_id: str) -> dict:
        """The user everywhere: memories and session turns (gone from LanceDB's files too), docs, vectors, user
        index or cohort, account and token, and — for a user of the exported run — the run's files (docstore,
        user tables and index, doc table, cohort export, corpus-embedding caches; serving/purge.py). Journaled:
        a crash at any step is finished at the next start."""
        self.authorize(caller, user_id)
        with self._state_lock:
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
        return [{"id": m.id, "text": m.text, "tags": {d: list(getattr(m.tags, d)) for d in
                                                      ("topics", "entities", "query_type", "intent", "preferences")},
                 "usage_count": m.usage_count, "created_at": m.created_at, "last_used_at": m.last_used_at,
                 "source": m.source} for m in self.bank.list(user_id)]

    def delete_memory(self, caller: Caller, user_id: str, memory_id: str) -> None:
        self.authorize(caller, user_id)
        try:
            validate_id(memory_id, "memory id")
        except InvalidIdError as e:
            raise bad_request(str(e)) from None
        if not self.bank.delete_memory(user_id, memory_id):
            raise ServiceError(404, f"user {user_id!r} has no memory {memory_id!r}")

    # ---- chat -----------------------------------------------------------------------------------------------

    def chat(self, caller: Caller, body: Mapping) -> ChatTurn:
        """One turn: remember + recall (one extraction), CFRAG docs of the caller, prompt, answer, log it."""
        if caller.user_id is None:
            raise ServiceError(403, "chat needs a user's token (the admin token has no user)")
        user_id = caller.user_id
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("field `messages` must be a non-empty list of {role, content}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise bad_request(f"field `messages[{i}]` must be {{role: system|user|assistant, content: text}}")
        if messages[-1]["role"] != "user":
            raise bad_request("the last of `messages` must be the user's")
        message = messages[-1]["content"]
        try:
            check_text(message, "messages[-1].content", self.max_message_chars)
        except ValueError as e:
            raise bad_request(str(e)) from None
        session_id = body.get("session_id", "default")
        try:
            validate_id(session_id, "session_id")
        except InvalidIdError as e:
            raise bad_request(f"field `session_id`: {e}") from None
        turn = self.bank.remember_and_recall(user_id, message, session_id)
        memories = [memory_doc(r) for r in turn.recalled]
        history = [(m["role"], m["content"]) for m in messages[:-1] if m["role"] != "system"][-HISTORY_TURNS:]
        with self._model_lock:
            docs = self.pipeline.retrieve(user_id, message, self.k) if user_id in self.pipeline.store else []
            if self.use_llm:
                llm = self.pipeline.llm
                prompt = build_chat_prompt(message, [m.text for m in memories], [d.text for d in docs], history,
                                           llm.count_tokens, self.pipeline.llm_config.max_prompt_tokens)
                answer = self.pipeline.llm_config.chat(llm, [prompt])[0]
            else:
                prompt = build_chat_prompt(message, [m.text for m in memories], [d.text for d in docs], history,
                                           lambda t: len(t.split()), 512)
                answer = (f"(no LLM) I remember {len(memories)} thing(s) about you and found {len(docs)} "
                          "related item(s).")
        if docs or memories:  # provenance guard: nothing of another user who does not share
            leaked = [d for d in docs if d.owner != user_id and not self.pipeline.store.shares(d.owner)]
            leaked += [m for m in memories if m.owner != user_id]
            if leaked:
                raise RuntimeError(f"privacy guard: {len(leaked)} items of other users would enter the prompt")
        if answer.strip():
            self.bank.log_turn(user_id, session_id, "assistant", answer[: self.max_message_chars])
        return ChatTurn(answer, prompt, docs, memories, turn.memory.id if turn.memory else None, session_id)

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
