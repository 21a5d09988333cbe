"""Per-user memory bank on embedded LanceDB (seed 004): LLM extraction, tag-re-ranked recall,
usage-aware eviction.

Import from here; the modules are `store` (tables and the user filter), `extract`, `recall`,
`eviction`, `bank` (the `MemoryBank` facade) and `simulate` (planted-fact conversations and
recall@k).
"""

from persrag_lightning.memory.bank import ChatMemory, MemoryBank, MemorySettings, UserExistsError
from persrag_lightning.memory.eviction import EvictionSettings, UsageRow, select_evictions
from persrag_lightning.memory.extract import (
    CATEGORIES,
    QUESTIONNAIRE,
    Extraction,
    Extractor,
    parse_extraction,
)
from persrag_lightning.memory.recall import RecallSettings, rerank
from persrag_lightning.memory.records import DIMENSIONS, Memory, Recalled, Tags, Turn
from persrag_lightning.memory.store import InvalidIdError, MemoryStore, StoreSettings, user_filter

__all__ = [
    "CATEGORIES",
    "DIMENSIONS",
    "QUESTIONNAIRE",
    "ChatMemory",
    "EvictionSettings",
    "Extraction",
    "Extractor",
    "InvalidIdError",
    "Memory",
    "MemoryBank",
    "MemorySettings",
    "MemoryStore",
    "RecallSettings",
    "Recalled",
    "StoreSettings",
    "Tags",
    "Turn",
    "UsageRow",
    "UserExistsError",
    "parse_extraction",
    "rerank",
    "select_evictions",
    "user_filter",
]
