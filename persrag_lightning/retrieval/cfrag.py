"""CFRAG inference (paper Fig. 2): top-m users → top-k docs of each by the retriever → reranker →
final top-k.

The switches of `CFRAG` give the paper's Table 3 ablations without separate code paths: w/o user
retrieval (`m=1`), MEAN user embeddings (`users="mean"`), w/o retriever tuning (`retriever` = an
encoder name), w/o the user term in the retriever (`retriever_user_term=False`), w/o reranker tuning
(`reranker=None`: the final k are the best first-stage scores of the m·k), w/o e_u in the reranker
(a reranker trained with `use_user: false`). Beyond the paper: `users="cluster"` takes the similar
users from ClusterRAG's cohorts (seed 002, no training) instead of the encoder's top-m: the query
user and the m − 1 members of their cohort most similar to them — fitted at `prepare`, or read from
`persrag cluster`'s export (`cohort_export`, no re-clustering; serving uses this);
`query_expansion="pbr"` searches the first stage with PBR's personalised query q* (seed 001) instead
of q.

Inference-time settings (for serving latency; the candidates and training never change):
`rerank_top=N` reranks only the N best candidates of the m·k by the first cut (the first stage's
order, or with `first_cut` a cheaper reranker's scores: a cascade), the others follow them in that
order; `reranker_runtime` runs the cross-encoder in int8, bf16, ONNX Runtime or OpenVINO
(models/reranker.py); `cache_doc_tokens` tokenises each doc once; `query_runtime` embeds the query
in bf16 autocast, ONNX Runtime or OpenVINO (retrieval/corpus_retriever.py; the doc vectors stay as
cached). The defaults are the paper's (every candidate reranked, fp32); benchmarks/bench_serving.py
measures each against them, and `CFRAGPipeline.from_pretrained` serves with the winners.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Literal

import torch

from persrag_lightning.bundles import require_bundle
from persrag_lightning.models.corpus_embeddings import build_corpus_embeddings, load_corpus_embeddings
from persrag_lightning.models.exported import EXPORTED_RUNTIMES, export_path
from persrag_lightning.models.reranker import PersonalizedReranker, Runtime
from persrag_lightning.models.user_encoder import UserEncoder
from persrag_lightning.progress import Progress
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy, cache_value
from persrag_lightning.retrieval.candidates import CandidateSource
from persrag_lightning.retrieval.cfrag_inference import InferenceSettings, QueryRuntime, first_stage_order
from persrag_lightning.retrieval.cohort_settings import CohortSettings
from persrag_lightning.retrieval.cohorts import CohortModel
from persrag_lightning.retrieval.corpus_retriever import open_corpus_retriever
from persrag_lightning.retrieval.pbr_strategy import PBRExpansion, PBRQueryExpansion
from persrag_lightning.retrieval.user_index import UserIndex
from persrag_lightning.utils import ConfigError, bundle_digest

log = logging.getLogger(__name__)

__all__ = ["CFRAG", "first_stage_order"]

UserSource = Literal["encoder", "mean", "cluster"]
QueryExpansion = Literal["none", "pbr"]


class CFRAG(Strategy):
    """Collaborative retrieval: users by the contrastive user encoder (the paper; `users="mean"`:
    MEAN doc embeddings; `users="cluster"`: cohort neighbours, clustered as `cohorts` says — default
    the seed's HDBSCAN over MEAN vectors), docs by the personalized retriever. The defaults are the
    paper's pipeline; the switches give its Table 3 ablations and the inference-time settings of the
    module docstring.

    Args:
        user_encoder: stage 1's export, which finds the similar users.
        retriever: the first stage: stage 2's export, or an encoder name (`minilm`, any Hugging Face
            name or folder) for the ablation w/o retriever tuning.
        reranker: stage 3's export; None ranks by the first-stage scores (the ablation w/o reranker
            tuning).
        m: similar users, the query user included (the paper's m = 6 with the user); 1 = w/o user
            retrieval.
        k_per_user: docs retrieved from each similar user, so m·k_per_user candidates (the paper's k
            = 5).
        users: how similar users are found: `encoder` (the paper's contrastive user encoder), `mean`
            (MEAN doc embeddings, an ablation) or `cluster` (ClusterRAG's cohort neighbours, no
            training).
        retriever_user_term: keep the user term α·cos(MLP1(e_u), d) of Eq. 5; False is the ablation
            w/o it.
        cache_dir: where corpus embeddings and inference artefacts are cached, keyed by
            fingerprints.
        name: the strategy's row name in the evaluation's table and cache keys.
        batch_size: queries retrieved and reranked per call.
        cohorts: how users become cohorts with `users: cluster` (None = the seed's HDBSCAN over MEAN
            vectors); only with `users: cluster`.
        query_expansion: `none` searches the first stage with the query q; `pbr` with PBR's
            personalised query q* (seed 001).
        pbr: the settings of `query_expansion: pbr` (variant, PBR settings, P-PRF LLM); None:
            PBRExpansion().
        cohort_export: (users="cluster" only) a `persrag cluster` export (`<run>/clusters`) read
            instead of fitting the cohorts; its own settings apply, so `cohorts` must then be left
            out.
        rerank_top: rerank only the N best candidates by the first cut, the rest follow in that
            order; None reranks all m·k (the paper).
        reranker_runtime: how the cross-encoder runs: `fp32` (as trained, the paper), `int8`,
            `bf16`, `onnx` or `openvino` (models/reranker.py).
        cache_doc_tokens: tokenise each doc once and reuse its tokens (the same pairs token for
            token).
        query_runtime: how the query is embedded: `fp32`, `bf16` autocast, `onnx` or `openvino`; the
            doc vectors stay as cached.
        first_cut: a cheaper reranker's export (e.g. the distilled one) whose scores choose the
            `rerank_top` candidates (a cascade); None: the first stage's order. Needs `reranker` and
            `rerank_top`.
        neighbour_slots: the gate: at most this many of the k docs may be neighbours', the rest
            the asker's own best (0 shuts it: own docs only, in this chain's order); None: no gate
            (the paper).
    """

    def __init__(self, user_encoder: str, retriever: str = "minilm", reranker: str | None = None, m: int = 6,
                 k_per_user: int = 5, users: UserSource = "encoder", retriever_user_term: bool = True,
                 cache_dir: str = ".cache/persrag", name: str = "CFRAG", batch_size: int = 64,
                 cohorts: CohortSettings | None = None, query_expansion: QueryExpansion = "none",
                 pbr: PBRExpansion | None = None, cohort_export: str | None = None, rerank_top: int | None = None,
                 reranker_runtime: Runtime = "fp32", cache_doc_tokens: bool = False,
                 query_runtime: QueryRuntime = "fp32",
                 first_cut: str | None = None, neighbour_slots: int | None = None) -> None:
        if users not in ("encoder", "mean", "cluster"):
            raise ValueError(f"users must be encoder, mean or cluster, got {users!r}")
        if cohorts is not None and users != "cluster":
            raise ValueError(
                f"cohorts settings apply only to users='cluster' (got users={users!r})"
            )
        if cohort_export is not None and (users != "cluster" or cohorts is not None):
            raise ValueError("cohort_export applies only to users='cluster', without cohorts settings (the export "
                             f"carries its own); got users={users!r}, cohorts={cohorts!r}")
        self.name = name
        self.query_expansion, self.pbr = query_expansion, pbr or PBRExpansion()
        self.user_encoder_path = user_encoder
        self.retriever_spec = retriever
        self.reranker_path = reranker
        self.m, self.k_per_user, self.users = m, k_per_user, users
        self.cohort_settings = cohorts or CohortSettings()  # read only with users="cluster"
        self.cohort_export = None if cohort_export is None else str(cohort_export)
        self.inference = InferenceSettings(
            rerank_top, first_cut, reranker_runtime, query_runtime, cache_doc_tokens
        )
        if first_cut is not None and (rerank_top is None or reranker is None):
            raise ValueError(
                "first_cut chooses the rerank_top candidates the reranker scores: it needs a reranker "
                f"and rerank_top (got reranker={reranker!r}, rerank_top={rerank_top!r})"
            )
        # fitted by prepare when users="cluster" (runtime state)
        self._cohort_model: CohortModel | None = None
        self._reranker = self._first_cut = None  # loaded by prepare (runtime state)
        self.retriever_user_term = retriever_user_term
        self.cache_dir = cache_dir
        self.batch_size = batch_size
        if neighbour_slots is not None and neighbour_slots < 0:
            raise ValueError(f"neighbour_slots must be None or at least 0, got {neighbour_slots}")
        self.neighbour_slots = neighbour_slots

    def prepare(self, store: DocStore) -> None:
        super().prepare(store)
        self.user_encoder = UserEncoder.from_pretrained(require_bundle(self.user_encoder_path))
        self.user_row = {u: i for i, u in enumerate(self.user_encoder.user_ids)}
        self._unseen: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self._frozen_docs: torch.Tensor | None = None
        if self.users == "cluster":
            self._cohort_model = (
                self._load_cohorts(store) if self.cohort_export is not None else None
            )
            if self._cohort_model is None:
                ids, vectors = self._user_vectors(store, self.cohort_settings.user_vectors)
                self._cohort_model = CohortModel(self.cohort_settings).fit(
                    ids, vectors.float().numpy()
                )
            self.user_index = None
        else:
            self.user_index = self._build_user_index(store)
        try:
            self.retriever = open_corpus_retriever(
                self.retriever_spec, store.corpus, self.cache_dir
            )
        except FileNotFoundError:
            require_bundle(self.retriever_spec)  # a bundle not trained yet: the command that makes it
            raise
        self.retriever.prepare()
        self.retriever.load()
        self.retriever.use_query_runtime(self.inference.query_runtime, self.cache_dir)
        e_u = self.e_u if self.retriever_user_term else lambda _: None
        expansion = (PBRQueryExpansion(store, self.retriever, self.pbr)
                     if self.query_expansion == "pbr" else None)
        self.source = CandidateSource(
            store, self.retriever, self.similar_users, e_u, self.k_per_user, expansion
        )
        self._reranker = self._load_reranker(self.reranker_path) if self.reranker_path else None
        first_cut = self.inference.first_cut
        self._first_cut = self._load_reranker(first_cut) if first_cut is not None else None

    def cache_config(self) -> dict:
        """What identifies this CFRAG's retrievals: the bundles it reads (by digest), m, k and the
        ablation switches; with users="cluster" the cohort export (by digest) when one is read, else
        the cohort settings; and the inference settings that differ from the paper's
        (`InferenceSettings.cache_key`), so a row that uses none of these keeps the key it had
        before they existed. Read before `prepare` or after, the key is the same."""
        values: dict = {"query_expansion": self.query_expansion, "pbr": self.pbr,
                        "user_encoder_path": self.user_encoder_path, "retriever_spec": self.retriever_spec,
                        "reranker_path": self.reranker_path, "m": self.m, "k_per_user": self.k_per_user,
                        "users": self.users, "retriever_user_term": self.retriever_user_term}
        if self.neighbour_slots is not None:  # a row without the gate keeps its key
            values["neighbour_slots"] = self.neighbour_slots
        # its own settings apply (prepare reads them into cohort_settings)
        if self.cohort_export is not None:
            values["cohort_export"] = self.cohort_export
        elif self.users == "cluster":
            values["cohort_settings"] = self.cohort_settings
        return {key: cache_value(value) for key, value in {**values, **self.inference.cache_key()}.items()}

    def use_reranker_runtime(self, runtime: str) -> None:
        if self.reranker_path and self.inference.reranker_runtime == "fp32":
            self.inference = replace(self.inference, reranker_runtime=runtime)

    def _load_reranker(self, path: str) -> PersonalizedReranker:
        """A reranker bundle in the reranker runtime (an export made once per bundle content, read
        by later processes) and with the doc-token cache as set."""
        runtime = self.inference.reranker_runtime
        model = PersonalizedReranker.from_pretrained(require_bundle(path)).eval()
        if runtime in EXPORTED_RUNTIMES and model.config.split_layer is not None:
            from persrag_lightning.hardware import native_runtime

            # its two passes run in torch: bf16 where this CPU computes it natively, as the serving default
            runtime = native_runtime("bf16_if_native")
            log.info("%s: a split reranker (split_layer %d) runs in torch, %s", path, model.config.split_layer,
                     runtime)
        onnx = export_path(self.cache_dir, "reranker", bundle_digest(path)) if runtime in EXPORTED_RUNTIMES else None
        return model.for_inference(runtime, onnx).cache_doc_tokens(self.inference.cache_doc_tokens)

    def _load_cohorts(self, store: DocStore) -> CohortModel:
        """The cohort export, its settings taking over; users of the store it does not hold (a run
        exported after the clustering, users added since) join their nearest cohort as `add` places
        a new user — nobody is re-clustered. MEAN vectors must come from the encoder the export was
        clustered with."""
        model = CohortModel.load(self.cohort_export)
        self.cohort_settings = model.settings
        c = self.user_encoder.config
        if model.settings.user_vectors == "mean" and model.encoder and model.encoder != c.text_encoder:
            raise ConfigError(
                f"{self.cohort_export}: cohorts of MEAN vectors by {model.encoder!r}, but this run's "
                f"text encoder is {c.text_encoder!r}; re-run `persrag cluster --encoder "
                f"{c.text_encoder}` (same --run_name)"
            )
        missing = [u for u in store.corpus.user_ids if u in store and u not in model]
        if missing:
            ids, vectors = self._user_vectors(store, model.settings.user_vectors)
            row = {u: i for i, u in enumerate(ids)}
            for u in missing:
                if u in row:
                    model.add(u, vectors[row[u]].float().numpy())
        return model

    def user_vector_source(self) -> str:
        """What a user's vector is for finding similar users: the encoder's e_u or the MEAN of doc
        vectors."""
        return self.cohort_settings.user_vectors if self.users == "cluster" else self.users

    def _build_user_index(self, store: DocStore) -> UserIndex:
        """Cosine index over user vectors: the trained encoder's table — its exported users.faiss,
        loaded, not rebuilt, when it holds exactly the table's users — or MEAN of frozen doc
        embeddings (built, kind "auto")."""
        ids, vectors = self._user_vectors(store, self.users)
        self.user_vectors = dict(zip(ids, vectors))
        exported = self.user_encoder._index
        if self.users == "encoder" and exported is not None and exported.ntotal == len(ids):
            return UserIndex.wrap(exported, ids)
        return UserIndex.build(ids, vectors, "auto")

    def _frozen_doc_vectors(self, store: DocStore) -> torch.Tensor:
        """The store's corpus embedded by stage 1's frozen text encoder (built once in the cache,
        read from it again only when serving has added rows since)."""
        if self._frozen_docs is None or len(self._frozen_docs) < len(store.corpus.docs):
            c = self.user_encoder.config
            args = (c.text_encoder, c.text_max_length, c.text_pooling)
            build_corpus_embeddings(store.corpus, self.cache_dir, *args)
            self._frozen_docs = load_corpus_embeddings(self.cache_dir, store.corpus, *args)
        return self._frozen_docs

    def _user_vectors(self, store: DocStore, source: str) -> tuple[list[str], torch.Tensor]:
        """(ids, vectors): the encoder's user table, or MEAN of the frozen doc embeddings of each
        user's pool."""
        if source == "encoder":
            ids, vectors = list(self.user_encoder.user_ids), self.user_encoder.user_embeddings
        else:
            c = self.user_encoder.config
            docs = self._frozen_doc_vectors(store)
            # private: own only
            ids = store.pool_users() + sorted(u for u in store.dataset.private if u in store)
            vectors = torch.stack([docs[store.rows(u, c.max_history) if store.shares(u)
                                        else store.corpus.rows_of(u, c.max_history)].mean(0) for u in ids])
        return ids, vectors

    def e_u(self, user_id: str) -> torch.Tensor | None:
        """The user's stage-1 embedding: its row of the encoder's table, or for a user the table
        lacks, the encoder's Eq. 1 over the user's own history (`_unseen_vectors`); None for a user
        with no history."""
        row = self.user_row.get(user_id)
        if row is not None:
            return self.user_encoder.user_embeddings[row]
        return self._unseen_vectors(user_id)[0]

    @torch.inference_mode()
    def _unseen_vectors(self, user_id: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(e_u, the vector that finds similar users) of a user the encoder's table lacks.

        On a real log a user whose items are all in their own dev or test profiles has no
        collaborative pool, so stage 1 trained no row for them. The trained encoder embeds their own
        visible history (the question's profile, strictly older) from the frozen doc vectors, as
        `CFRAGPipeline.encode_user` embeds a new user when serving; computed once per user.
        """
        if user_id not in self._unseen:
            ue, store = self.user_encoder, self.store
            rows = store.corpus.rows_of(user_id, ue.config.max_history) if user_id in store else []
            if not len(rows):
                self._unseen[user_id] = (None, None)
                return self._unseen[user_id]
            vectors = self._frozen_doc_vectors(store)[rows].float().unsqueeze(0)
            labels = (ue.doc_label_ids([store.corpus.docs[r] for r in rows]).unsqueeze(0)
                      if ue.uses_judgments else None)
            ue.eval()
            pad = torch.zeros(1, len(rows), dtype=torch.bool)
            e_u = ue.encode_embeddings(vectors, pad, labels).squeeze(0)
            by_encoder = self.user_vector_source() == "encoder"
            self._unseen[user_id] = (e_u, e_u if by_encoder else vectors[0].mean(0))
        return self._unseen[user_id]

    def warm(self) -> None:
        """The query encoder's shapes of one query at every width and the exported models for
        batches (queries, the rerankers' pairs) compiled now, in a runtime with static shapes, so
        that no served query waits for a compile."""
        self.retriever.warm_query_shapes()
        for reranker in (self._reranker, self._first_cut):
            if reranker is not None:
                reranker.warm()

    def similar_users(self, user_id: str) -> list[tuple[str, float]]:
        """Top-m users for `user_id` (the user included, as the official code); m = 1 is the user
        alone."""
        if self.m == 1:
            return [(user_id, 1.0)]
        known = self._cohort_model if self._cohort_model is not None else self.user_index
        hidden = len(self.store.dataset.private) + max(
            0, len(known or ()) - self.store.corpus.num_users
        )
        # the user, then the m − 1 most similar members of its cohort
        if self._cohort_model is not None:
            # no pool (MEAN) or no trained vector: the user alone
            if user_id not in self._cohort_model:
                return [(user_id, 1.0)]
            ranked = [(user_id, 1.0)] + [
                (n.user_id, n.similarity)
                for n in self._cohort_model.neighbours(user_id, self.m - 1 + hidden)
            ]
        else:
            vector = self.user_vectors.get(user_id)
            # not in the index: a user the encoder's table lacks (`_unseen_vectors`)
            unseen = vector is None
            if unseen and (vector := self._unseen_vectors(user_id)[1]) is None:
                return [(user_id, 1.0)]
            scores, ids = self.user_index.search(vector.unsqueeze(0), self.m + hidden)
            ranked = [(user_id, 1.0)] * unseen + list(zip(ids[0], (float(s) for s in scores[0])))
        return self.store.shared_neighbours(user_id, ranked, self.m)

    def candidates(self, queries: list[Query]) -> list[list[RetrievedDoc]]:
        """The m·k candidates per query with user similarity and first-stage (Eq. 5 or Eq. 3)
        scores."""
        return self.source.propose(queries)

    @torch.inference_mode()
    def rerank(
        self, queries: list[Query], candidates: list[list[RetrievedDoc]], k: int
    ) -> list[list[RetrievedDoc]]:
        """The final k of each query's m·k candidates: the reranker's order (Eq. 10), every pair of
        the batch of queries scored in one call; without a reranker, the first-stage order (Table 3,
        w/o reranker tuning). With `rerank_top` = N only the N best candidates by the first cut are
        reranked (kept in candidate order, so N ≥ m·k is exactly the full rerank); the rest follow
        them in the first cut's order, without a reranker score. The first cut is the first stage's
        order, or the scores of the `first_cut` reranker (a cheaper one, e.g. the distilled
        reranker) over all m·k."""
        if self._reranker is None:
            return [[docs[i] for i in first_stage_order(docs)[:k]] for docs in candidates]
        top = self.inference.rerank_top
        if top is None:
            order = chosen = [list(range(len(docs))) for docs in candidates]
        else:
            if self._first_cut is None:
                order = [first_stage_order(docs) for docs in candidates]
            else:
                every = [list(range(len(docs))) for docs in candidates]
                order = [torch.argsort(s, descending=True, stable=True).tolist()
                         for s in self._score(self._first_cut, queries, candidates, every)]
            chosen = [sorted(o[:top]) for o in order]
        out = []
        for docs, idx, ranked_by_cut, own in zip(
            candidates, chosen, order, self._score(self._reranker, queries, candidates, chosen)
        ):
            best = [idx[i] for i in torch.argsort(own, descending=True, stable=True)[:k].tolist()]
            score = dict(zip(idx, own.tolist()))
            ranked = [
                RetrievedDoc(**{**docs[i].__dict__, "reranker_score": score[i]}) for i in best
            ]
            if len(ranked) < k:  # fewer reranked than k: the best of the rest by the first cut
                kept = set(idx)
                ranked += [docs[i] for i in ranked_by_cut if i not in kept][:k - len(ranked)]
            out.append(ranked)
        return out

    def _score(self, model: PersonalizedReranker, queries: list[Query], candidates: list[list[RetrievedDoc]],
               chosen: list[list[int]]) -> list[torch.Tensor]:
        """`model`'s scores (Eq. 10) of the chosen candidates of each query, every pair of the batch
        in one call (score_pairs encodes them in chunks of similar token length,
        models/common.py)."""
        pairs = [(q, docs[i]) for q, docs, idx in zip(queries, candidates, chosen) for i in idx]
        if not pairs:
            return [torch.zeros(0) for _ in queries]
        texts = [self.store.text(d.row) for _, d in pairs]
        users = (
            torch.stack([self.e_u(q.user_id) for q, _ in pairs]) if model.config.use_user else None
        )
        scores = model.score_pairs([q.query for q, _ in pairs], texts, users).float().cpu()
        return list(torch.split(scores, [len(idx) for idx in chosen]))

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        """Top-k per query, `batch_size` queries at a time; a long run (a reranking row of the
        evaluation) prints progress lines with an ETA."""
        out = []
        bar = Progress(f"retrieve {self.name}", len(queries), "queries", final="if_long")
        for start in range(0, len(queries), self.batch_size):
            chunk = queries[start:start + self.batch_size]
            every = k if self.neighbour_slots is None else self.m * self.k_per_user
            out += self.gate(chunk, self.rerank(chunk, self.candidates(chunk), every), k)
            bar.advance(len(chunk))
        return out

    def gate(self, queries: list[Query], ranked: list[list[RetrievedDoc]], k: int) -> list[list[RetrievedDoc]]:
        """The first k of each ranking with at most `neighbour_slots` neighbours' docs (the asker's
        own fill the other slots, in the same order); without a gate, the rankings as they are."""
        if self.neighbour_slots is None:
            return ranked
        out = []
        for q, docs in zip(queries, ranked):
            theirs = [d for d in docs if d.owner != q.user_id][:self.neighbour_slots]
            keep = {id(d) for d in theirs}
            out.append([d for d in docs if d.owner == q.user_id or id(d) in keep][:k])
        return out
