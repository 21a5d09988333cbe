"""The chat service's logic without HTTP: sign-up, chat turns with memories and CFRAG docs, privacy
(`share: false`), deletion, and the state that survives a restart. `serving/app.py` puts FastAPI on
top of it; tests call both. Its neighbours: `accounts.py` (accounts and tokens), `requests.py` (the
bodies, one pydantic model each) and `validation.py` (their refusals), `gate.py` (the per-user
gate), `user_files.py`, `purge.py`, `batcher.py` (concurrent chats' retrievals batched into one
call), `answering.py` (the prompt and the LLM's reply, concurrent replies batched into one call),
`completion.py` (the answer's shape) and `locked_llm.py`.

State lives in one folder (default `<run>/serve/`), every file written atomically:
- `memory/`: the LanceDB memory bank (memories, sessions); each write is one LanceDB version;
- `users/<hash>.npz`: a user added (or given a new history) online: their docs, the retriever's doc
  vectors and their user vectors, so a restart re-attaches them without re-encoding;
- `accounts.jsonl`: one line per account (user id, sha256 of their bearer token, share flag), mode
  0600; a sign-up APPENDS its line LAST (the commit point), so a user the bank or `users/` holds
  without an account line is an unfinished sign-up and is removed at start (an exported user given a
  new history by the admin is kept); a deletion rewrites the file without the user's line (no byte
  of the id is left);
- `admin.token` (when generated): created 0600; the folder itself is made 0700;
- `purge.json`: only while a deletion is under way (serving/purge.py): the users being deleted; a
  deletion cut short is finished at the next start, before the run is loaded. A finished deletion
  leaves no trace of the user here or in the run: the export's files are rewritten without them and
  the memory bank's old versions removed.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.memory.bank import MemoryBank, MemorySettings, UserExistsError
from persrag_lightning.memory.recall import Encoder
from persrag_lightning.memory.store import InvalidIdError, validate_id
from persrag_lightning.retrieval.base import RetrievedDoc
from persrag_lightning.retrieval.memory import memory_doc
from persrag_lightning.serving import purge
from persrag_lightning.serving.accounts import (
    Account,
    AccountStore,
    Caller,
    hash_token,
    private_dir,
    write_secret,
)
from persrag_lightning.serving.answer_batch import answer_batch
from persrag_lightning.serving.answering import ChatAnswerer
from persrag_lightning.serving.batcher import ANSWER_BATCHING, Batching, MicroBatcher
from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline
from persrag_lightning.serving.completion import ChatTurn, chat_completion
from persrag_lightning.serving.gate import UserGate
from persrag_lightning.serving.locked_llm import LockedLLM
from persrag_lightning.serving.model_lock import ModelLock
from persrag_lightning.serving.requests import MAX_MESSAGE_CHARS, Chat, History, SignUp
from persrag_lightning.serving.user_files import read_user_file, user_file, write_user_file
from persrag_lightning.serving.validation import ServiceError, bad_request, is_utf8, parse

__all__ = ["ChatService", "ChatTurn", "LockedLLM"]

log = logging.getLogger(__name__)

HISTORY_TURNS = 4  # earlier turns of the request's `messages` put in the prompt


class ChatService:
    """Everything `persrag serve` does, thread-safe: model calls share one lock (torch modules and
    the LLM are not re-entrant), state files another, the memory bank locks per user.

    Args:
        pipeline: CFRAG over the exported run.
        bank: the memory bank.
        state_dir: the state folder (made 0700).
        admin_token_hash: sha256 of the admin token.
        use_llm: answer with the pipeline's LLM (False: a canned line, retrieval and memories only).
        k: docs per prompt (None: the pipeline's `k`, which `persrag serve --k` sets).
        model_lock: the lock every model call takes (shared with the memory extraction's LLM).
        run_dir: the exported run a deletion rewrites (None: the export is left alone, as in tests
            of the service logic over a run they share).
        cache_dir: the cache the run was loaded with, resolved here once: a deletion purges it,
            whatever the working directory is by then.
        batching: how concurrent chats' retrievals are batched (default Batching(); max_batch 1:
            each alone).
        generation: how concurrent chats' LLM replies are batched (default batcher.REPLY_BATCHING).
        answering: how concurrent label questions (POST /v1/answers) are batched, retrieval and
            reading (default batcher.ANSWER_BATCHING).
    """

    def __init__(self, pipeline: CFRAGPipeline, bank: MemoryBank, state_dir: str | Path, admin_token_hash: str,
                 use_llm: bool = True, k: int | None = None, model_lock: ModelLock | None = None,
                 run_dir: str | Path | None = None, cache_dir: str | Path = ".cache/persrag",
                 batching: Batching | None = None, generation: Batching | None = None,
                 answering: Batching | None = None) -> None:
        self.pipeline, self.bank = pipeline, bank
        self.run_dir = Path(run_dir).resolve() if run_dir is not None else None
        self.cache_dir = Path(cache_dir).resolve()
        self.state = private_dir(Path(state_dir).resolve())
        private_dir(self.state / "users")
        self.admin_token_hash = admin_token_hash
        self.use_llm, self.k = use_llm, k
        self.exported_users = set(pipeline.store.corpus.user_ids)
        self._model_lock = model_lock or ModelLock()
        self._state_lock = threading.RLock()
        self._gate = UserGate()
        self.account_store = AccountStore(self.state, admin_token_hash)
        # the chats that arrive together: one retrieval call (serving/batcher.py)
        self.retrieval = MicroBatcher(self._retrieve_many, batching, name="persrag-retrieval")
        # the label questions asked together: one retrieval and one reading call (serving/answer_batch.py)
        self.answering = MicroBatcher(partial(answer_batch, pipeline, self._model_lock, self.guarded_docs),
                                      answering or ANSWER_BATCHING, name="persrag-answers")
        # and their replies: one generation call (serving/answering.py)
        self.answerer = ChatAnswerer(pipeline, use_llm, self._model_lock, generation)
        self._load()

    @property
    def accounts(self) -> dict[str, Account]:
        return self.account_store.accounts

    @classmethod
    def open(cls, run_dir: str | Path, state_dir: str | Path | None = None, llm: LLMConfig | None = None,
             encoder: str | Encoder = "minilm", admin_token: str | None = None, use_llm: bool = True,
             extraction: str = "llm", memory_settings: MemorySettings | None = None, cache_dir: str = ".cache/persrag",
             batching: Batching | None = None, generation: Batching | None = None,
             answering: Batching | None = None, **pipeline_args: object) -> tuple[ChatService, str | None]:
        """Load the run's bundles, the bank and the state; returns the service and the admin token
        when one was generated now (it is written to `<state>/admin.token`, mode 0600, and kept only
        hashed in memory)."""
        run_dir = Path(run_dir).resolve()
        if not (run_dir / "docstore").is_dir():
            raise FileNotFoundError(f"{run_dir}: no exported run (docstore missing); train one first with "
                                    "`python train.py pipeline --preset quick`")
        # once: the deletion purges this cache, wherever it runs from
        cache_dir = str(Path(cache_dir).resolve())
        state = private_dir(Path(state_dir).resolve() if state_dir else run_dir / "serve")
        llm = llm or LLMConfig(max_new_tokens=64)
        # deletions recorded (not done) by earlier versions: done now
        legacy = state / "deleted.json"
        if legacy.is_file():
            purge.begin(state, json.loads(legacy.read_text()))
            legacy.unlink()
        # a deletion cut short: the export part, before loading it
        purge.purge_export(run_dir, state, cache_dir)
        pipeline = CFRAGPipeline.from_pretrained(run_dir, llm=llm, cache_dir=cache_dir, **pipeline_args)
        if extraction not in ("llm", "verbatim"):
            raise ValueError(f"extraction must be llm or verbatim, got {extraction!r}")
        lock = ModelLock()  # knows who waits: continuous batching lets chats retrieve between two tokens
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
                   cache_dir=cache_dir, batching=batching, generation=generation, answering=answering), generated

    # ---- state -----------------------------------------------------------------------------------

    def _load(self) -> None:
        self.account_store.load()
        journal = purge.pending(self.state)
        if journal is not None:  # a deletion cut short: finish it (every step is idempotent)
            for uid in journal["users"]:
                self._forget(uid)
            if self.run_dir is not None:
                purge.purge_export(self.run_dir, self.state, self.cache_dir)
            purge.done(self.state)
        for path in sorted((self.state / "users").glob("*.npz")):
            user, doc_vectors, user_vectors, cohort = read_user_file(path)
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
        # a sign-up cut short before its line
        for uid in sorted(self.bank.user_ids() - set(self.accounts)):
            log.warning("removing the memories of an unfinished sign-up")
            self.bank.purge_user(uid)
        for uid, account in self.accounts.items():
            if not account.share and uid in self.pipeline.store:
                self.pipeline.store.set_share(uid, False)

    def _append_account(self, account: Account) -> None:
        """The commit point of a sign-up (a method of the service, so a test can cut a sign-up short
        right there)."""
        self.account_store.append(account)

    # ---- auth ------------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Caller:
        """`Authorization: Bearer <token>` → the caller; 401 without a valid token."""
        return self.account_store.authenticate(authorization)

    def authorize(self, caller: Caller, user_id: str, admin_ok: bool = True) -> None:
        """A token reads and writes only its own user; the admin token may act on anyone."""
        if caller.admin and admin_ok:
            if user_id not in self.accounts and user_id not in self.pipeline.store:
                raise ServiceError(404, f"unknown user {user_id!r}")
            return
        if caller.user_id != user_id:
            raise ServiceError(403, "this token belongs to another user")

    def _still_valid(self, caller: Caller, user_id: str) -> Callable[[], None]:
        """The check a request makes when it starts its work (under the gate): the token is still
        the user's (not revoked by a deletion since it was authenticated), or the admin's user still
        exists."""
        def check() -> None:
            if caller.admin:
                if user_id not in self.accounts and user_id not in self.pipeline.store:
                    raise ServiceError(404, f"unknown user {user_id!r}")
            elif not self.account_store.holds(caller, user_id):
                raise ServiceError(401, "invalid or revoked token")
        return check

    def _acting_on(self, caller: Caller, user_id: str) -> AbstractContextManager[None]:
        """The gate a request on `user_id` passes: refused while the user is deleted, waited for by
        a deletion."""
        return self._gate.request(user_id, self._still_valid(caller, user_id))

    # ---- sign-up and users -----------------------------------------------------------------------

    def sign_up(self, body: Mapping | SignUp, caller: Caller | None) -> dict:
        """A new account and token (the body: requests.SignUp). Claiming a user of the exported run
        (whose history is already there) needs the admin token. A sign-up that fails after its first
        write is undone before the error is answered."""
        request = parse(SignUp, body)
        user_id, share, history = request.user_id, request.share, request.docs()
        admin = caller is not None and caller.admin
        with self._state_lock:
            self._refuse_taken(user_id, admin, history is not None)
        # the history is encoded outside the state lock (sign-ups and deletions of others go on
        # meanwhile)
        encoded = self._encode_history(user_id, history) if history is not None else None
        with self._state_lock:
            # a concurrent sign-up may have won meanwhile
            self._refuse_taken(user_id, admin, history is not None)
            try:
                self.bank.add_user(user_id, request.answer_texts())
            except UserExistsError:
                raise ServiceError(409, f"user {user_id!r} already has memories") from None
            try:
                if encoded is not None:
                    cohort = self.pipeline.cohort_assignment(encoded[2])
                    write_user_file(self.state, encoded[0], history, encoded[1], encoded[2], cohort)
                    # private before visible: one step under the lock retrieval takes
                    with self._model_lock:
                        self.pipeline.attach_user(*encoded, cohort, share=share)
                token = secrets.token_urlsafe(32)
                account = Account(user_id, hash_token(token), share)
                self._append_account(account)  # the commit point of a sign-up
            except Exception:
                self._undo_sign_up(user_id, attached=encoded is not None)
                raise
            self.account_store.add(account)
            if not share and user_id in self.pipeline.store:
                with self._model_lock:
                    self.pipeline.store.set_share(user_id, False)  # a claimed exported user
        return {"user_id": user_id, "access_token": token, "token_type": "bearer", "share": share,
                "memories": len(self.bank.list(user_id)), "history_docs": len(history or [])}

    def _refuse_taken(self, user_id: str, admin: bool, with_history: bool) -> None:
        """A sign-up's id must be free: no account, no deletion under way, and an exported user only
        claimed by the admin, without a new history."""
        if user_id in self.accounts:
            raise ServiceError(409, f"user {user_id!r} already exists")
        if user_id in self._gate.deleting:
            raise ServiceError(409, f"user {user_id!r} is being deleted; sign up again when it is done")
        exported = user_id in self.pipeline.store
        if exported and not admin:
            raise ServiceError(409, f"user {user_id!r} already exists (an exported user: claiming it needs "
                                    "the admin token)")
        if with_history and exported:
            raise bad_request("field `history`: this user already has a history; replace it with "
                              f"POST /v1/users/{user_id}/history")

    def _undo_sign_up(self, user_id: str, attached: bool) -> None:
        """What a failed sign-up wrote: its memories, user file and docs (nothing else has seen the
        user)."""
        log.warning("a sign-up failed after its first write; undoing it")
        self.bank.purge_user(user_id)
        user_file(self.state, user_id).unlink(missing_ok=True)
        if attached:
            with self._model_lock:
                if user_id in self.pipeline.store:
                    self.pipeline.remove_user(user_id)

    def _encode_history(self, user_id: str, history: list[dict], replace: bool = False):
        try:
            with self._model_lock:
                return self.pipeline.encode_user(user_id, history, replace=replace)
        except (KeyError, ValueError) as e:
            raise bad_request(f"field `history`: {e}") from None

    def set_history(self, caller: Caller, user_id: str, body: Mapping | History) -> dict:
        """Replace a user's history (docs, vectors, user index), persisted before it becomes
        visible; the user's own token, or the admin's (an exported user's replaced history is kept
        across restarts too)."""
        self.authorize(caller, user_id)
        history = parse(History, body).docs()
        with self._acting_on(caller, user_id):
            user, doc_vectors, user_vectors = self._encode_history(user_id, history, replace=True)
            with self._state_lock:
                cohort = self.pipeline.cohort_assignment(user_vectors)
                write_user_file(self.state, user, history, doc_vectors, user_vectors, cohort)
                with self._model_lock:
                    share = self.pipeline.store.shares(user_id)
                    if user_id in self.accounts:
                        share = self.accounts[user_id].share
                    if user_id in self.pipeline.store:
                        self.pipeline.remove_user(user_id)
                    self.pipeline.attach_user(user, doc_vectors, user_vectors, cohort, share=share)
        return {"user_id": user_id, "history_docs": len(user.docs)}

    def delete_user(self, caller: Caller, user_id: str) -> dict:
        """The user everywhere: memories and session turns (gone from LanceDB's files too), docs,
        vectors, user index or cohort, account and token, and — for a user of the exported run — the
        run's files (docstore, user tables and index, doc table, cohort export, corpus-embedding
        caches; serving/purge.py). Journaled: a crash at any step is finished at the next start. The
        token is revoked first; the user's requests in flight are waited for, so none of their
        writes lands after the purge.

        Not reached: answers other users received (and their session logs) that quoted this user's
        shared docs — theirs, not this user's (docs/serving/security.md)."""
        self.authorize(caller, user_id)
        revoke = lambda: self.account_store.revoke(user_id)
        with self._gate.deletion(user_id, self._still_valid(caller, user_id), revoke), self._state_lock:
            purge.begin(self.state, [user_id])  # a crash from here on: finished at the next start
            memories, turns = self._forget(user_id)
            if self.run_dir is not None and user_id in self.exported_users:
                purge.purge_export(self.run_dir, self.state, self.cache_dir)
                self.exported_users.discard(user_id)
            purge.done(self.state)
        return {"user_id": user_id, "deleted": True, "memories": memories, "turns": turns}

    def _forget(self, user_id: str) -> tuple[int, int]:
        """What the service itself keeps of a user, idempotent: bank rows (purged), their user file,
        the in-memory pipeline, the account and token."""
        memories, turns = self.bank.purge_user(user_id)
        user_file(self.state, user_id).unlink(missing_ok=True)
        with self._model_lock:
            if user_id in self.pipeline.store:
                self.pipeline.remove_user(user_id)
        self.account_store.forget(user_id)
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

    # ---- chat ------------------------------------------------------------------------------------

    def chat(self, caller: Caller, body: Mapping | Chat) -> ChatTurn:
        """One turn (the body: requests.Chat): CFRAG docs of the caller (privacy-checked before
        anything is generated or stored), remember + recall (one extraction), prompt with every
        retrieved text marked as data, answer, log it."""
        if caller.user_id is None:
            raise ServiceError(403, "chat needs a user's token (the admin token has no user)")
        user_id, request = caller.user_id, parse(Chat, body)
        message, session_id = request.messages[-1].content, request.session_id
        history = [(m.role, m.content) for m in request.messages[:-1] if m.role != "system"][-HISTORY_TURNS:]
        with self._acting_on(caller, user_id):
            # batched with the chats that arrive with it; privacy-checked in the batch
            docs = self.retrieval((user_id, message))
            turn = self.bank.remember_and_recall(user_id, message, session_id)
            memories = [memory_doc(r) for r in turn.recalled]
            foreign = [m for m in memories if m.owner != user_id]
            if foreign:  # recall filters on the user: this would be a bug of the bank
                log.error("privacy guard: %d memories of other users dropped", len(foreign))
                memories = [m for m in memories if m.owner == user_id]
            prompt, answer, usage = self.answerer(message, memories, docs, history)
            if answer.strip() and is_utf8(answer):
                self.bank.log_turn(user_id, session_id, "assistant", answer[:MAX_MESSAGE_CHARS])
        return ChatTurn(answer, prompt, docs, memories, turn.memory.id if turn.memory else None, session_id,
                        request.model, usage)

    def _retrieve_many(self, asks: list[tuple[str, str]]) -> list[list[RetrievedDoc]]:
        """`guarded_docs` under the model lock (the chats' micro-batcher's function)."""
        with self._model_lock:
            return self.guarded_docs(asks)

    def guarded_docs(self, asks: list[tuple[str, str]]) -> list[list[RetrievedDoc]]:
        """The CFRAG docs of each (user, message), in one pipeline call, each list through the
        privacy guard before anything is generated or stored; a user without docs in the store gets
        none. The caller holds the model lock."""
        present = [i for i, (user_id, _) in enumerate(asks) if user_id in self.pipeline.store]
        found = self.pipeline.retrieve_batch(
            [asks[i][0] for i in present], [asks[i][1] for i in present], self.k
        ) if present else []
        out: list[list[RetrievedDoc]] = [[] for _ in asks]
        for i, docs in zip(present, found):
            out[i] = self._shareable(asks[i][0], docs)
        return out

    def close(self) -> None:
        """Stop the batchers (queued chats are answered first), write the bank's usage marks: shutdown."""
        self.retrieval.close()
        self.answering.close()
        self.answerer.close()
        self.bank.close()

    def _shareable(self, user_id: str, docs: list[RetrievedDoc]) -> list[RetrievedDoc]:
        """The caller's own docs and those of users who share and are still there; anything else is
        dropped (and
        logged: the retrieval's own filter should never let it through)."""
        store = self.pipeline.store
        kept = [
            d for d in docs if d.owner == user_id or (d.owner in store and store.shares(d.owner))
        ]
        if len(kept) != len(docs):
            log.error("privacy guard: %d docs of users who do not share dropped before the prompt",
                      len(docs) - len(kept))
        return kept

    def completion(self, turn: ChatTurn, model: str, user_id: str) -> dict:
        """The OpenAI chat.completion object, plus `provenance` (serving/completion.py)."""
        return chat_completion(turn, model, user_id)

    def health(self) -> dict:
        return {"status": "ok", "users": self.pipeline.store.corpus.num_users, "accounts": len(self.accounts),
                "llm": self.use_llm, "serves": self.pipeline.serves}

