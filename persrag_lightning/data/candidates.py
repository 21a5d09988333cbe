"""Records of LLM feedback (one per training example, m·k scored candidates) and the typed batch
built from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["Candidate", "CandidateBatch", "FeedbackExample", "collate_candidates"]


@dataclass(frozen=True)
class Candidate:
    """A candidate doc of an example: where it came from, how stage 1/2 scored it, and what the LLM
    made of it."""

    row: int              # corpus row (see data/corpus.py)
    doc_id: str
    owner: str            # the user whose history holds the doc
    user_sim: float       # cosine of the owner to the query user (stage 1)
    first_stage: float    # score of the candidate retriever that proposed it
    output: str           # the LLM's post-processed answer with this doc alone in the prompt
    label: float          # eval(y, O) of Eq. 6: the task metric (or the target's log-likelihood)


@dataclass(frozen=True)
class FeedbackExample:
    """One (u, q, y) with its m·k candidates, in the order the candidate retriever proposed them."""

    example_id: str
    user_id: str
    input: str
    query: str
    target: str
    candidates: tuple[Candidate, ...]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> FeedbackExample:
        return cls(**{**obj, "candidates": tuple(Candidate(**c) for c in obj["candidates"])})


@dataclass
class CandidateBatch:
    """B examples × C candidate slots (ragged lists padded; `mask` False on padding).

    `docs` holds each distinct candidate text of the batch once and `doc_index` points into it (-1
    on padding), so a bi-encoder embeds a doc shared by several examples once.
    """

    example_ids: list[str]
    queries: list[str]
    users: torch.Tensor        # [B] row of the query user in the user-embedding table
    docs: list[str]
    doc_index: torch.Tensor    # [B, C] long, -1 on padding
    owners: torch.Tensor       # [B, C] long row of the owner user, -1 on padding
    labels: torch.Tensor       # [B, C] float LLM-feedback values, 0 on padding
    first_stage: torch.Tensor  # [B, C] float
    user_sim: torch.Tensor     # [B, C] float
    mask: torch.Tensor         # [B, C] bool

    def __len__(self) -> int:
        return len(self.example_ids)

    def pair_texts(self) -> tuple[list[str], list[str], torch.Tensor]:
        """(query, doc) pairs of the valid slots in row-major order, with their [B, C] positions,
        for a cross-encoder."""
        pos = self.mask.nonzero(as_tuple=False)
        queries = [self.queries[int(b)] for b in pos[:, 0]]
        docs = [self.docs[int(self.doc_index[b, c])] for b, c in pos.tolist()]
        return queries, docs, pos


def collate_candidates(examples: list[FeedbackExample], user_row: dict[str, int], corpus_texts: list[str],
                       corpus_owner_row: dict[str, int] | None = None) -> CandidateBatch:
    """Pad the ragged candidate lists of `examples` into a CandidateBatch (texts come from the
    corpus rows)."""
    owner_row = corpus_owner_row if corpus_owner_row is not None else user_row
    width = max(1, max(len(e.candidates) for e in examples))
    b = len(examples)
    doc_index = torch.full((b, width), -1, dtype=torch.long)
    owners = torch.full((b, width), -1, dtype=torch.long)
    labels = torch.zeros(b, width)
    first_stage = torch.zeros(b, width)
    user_sim = torch.zeros(b, width)
    slot_of_row: dict[int, int] = {}
    docs: list[str] = []
    for i, ex in enumerate(examples):
        for j, c in enumerate(ex.candidates):
            if c.row not in slot_of_row:
                slot_of_row[c.row] = len(docs)
                docs.append(corpus_texts[c.row])
            doc_index[i, j] = slot_of_row[c.row]
            owners[i, j] = owner_row.get(c.owner, -1)
            labels[i, j] = c.label
            first_stage[i, j] = c.first_stage
            user_sim[i, j] = c.user_sim
    return CandidateBatch(
        example_ids=[e.example_id for e in examples], queries=[e.query for e in examples],
        users=torch.tensor([user_row[e.user_id] for e in examples], dtype=torch.long), docs=docs,
        doc_index=doc_index, owners=owners, labels=labels, first_stage=first_stage, user_sim=user_sim,
        mask=doc_index >= 0,
    )
