"""CFRAG's first stage (Fig. 2), written once: the top-m users of the query user, then the top-k
docs of each by the retriever (Eq. 3 untuned, Eq. 5 trained). The feedback builder labels exactly
these candidates and the CFRAG strategy reranks exactly these, so training and inference can never
disagree on what the candidates are."""

from __future__ import annotations

from collections.abc import Callable

import torch

from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc
from persrag_lightning.retrieval.corpus_retriever import CorpusRetriever

__all__ = ["CandidateSource"]

# user id → [(user id, cosine)], best first
SimilarUsers = Callable[[str], list[tuple[str, float]]]
# user id → e_u for the retriever's user term
UserEmbedding = Callable[[str], "torch.Tensor | None"]
# (queries, q vectors) → the vectors to search
QueryTransform = Callable[[list[Query], torch.Tensor], torch.Tensor]


class CandidateSource:
    """m·k candidates per query with their owner, user similarity and first-stage score."""

    def __init__(self, store: DocStore, retriever: CorpusRetriever, similar_users: SimilarUsers,
                 user_embedding: UserEmbedding, k_per_user: int, query_transform: QueryTransform | None = None
                 ) -> None:
        self.store, self.retriever = store, retriever
        self.similar_users, self.user_embedding = similar_users, user_embedding
        self.k_per_user = k_per_user
        # e.g. PBR's q* (retrieval/pbr_strategy.py); None: q as is
        self.query_transform = query_transform

    @torch.no_grad()
    def propose(self, queries: list[Query]) -> list[list[RetrievedDoc]]:
        """Users by similarity (the query user first, as the official code), each user's docs best
        first; the query user's docs are its own question's profile, other users' their pools
        (data/histories.py)."""
        vectors = self.retriever.query_vectors(
            [q.query for q in queries]
        )  # in the retriever's query runtime
        if self.query_transform is not None:
            vectors = self.query_transform(queries, vectors)
        out = []
        for query, vector in zip(queries, vectors):
            e_u = self.user_embedding(query.user_id)
            if e_u is not None:
                e_u = self.retriever.tuned_user_embedding(query.user_id, e_u)
            score = self.retriever.scorer(vector, e_u)  # the query's side computed once for its users
            docs: list[RetrievedDoc] = []
            for owner, sim in self.similar_users(query.user_id):
                if owner != query.user_id and not self.store.shares(owner):
                    # `share: false`: never a neighbour (similar_users already filters; kept as a
                    # guard)
                    continue
                rows = self.store.rows(owner, query=query)
                scores = score(rows)
                top = torch.topk(scores, min(self.k_per_user, len(rows)))
                docs += [self.store.doc(int(rows[i]), user_sim=sim, retriever_score=float(s))
                         for s, i in zip(top.values, top.indices)]
            out.append(docs)
        return out
