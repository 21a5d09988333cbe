"""Memory strategies (seed 004): the user's remembered facts as retrieval results, alone (`Memory`)
or next to CFRAG's docs (`CFRAG + memory`), on the same Strategy interface as every other method.

A memory comes back as a `RetrievedDoc` with `source="memory"`, row -1, `doc_id` = the memory's id,
owner = the user and `retriever_score` = its recall score (rank score + tag bonus). Recall is
filtered by the query's user in the store, so no strategy can put another user's memory in a prompt.
"""

from __future__ import annotations

from persrag_lightning.memory.bank import MemoryBank
from persrag_lightning.memory.records import Recalled
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.stages import bundle_address

__all__ = ["CFRAGMemory", "MemoryRecall", "memory_doc"]


def memory_doc(r: Recalled) -> RetrievedDoc:
    """A recalled memory with its provenance, as the evaluation and the service report it."""
    return RetrievedDoc(-1, r.memory.id, r.memory.user_id, user_sim=1.0, retriever_score=float(r.score),
                        text=r.memory.text, source="memory")


class MemoryRecall(Strategy):
    """Top-k memories of the query user by the seed's recall rule (vector top N, rank score, tag
    bonus, keep >= N - 2); `bank` is a LanceDB folder opened with `encoder`, or a MemoryBank given
    with `attach`."""

    def __init__(
        self, bank: str = bundle_address("memory"), encoder: str = "minilm", name: str = "Memory"
    ) -> None:
        self.name = name
        self.bank_path = bank
        self.encoder = encoder
        self._bank: MemoryBank | None = None

    def attach(self, bank: MemoryBank) -> MemoryRecall:
        """Use an open bank (the service's, or an evaluation's) instead of opening the folder
        again."""
        self._bank = bank
        return self

    @property
    def bank(self) -> MemoryBank:
        if self._bank is None:
            self._bank = MemoryBank.open(self.bank_path, self.encoder)
        return self._bank

    def prepare(self, store: DocStore) -> None:
        super().prepare(store)
        _ = self.bank

    def recall(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        """Memories per query (k caps the bank's own k); the question text is the recall query."""
        return [[memory_doc(r) for r in self.bank.recall(q.user_id, q.input or q.query)[:k]] for q in queries]

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        return self.recall(queries, k)


class CFRAGMemory(CFRAG):
    """CFRAG's k docs plus the user's recalled memories (at most `memory_k`, listed first): what
    remembered facts add to collaborative retrieval. Every CFRAG setting is available unchanged."""

    def __init__(self, user_encoder: str, retriever: str = "minilm", reranker: str | None = None, m: int = 6,
                 k_per_user: int = 5, bank: str = bundle_address("memory"), encoder: str = "minilm", memory_k: int = 5,
                 cache_dir: str = ".cache/persrag", name: str = "CFRAG + memory", **cfrag: object) -> None:
        super().__init__(user_encoder, retriever, reranker, m=m, k_per_user=k_per_user, cache_dir=cache_dir,
                         name=name, **cfrag)
        self.memory_k = memory_k
        self.memory = MemoryRecall(bank, encoder)

    def cache_config(self) -> dict:
        """CFRAG's key and how many memories join its docs; the bank is not in it (the memory
        evaluation reads it live and caches no retrieval)."""
        return {**super().cache_config(), "memory_k": self.memory_k}

    def attach(self, bank: MemoryBank) -> CFRAGMemory:
        self.memory.attach(bank)
        return self

    def prepare(self, store: DocStore) -> None:
        super().prepare(store)
        self.memory.prepare(store)

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        docs = super().retrieve(queries, k)
        memories = self.memory.recall(queries, self.memory_k)
        return [m + d for m, d in zip(memories, docs)]
