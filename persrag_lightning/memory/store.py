"""The memory bank's storage: one embedded LanceDB folder with a `memories` and a `sessions` table.

Every read, write and delete is scoped to one user through `user_filter` (memory/scope.py), the
single place where a user id becomes a predicate. Nothing here pastes text into a filter string.
Each LanceDB write commits a new table version atomically, so a process killed mid-write leaves the
previous version.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa

__all__ = ["MAX_ID_CHARS", "InvalidIdError", "MemoryStore", "NewMemory", "StoreSettings",
           "user_filter", "validate_id"]

# first: it says how to install lancedb where it is missing
from persrag_lightning.memory.scope import MAX_ID_CHARS, InvalidIdError, user_filter, validate_id  # noqa: I001

import lancedb
from lancedb.expr import lit
from lancedb.index import BTree, HnswFlat, HnswSq, IvfFlat

from persrag_lightning.memory.records import DIMENSIONS, ROLES, Memory, MemoryCandidate, Tags, Turn
from persrag_lightning.memory.row_counts import RowCounts, user_column
from persrag_lightning.memory.usage_marks import UsageMarks

MEMORIES = "memories"
SESSIONS = "sessions"
SOURCES = ("chat", "questionnaire", "manual")


def _memories_schema(dim: int) -> pa.Schema:
    """Schema of `memories`: one list<string> column per tag dimension, so each dimension stays
    queryable."""
    return pa.schema([
        ("id", pa.string()),
        ("user_id", pa.string()),
        ("text", pa.string()),
        ("vector", pa.list_(pa.float32(), dim)),
        *[(d, pa.list_(pa.string())) for d in DIMENSIONS],
        ("usage_count", pa.int64()),
        ("created_at", pa.float64()),
        ("last_used_at", pa.float64()),
        ("source", pa.string()),
    ])


SESSIONS_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("session_id", pa.string()),
    ("user_id", pa.string()),
    ("role", pa.string()),
    ("text", pa.string()),
    ("created_at", pa.float64()),
])


# LanceDB vector index configs by name: HNSW (the seed's choice) over IVF partitions, or plain IVF.
VECTOR_INDEXES = {"hnsw_sq": HnswSq, "hnsw_flat": HnswFlat, "ivf_flat": IvfFlat}


@dataclass(frozen=True)
class StoreSettings:
    """Storage knobs: when the vector index is built, and which kind (the seed uses HNSW)."""

    # below this many memories (all users), exact flat search is fast and exact
    index_min_rows: int = 5000
    index_type: str = "hnsw_sq"  # a key of VECTOR_INDEXES
    rows_per_partition: int = 4096
    # commits between compactions (a chat makes three or four: its two turns, its memory, an
    # eviction; the usage marks one every `usage_every` recalls); 0: never. Every read goes over
    # the fragments each commit leaves, so a chat's reads and writes slow as they pile up:
    # benchmarks/probe_bank_upkeep.py.
    optimize_every: int = 100
    # a compaction also removes the table versions older than this (seconds; None keeps LanceDB's
    # week): every commit is a version, and their count slows each later operation. A reader in
    # another process holding a version older than this loses its files.
    keep_versions_s: float | None = 30.0
    # recalls whose usage marks are written together, in one commit (memory/usage_marks.py), and
    # at each compaction: a process killed before the write loses the marks kept; 1: each recall's
    # own update, as `mark_used`
    usage_every: int = 16

    def __post_init__(self) -> None:
        if self.usage_every < 1:
            raise ValueError(f"usage_every must be >= 1, got {self.usage_every}")
        if self.keep_versions_s is not None and self.keep_versions_s < 0:
            raise ValueError(f"keep_versions_s must be >= 0 or None, got {self.keep_versions_s}")
        if self.index_type not in VECTOR_INDEXES:
            raise ValueError(
                f"index_type must be one of {sorted(VECTOR_INDEXES)}, got {self.index_type!r}"
            )


@dataclass(frozen=True)
class NewMemory:
    """What the caller supplies to store a memory; id, timestamps and usage are filled in by the
    store."""

    text: str
    vector: np.ndarray
    tags: Tags = field(default_factory=Tags)
    source: str = "chat"


class MemoryStore:
    """LanceDB access for the memory bank; the only module that touches the tables."""

    def __init__(self, path: str | Path, dim: int, settings: StoreSettings = StoreSettings(),
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.dim = int(dim)
        self.settings = settings
        self._clock = clock
        self._last_ts = 0.0
        # one lock per table: a turn's commit need not wait for a memory's (under concurrent chats
        # one lock for both was held nearly all the time, docs/serving/chat-service.md); a method
        # that needs both takes the memories' first
        self._lock = threading.RLock()  # the memories table, its row counts and the usage marks
        self._turns_lock = threading.RLock()  # the turn log and its row counts
        self._stamp_lock = threading.Lock()  # timestamps and the commit count
        self._indexed = False
        self._commits = 0
        # interval 0: every read checks for versions committed by other processes (strong
        # consistency)
        self.db = lancedb.connect(str(self.path), read_consistency_interval=timedelta(0))
        self.memories = self._open(MEMORIES, _memories_schema(self.dim))
        self.sessions = self._open(SESSIONS, SESSIONS_SCHEMA)
        # rows per user, moved with this store's commits instead of counted per chat
        self._memory_counts = RowCounts(self.memories)
        self._turn_counts = RowCounts(self.sessions)
        self._usage = UsageMarks(self.memories, user_filter, settings.usage_every)
        stored_dim = self.memories.schema.field("vector").type.list_size
        if stored_dim != self.dim:
            raise ValueError(f"memory bank {self.path} holds {stored_dim}-d vectors but the encoder gives {self.dim}-d")

    def _open(self, name: str, schema: pa.Schema):
        """Open a table, creating it empty on first use (exist_ok: two processes may race to create
        it)."""
        try:
            return self.db.open_table(name)
        except ValueError:  # "Table ... was not found"
            return self.db.create_table(name, schema=schema, exist_ok=True)

    def now(self) -> float:
        """Strictly increasing timestamps, so 'oldest' and turn order are total even within one
        clock tick."""
        with self._stamp_lock:
            self._last_ts = max(float(self._clock()), self._last_ts + 1e-6)
            return self._last_ts

    def _committed(self) -> None:
        """Count one commit towards the next compaction (`maintain`)."""
        with self._stamp_lock:
            self._commits += 1

    # ---- memories --------------------------------------------------------------------------------

    def add_memories(self, user_id: str, items: Sequence[NewMemory]) -> list[Memory]:
        """Append memories of one user in ONE commit (all or nothing)."""
        validate_id(user_id)
        if not items:
            return []
        out: list[Memory] = []
        for item in items:
            if item.source not in SOURCES:
                raise ValueError(f"memory source must be one of {SOURCES}, got {item.source!r}")
            if not item.text.strip():
                raise ValueError("memory text is empty")
            vec = np.asarray(item.vector, dtype=np.float32).reshape(-1)
            if vec.shape[0] != self.dim or not np.isfinite(vec).all():
                raise ValueError(
                    f"memory vector must be {self.dim} finite floats, got shape {vec.shape}"
                )
            ts = self.now()
            out.append(Memory(id=uuid.uuid4().hex, user_id=user_id, text=item.text.strip(), tags=item.tags,
                              usage_count=0, created_at=ts, last_used_at=ts, source=item.source, vector=vec))
        with self._lock:
            self.memories.add(self._memories_table(out))
            self._memory_counts.committed(user_id, len(out))
            self._committed()
        return out

    def _memories_table(self, memories: Sequence[Memory]) -> pa.Table:
        cols: dict[str, list] = {
            "id": [m.id for m in memories], "user_id": [m.user_id for m in memories],
            "text": [m.text for m in memories], "vector": [m.vector.tolist() for m in memories],
            **{d: [list(getattr(m.tags, d)) for m in memories] for d in DIMENSIONS},
            "usage_count": [m.usage_count for m in memories], "created_at": [m.created_at for m in memories],
            "last_used_at": [m.last_used_at for m in memories], "source": [m.source for m in memories],
        }
        return pa.Table.from_pydict(cols, schema=_memories_schema(self.dim))

    @staticmethod
    def _memory(row: dict) -> Memory:
        return Memory(id=row["id"], user_id=row["user_id"], text=row["text"],
                      tags=Tags(**{d: tuple(row[d] or ()) for d in DIMENSIONS}),
                      usage_count=int(row["usage_count"]), created_at=float(row["created_at"]),
                      last_used_at=float(row["last_used_at"]), source=row["source"],
                      vector=np.asarray(row["vector"], dtype=np.float32))

    def list_memories(self, user_id: str, ids: Iterable[str] | None = None) -> list[Memory]:
        """A user's memories, oldest first, with the usage marks not yet written (under the lock, so
        that no write of them falls between the read and the marks: eviction decides by them)."""
        with self._lock:
            rows = self.memories.search().where(user_filter(user_id, ids=ids)).limit(None).to_list()
            memories = [self._usage.apply(self._memory(r)) for r in rows]
        return sorted(memories, key=lambda m: (m.created_at, m.id))

    def count(self, user_id: str) -> int:
        """Number of memories of one user (eviction's trigger)."""
        with self._lock:
            return self._memory_counts.get(user_id)

    def search(self, user_id: str, vector: np.ndarray, limit: int) -> list[MemoryCandidate]:
        """Nearest memories of one user by cosine distance; the user filter is applied before the
        search (prefilter), so an index never returns fewer rows because of other users'
        neighbours."""
        vec = np.asarray(vector, dtype=np.float32).reshape(-1)
        if vec.shape[0] != self.dim:
            raise ValueError(f"query vector must be {self.dim}-d, got {vec.shape[0]}")
        rows = (self.memories.search(vec, vector_column_name="vector").distance_type("cosine")
                .where(user_filter(user_id), prefilter=True).limit(limit).to_list())
        rows.sort(key=lambda r: (r["_distance"], r["created_at"]))
        return [MemoryCandidate(self._usage.apply(self._memory(r)), rank, float(r["_distance"]))
                for rank, r in enumerate(rows)]

    def mark_used(self, user_id: str, ids: Sequence[str]) -> int:
        """usage_count + 1 and last_used_at = now for recalled rows, in one commit; returns rows
        updated."""
        if not ids:
            return 0
        now = self.now()
        with self._lock:
            res = self.memories.update(where=user_filter(user_id, ids=ids),
                                       values_sql={"usage_count": "usage_count + 1",
                                                   "last_used_at": lit(now).to_sql()})
            self._memory_counts.committed(user_id, 0)
            self._committed()
        return int(res.rows_updated)

    def note_used(self, user_id: str, ids: Sequence[str]) -> None:
        """`mark_used` as a recall does it: kept with other recalls' marks and written with them, in one
        commit, every `usage_every` recalls (memory/usage_marks.py); reads see them at once."""
        if self.settings.usage_every == 1:
            self.mark_used(user_id, ids)
            return
        with self._lock:
            if self._usage.mark(user_id, ids, self.now()):
                self.write_usage()

    def write_usage(self) -> int:
        """Write the usage marks kept so far, in one commit; returns rows updated."""
        with self._lock:
            updated = self._usage.write()
            if updated:  # a commit that changed no row count
                self._memory_counts.committed("", 0)
                self._committed()
            return updated

    def delete_memories(self, user_id: str, ids: Sequence[str]) -> int:
        """Delete rows of one user by id (never by text); returns rows deleted."""
        if not ids:
            return 0
        with self._lock:
            self._committed()
            self._usage.forget(user_id, ids)
            deleted = int(self.memories.delete(user_filter(user_id, ids=ids)).num_deleted_rows)
            self._memory_counts.committed(user_id, -deleted)
            return deleted

    def delete_user(self, user_id: str) -> tuple[int, int]:
        """Remove a user from both tables; returns (memories deleted, turns deleted)."""
        pred = user_filter(user_id)
        with self._lock, self._turns_lock:
            self._usage.forget(user_id)
            n_mem = int(self.memories.delete(pred).num_deleted_rows)
            self._memory_counts.committed(user_id, -n_mem)
            n_turn = int(self.sessions.delete(pred).num_deleted_rows)
            self._turn_counts.committed(user_id, -n_turn)
        return n_mem, n_turn

    def purge_user(self, user_id: str) -> tuple[int, int]:
        """`delete_user`, then physically: a LanceDB delete only marks rows in deletion files (and
        compaction rewrites a fragment only past 10 % deleted rows), so the other rows sharing a
        fragment with the user's are rewritten elsewhere in the same commit (one merge_insert),
        which leaves those fragments empty, and every older version — data, deletion and index files
        — is removed. Idempotent; returns (memories, turns) deleted. Old versions go at once
        (`cleanup_older_than=0`), so this must be the only process writing the bank (the service
        is)."""
        with self._lock, self._turns_lock:
            self._usage.forget(user_id)
            counts = (self._purge_rows(self.memories, user_id), self._purge_rows(self.sessions, user_id))
            # LanceDB warns that cleanup_older_than=0 is for a sole writer: it is
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # the 2nd pass drops the index files the 1st pass's index update replaced
                for _ in range(2):
                    for table in (self.memories, self.sessions):
                        table.optimize(cleanup_older_than=timedelta(0), delete_unverified=True)
            self._commits = 0
        return counts

    @staticmethod
    def _purge_rows(table, user_id: str) -> int:
        pred = user_filter(user_id)
        found = table.search().where(pred).with_row_id(True).select(["id"]).limit(None).to_arrow()
        if not found.num_rows:
            return 0
        # row id = fragment << 32 | offset (LanceDB's default, unstable row ids): the user's
        # fragments
        fragments = sorted({int(r) >> 32 for r in found.column("_rowid").to_pylist()})
        others_pred = user_filter(user_id, others_in_fragments=fragments)
        others = table.search().where(others_pred).limit(None).to_arrow()
        others = others.select(table.schema.names).cast(table.schema)
        (table.merge_insert("id").when_matched_update_all().when_not_matched_by_source_delete(pred.to_sql())
         .execute(others))
        return found.num_rows

    # ---- vector index ----------------------------------------------------------------------------

    def has_vector_index(self) -> bool:
        if not self._indexed:  # once built it stays (nothing here drops it), so stop asking LanceDB
            self._indexed = any("vector" in idx.columns for idx in self.memories.list_indices())
        return self._indexed

    def maybe_index(self) -> bool:
        """Build the ANN index once the table is large enough (flat search below it); True when
        built now. Rows added later are searched flat by LanceDB until `optimize` folds them into
        the index."""
        with self._lock:
            if self._indexed:
                return False
            n = self.memories.count_rows()  # first: cheaper than asking for the indexes
            if n < self.settings.index_min_rows or self.has_vector_index():
                return False
            config = VECTOR_INDEXES[self.settings.index_type](
                distance_type="cosine", num_partitions=max(1, n // self.settings.rows_per_partition)
            )
            self.memories.create_index("vector", config=config)
            self.memories.create_index("user_id", config=BTree())  # the prefilter on user_id
            return True

    def optimize(self) -> None:
        """Compact the small fragments every commit leaves, add new rows to the indexes, and remove
        the versions older than `keep_versions_s`."""
        keep = self.settings.keep_versions_s
        older_than = None if keep is None else timedelta(seconds=keep)  # None: LanceDB's week
        with self._lock:
            self.write_usage()  # the compaction folds them in
            self.memories.optimize(cleanup_older_than=older_than)
        with self._turns_lock:
            self.sessions.optimize(cleanup_older_than=older_than)
        with self._stamp_lock:
            self._commits = 0

    def maintain(self) -> None:
        """After writes: build the index when due, compact every `optimize_every` commits."""
        self.maybe_index()
        every = self.settings.optimize_every
        if every and self._commits >= every:
            self.optimize()

    # ---- sessions --------------------------------------------------------------------------------

    def add_turn(self, user_id: str, session_id: str, role: str, text: str) -> Turn:
        """Log one turn (user or assistant) in one commit."""
        validate_id(user_id)
        validate_id(session_id, "session_id")
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        turn = Turn(id=uuid.uuid4().hex, session_id=session_id, user_id=user_id, role=role, text=text,
                    created_at=self.now())
        row = {"id": [turn.id], "session_id": [session_id], "user_id": [user_id], "role": [role],
               "text": [text], "created_at": [turn.created_at]}
        with self._turns_lock:
            self.sessions.add(pa.Table.from_pydict(row, schema=SESSIONS_SCHEMA))
            self._turn_counts.committed(user_id, 1)
            self._committed()
        return turn

    def trim_turns(self, user_id: str, keep: int, down_to: int | None = None) -> int:
        """With more than `keep` turns, delete a user's oldest (all sessions) so that the `down_to`
        most recent remain (default `keep`), in one commit; returns rows deleted. Sessions are
        bounded by this, not by a count of sessions."""
        with self._turns_lock:
            if self._turn_counts.get(user_id) <= keep:
                return 0
            rows = (self.sessions.search().where(user_filter(user_id)).select(["id", "created_at"]).limit(None)
                    .to_list())
            rows.sort(key=lambda r: (r["created_at"], r["id"]))
            remain = keep if down_to is None else max(0, min(down_to, keep))
            old = [r["id"] for r in rows[:len(rows) - remain]]
            self._committed()
            deleted = int(self.sessions.delete(user_filter(user_id, ids=old)).num_deleted_rows)
            self._turn_counts.committed(user_id, -deleted)
            return deleted

    def user_ids(self) -> set[str]:
        """Every user with a memory or a turn (a scan of the user_id columns: used once, at
        start)."""
        out: set[str] = set()
        for table in (self.memories, self.sessions):
            out |= set(user_column(table).to_pylist())
        return out

    def turns(
        self, user_id: str, session_id: str | None = None, last: int | None = None
    ) -> list[Turn]:
        """A user's turns (of one session when given), oldest first; `last` keeps only the most
        recent ones."""
        rows = self.sessions.search().where(user_filter(user_id, session_id=session_id)).limit(None).to_list()
        turns = sorted((Turn(r["id"], r["session_id"], r["user_id"], r["role"], r["text"], float(r["created_at"]))
                        for r in rows), key=lambda t: (t.created_at, t.id))
        if last is None:
            return turns
        return turns[len(turns) - last:] if last > 0 else []
