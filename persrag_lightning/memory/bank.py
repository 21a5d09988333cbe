"""`MemoryBank`: the one object the service and the evaluation use — sign-up, remember, recall,
list, delete."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from persrag_lightning.llm.base import LLM
from persrag_lightning.memory.eviction import EvictionSettings, UsageRow, select_evictions
from persrag_lightning.memory.extract import Extraction, Extractor, questionnaire_turns
from persrag_lightning.memory.recall import Encoder, RecallSettings, TagEmbeddings, encode_numpy, rerank
from persrag_lightning.memory.records import ROLES, Memory, Recalled, Tags, Turn
from persrag_lightning.memory.store import MemoryStore, NewMemory, StoreSettings, validate_id

__all__ = ["ChatMemory", "MemoryBank", "MemorySettings", "UserExistsError"]


@dataclass(frozen=True)
class ChatMemory:
    """What one chat turn did to the bank: the memory stored (None: nothing to remember), the
    memories recalled for the prompt, and the extraction behind both."""

    memory: Memory | None
    recalled: list[Recalled]
    extraction: Extraction


class UserExistsError(ValueError):
    """Sign-up of a user who already has memories or turns (a second questionnaire would duplicate
    them)."""


@dataclass(frozen=True)
class MemorySettings:
    """All knobs of the bank in one place; the defaults are the seed's."""

    recall: RecallSettings = field(default_factory=RecallSettings)
    eviction: EvictionSettings = field(default_factory=EvictionSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    history_turns: int = 6  # recent turns of the session given to the extraction prompt
    max_message_chars: int = 8000
    # session turns kept per user, all sessions together (oldest dropped first); past it, a trim brings
    # the user back to this fraction of it, so that a user at the bound does not pay a scan and a
    # delete commit for every turn, only for every tenth of the bound (1.0: every turn)
    max_turns_per_user: int = 1000
    trim_turns_to: float = 0.9
    # recall asks the LLM for the query's tags when none are given (seed)
    extract_query_tags: bool = True
    # what recall embeds: "summary", the LLM's one-sentence summary of the query (the seed; the
    # extraction's sentence, from the same call as the tags), or "raw", the query itself; without an
    # LLM, or when the LLM's answer is unusable or empty, the raw query (counted in `recall_inputs`)
    recall_query: str = "summary"
    # True: constrain the extraction answer to its JSON schema where the LLM backend can (llamacpp;
    # hf with lm-format-enforcer). False (default): free decoding parsed afterwards, as the seed
    # does; with SmolLM2-135M the schema cut the fallbacks to a few but its forced sentences lost
    # the facts, and recall with them (docs/methods/memory.md)
    constrained_extraction: bool = False

    def __post_init__(self) -> None:
        if self.recall_query not in ("summary", "raw"):
            raise ValueError(f"recall_query must be 'summary' or 'raw', got {self.recall_query!r}")
        if not 0 < self.trim_turns_to <= 1:
            raise ValueError(f"trim_turns_to must be in (0, 1], got {self.trim_turns_to}")


def _check_text(text: object, what: str, max_chars: int) -> str:
    """Reject what must never be stored: non-strings, empty text, oversized text, unencodable (lone
    surrogates).

    Args:
        text: the value a request gave.
        what: what the value is (`message`, `answer`), named in the error.
        max_chars: the longest text accepted.
    """
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{what} is empty")
    if len(text) > max_chars:
        raise ValueError(f"{what} has {len(text)} characters, more than the limit of {max_chars}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text: {e.reason}") from None
    return text


class MemoryBank:
    """Per-user memories on LanceDB: LLM extraction on write, tag-re-ranked recall, usage-aware
    eviction.

    Without an LLM, messages are stored verbatim, queries are embedded raw and carry no tags (recall
    is then the vector top-3 of N = 20, since the kept score must be >= N - 2)."""

    def __init__(self, path: str | Path, encoder: Encoder, llm: LLM | None = None,
                 settings: MemorySettings | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings or MemorySettings()
        self.encoder = encoder
        dim = getattr(encoder, "dim", None) or encode_numpy(encoder, ["dimension probe"]).shape[1]
        self.store = MemoryStore(path, int(dim), self.settings.store, clock)
        self.extractor = Extractor(llm, history_turns=self.settings.history_turns,
                                   json_schema=self.settings.constrained_extraction) if llm is not None else None
        self.tag_embeddings = TagEmbeddings(encoder)
        # what recall embedded: the LLM's summary, or the raw query (by setting, or as the fallback)
        self.recall_inputs: dict[str, int] = {"summary": 0, "raw": 0, "raw_fallback": 0}
        self._user_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    @classmethod
    def open(cls, path: str | Path, encoder: str | Encoder = "minilm", llm: LLM | None = None,
             settings: MemorySettings | None = None) -> MemoryBank:
        """Open (or create) a bank; `encoder` may be a model name/alias loaded with our
        TextEncoder.

        Args:
            path: the bank's folder (created if missing).
            encoder: the text encoder of memories and tags: a model name or alias, or an object with
                `encode(texts)`.
            llm: the LLM that extracts memories from messages; None stores each message as it is.
            settings: capacity, eviction, recall and limits; None = MemorySettings().
        """
        if isinstance(encoder, str):
            from persrag_lightning.models.text_encoder import TextEncoder

            encoder = TextEncoder.from_pretrained(encoder)
        return cls(path, encoder, llm, settings)

    def _user_lock(self, user_id: str) -> threading.Lock:
        """Eviction reads then deletes; one lock per user keeps two concurrent turns from evicting
        twice."""
        with self._locks_guard:
            return self._user_locks.setdefault(user_id, threading.Lock())

    def _embed(self, texts: list[str]):
        return encode_numpy(self.encoder, texts)

    @property
    def fallbacks(self) -> int:
        """Extractions whose LLM answer was unusable (message stored verbatim)."""
        return self.extractor.fallbacks if self.extractor else 0

    @property
    def repaired(self) -> int:
        """Extractions recovered from a cut-off JSON answer."""
        return self.extractor.repaired if self.extractor else 0

    # ---- writes ----------------------------------------------------------------------------------

    def add_user(self, user_id: str, answers: Mapping[str, str]) -> list[Memory]:
        """Sign-up: each answered questionnaire category becomes a memory tagged with its
        category.

        Args:
            user_id: the new user's id.
            answers: questionnaire category → the user's answer; empty answers are skipped.
        """
        validate_id(user_id)
        pairs = questionnaire_turns(answers)
        for q, a in pairs:
            _check_text(a, f"answer to {q.category!r}", self.settings.max_message_chars)
        if self.store.count(user_id) or self.store.turns(user_id, last=1):
            raise UserExistsError(f"user {user_id!r} already exists")
        if self.extractor is not None and pairs:
            history = [[Turn("", "signup", user_id, "assistant", q.text, 0.0)] for q, _ in pairs]
            extractions = self.extractor.extract_many([a for _, a in pairs], history)
        else:
            extractions = [Extraction(a, Tags(), parsed=False) for _, a in pairs]
        items = []
        texts = [e.memory or a for e, (_, a) in zip(extractions, pairs, strict=True)]
        vectors = self._embed(texts) if texts else []
        for (q, _), e, text, vec in zip(pairs, extractions, texts, vectors, strict=True):
            items.append(
                NewMemory(text, vec, e.tags.with_topic(q.category), source="questionnaire")
            )
        with self._user_lock(user_id):
            if self.store.count(user_id):  # a concurrent sign-up of the same id won the race
                raise UserExistsError(f"user {user_id!r} already exists")
            stored = self.store.add_memories(user_id, items)
            self._evict(user_id)
        self.store.maintain()
        return stored

    def log_turn(self, user_id: str, session_id: str, role: str, text: str) -> Turn:
        """Log one turn of either role (the assistant's answers are logged by the caller after
        generation).

        Args:
            user_id: the user the session belongs to.
            session_id: the chat session.
            role: `user` or `assistant`.
            text: what was said.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        turn = self.store.add_turn(user_id, session_id, role,
                                   _check_text(text, f"{role} turn", self.settings.max_message_chars))
        keep = self.settings.max_turns_per_user
        # at least the turn just logged stays (a bound of 1 keeps it; the store never keeps more than `keep`)
        self.store.trim_turns(user_id, keep, down_to=max(1, int(keep * self.settings.trim_turns_to)))
        return turn

    def remember(self, user_id: str, message: str, session_id: str) -> Memory | None:
        """A user's chat message: log the turn, extract a memory with the session's recent turns,
        store it, evict past capacity. None when the LLM judged that the message tells nothing about
        the user.

        Args:
            user_id: the user who wrote the message.
            message: the chat message.
            session_id: the chat session, whose recent turns the extraction reads.
        """
        return self._store(user_id, self._observe(user_id, message, session_id))

    def remember_and_recall(self, user_id: str, message: str, session_id: str) -> ChatMemory:
        """One chat turn with ONE extraction: recall for the message (with the extraction's tags, as
        the seed does) before storing it, so the message never recalls itself; then store and
        evict.

        Args:
            user_id: the user who wrote the message.
            message: the chat message, both the query of the recall and the source of the new
                memory.
            session_id: the chat session.
        """
        extraction = self._observe(user_id, message, session_id)  # its turn log checks the id
        text = self._recall_text(message, extraction.memory if extraction.parsed else "")
        # the recall's text is the new memory's whenever the LLM summarised the message or it is
        # stored verbatim: one encoder call embeds what both need
        texts = list(dict.fromkeys(t for t in (text, extraction.memory) if t))
        vectors = dict(zip(texts, self._embed(texts), strict=True))
        recalled = self._recall_by(user_id, vectors[text], extraction.tags)
        return ChatMemory(self._store(user_id, extraction, vectors.get(extraction.memory)), recalled, extraction)

    def _observe(self, user_id: str, message: str, session_id: str) -> Extraction:
        """Validate, read the session's recent turns (the LLM's extraction reads them; verbatim
        storage does not, so it skips the read), log the user's turn, extract."""
        _check_text(message, "message", self.settings.max_message_chars)
        history = self.store.turns(user_id, session_id, last=self.settings.history_turns) \
            if self.extractor is not None else []
        self.log_turn(user_id, session_id, "user", message)
        if self.extractor is not None:
            return self.extractor.extract(message, history)
        return Extraction(" ".join(message.split()), Tags(), parsed=False)

    def _store(self, user_id: str, extraction: Extraction, vector: np.ndarray | None = None) -> Memory | None:
        """Store the extraction's memory (`vector`: its embedding where the caller has it) and evict
        past capacity; None when there is no memory."""
        if not extraction.memory:
            return None
        vec = self._embed([extraction.memory])[0] if vector is None else vector
        with self._user_lock(user_id):
            (memory,) = self.store.add_memories(
                user_id, [NewMemory(extraction.memory, vec, extraction.tags)]
            )
            self._evict(user_id)
        self.store.maintain()
        return memory

    def _evict(self, user_id: str) -> list[str]:
        if self.store.count(user_id) <= self.settings.eviction.capacity:
            return []
        rows = [
            UsageRow(m.id, m.usage_count, m.created_at) for m in self.store.list_memories(user_id)
        ]
        ids = select_evictions(rows, self.settings.eviction, rng_key=user_id)
        self.store.delete_memories(user_id, ids)
        return ids

    def evict(self, user_id: str) -> list[str]:
        """Run eviction for one user now; returns the deleted ids.

        Args:
            user_id: the user whose memories are evicted.
        """
        with self._user_lock(user_id):
            return self._evict(user_id)

    def delete_memory(self, user_id: str, memory_id: str) -> bool:
        """Delete one memory of this user; False when the user has no memory with that id.

        Args:
            user_id: the memory's owner.
            memory_id: the memory's id.
        """
        return self.store.delete_memories(user_id, [memory_id]) > 0

    def delete_user(self, user_id: str) -> tuple[int, int]:
        """Forget a user entirely: memories and session turns; returns (memories, turns) deleted.

        Args:
            user_id: the user to forget.
        """
        with self._user_lock(user_id):
            return self.store.delete_user(user_id)

    def purge_user(self, user_id: str) -> tuple[int, int]:
        """`delete_user` with the rows physically gone from the LanceDB files (no old version keeps
        them); the user's lock goes with them (the caller makes sure no request of the user is in
        flight).

        Args:
            user_id: the user to forget.
        """
        with self._user_lock(user_id):
            counts = self.store.purge_user(user_id)
        with self._locks_guard:
            self._user_locks.pop(user_id, None)
        return counts

    def user_ids(self) -> set[str]:
        """Every user the bank holds rows of."""
        return self.store.user_ids()

    def close(self) -> None:
        """Write the recalls' usage marks the store keeps (`StoreSettings.usage_every`): a server's
        shutdown, before the process ends."""
        self.store.write_usage()

    # ---- reads -----------------------------------------------------------------------------------

    def recall(self, user_id: str, query: str, tags: Tags | None = None,
               session_id: str | None = None, summary: str | None = None) -> list[Recalled]:
        """Memories of this user for a query (seed §3.5); recalled rows get usage + 1 and
        last_used_at = now. The vector search embeds the LLM's summary of the query (`summary`, else
        one LLM call with the session's recent turns, which also gives the tags) unless
        `recall_query` is "raw"; query tags come from `tags`, else from that LLM call, else none.
        `summary=""` means: the LLM gave none (the raw query is used)."""
        _check_text(query, "query", self.settings.max_message_chars)
        validate_id(user_id)
        want_summary = self.settings.recall_query == "summary"
        want_tags = tags is None and self.settings.extract_query_tags
        if self.extractor is not None and ((want_summary and summary is None) or want_tags):
            history = self.store.turns(user_id, session_id, last=self.settings.history_turns) \
                if session_id else []
            extraction = self.extractor.extract(query, history)
            if tags is None and self.settings.extract_query_tags:
                tags = extraction.tags
            if summary is None:
                summary = extraction.memory if extraction.parsed else ""
        text = self._recall_text(query, summary or "")
        return self._recall_by(user_id, self._embed([text])[0], tags if tags is not None else Tags())

    def _recall_text(self, query: str, summary: str) -> str:
        """What the vector search embeds: the LLM's `summary` of the query where `recall_query` wants
        it and there is one, else the query itself; counted in `recall_inputs`."""
        if self.settings.recall_query != "summary":
            self.recall_inputs["raw"] += 1
            return query
        if summary:
            self.recall_inputs["summary"] += 1
            return summary
        self.recall_inputs["raw_fallback"] += 1
        return query

    def _recall_by(self, user_id: str, vector: np.ndarray, tags: Tags) -> list[Recalled]:
        """The vector search's candidates for `vector`, scored with the query's `tags`; the kept
        rows' usage is marked."""
        s = self.settings.recall
        candidates = self.store.search(user_id, vector, s.top_n)
        recalled = rerank(candidates, tags.flat(), self.tag_embeddings, s)
        self.store.note_used(user_id, [r.memory.id for r in recalled])
        return recalled

    def list(self, user_id: str) -> list[Memory]:
        """All memories of a user, oldest first.

        Args:
            user_id: the user whose memories are listed.
        """
        return self.store.list_memories(user_id)

    def turns(
        self, user_id: str, session_id: str | None = None, last: int | None = None
    ) -> list[Turn]:
        return self.store.turns(user_id, session_id, last)
