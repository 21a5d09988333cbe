"""Serving CFRAG without Lightning: `CFRAGPipeline.from_pretrained("checkpoints/<run>")` loads the
exported bundles (user encoder, retriever, reranker, docstore; with `users="cluster"` the cohort
export of `persrag cluster`) and answers `retrieve`, `generate`, `add_user` and `remove_user`."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from persrag_lightning.data.docstore import history_from_json, read_docstore
from persrag_lightning.data.records import User
from persrag_lightning.data.tasks import get_task
from persrag_lightning.index import index_params
from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.reading import LLM_READER, Reader, open_reader
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.retrieval.cohorts import Assignment
from persrag_lightning.retrieval.user_index import UserIndex
from persrag_lightning.serving.run_bundles import cfrag_from_run, reader_folder
from persrag_lightning.serving.runtimes import all_exported, reader_text_runtime
from persrag_lightning.serving.served import RECORD_SAYS, follow_record, serves_line

__all__ = ["CFRAGPipeline", "Generation"]

@dataclass
class Generation:
    """An answer (as the pipeline's reader gives it), what the reader read and the docs (with
    provenance) it holds."""

    answer: str
    prompt: str
    docs: list[RetrievedDoc]


class CFRAGPipeline:
    """users → docs → rerank → prompt → LLM → post-processed answer, over exported bundles only."""

    def __init__(self, strategy: CFRAG, store: DocStore, llm: LLMConfig | None = None, k: int = 5,
                 threads: int | None = None, reader: str = LLM_READER, reader_doc_vectors: bool = True) -> None:
        """`threads`: torch's intra-op threads while retrieving (restored after), and the threads of
        exported runtimes (onnx, openvino: fixed when they load, here). None: the process's count,
        except that torch retrieves on 1 thread when every encoder of the retrieval runs exported:
        torch then does only small ops, and its idle OpenMP workers, spinning after each, took cores
        from OpenVINO's threads (a lower p95 on dev: docs/serving/pipeline.md). On cores shared with
        other jobs 1 thread was much faster than 2; the count is process-wide while set, so other
        threads of the process running torch meanwhile share it. `reader`: who answers `generate`
        (reading/): `llm` (the `llm` settings' LLM) or a trained reader's export folder.
        `reader_doc_vectors`: a trained reader's text vectors of every stored doc made at load,
        cached under the strategy's cache folder, and of each user's docs as they are attached
        (reading/doc_vectors.py); False: each doc's on the first question that reads it."""
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be a positive number or None, got {threads}")
        self.strategy, self.store, self.k, self.threads = strategy, store, k, threads
        self.task = store.dataset.task
        self.llm_config = llm or LLMConfig()
        self.reader_spec, self.reader_doc_vectors = reader, reader_doc_vectors
        # what is served and why, in a line (from_pretrained says it from the run's record)
        self.serves = f"serving {getattr(strategy, 'name', 'CFRAG')} read by {reader}: as constructed"
        self._llm: LLM | None = None
        self._reader: Reader | None = None
        self._text_encoder: TextEncoder | None = None
        self._precompute = False  # a split reranker's doc states computed for each user added
        with self._torch_threads(threads):
            strategy.prepare(store)
            strategy.warm()
            if reader != LLM_READER:  # opened now: its text encoder's compile is not a question's wait
                self._open_reader()
        self.retrieve_threads = (
            threads if threads is not None else (1 if all_exported(strategy) else None)
        )

    @contextmanager
    def _torch_threads(self, n: int | None):
        """torch's thread count set to `n` for the block (nothing changes with None)."""
        if n is None:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @classmethod
    def from_pretrained(cls, run_dir: str | Path, llm: LLMConfig | None = None, m: int | str | None = RECORD_SAYS,
                        k_per_user: int = 5, k: int = 5, cache_dir: str = ".cache/persrag", users: str = "encoder",
                        cohort_export: str | Path | None = None, rerank_top: int | None = None,
                        reranker_runtime: str = "auto", cache_doc_tokens: bool = True, reader_doc_vectors: bool = True,
                        threads: int | None = None, reranker: str | None = RECORD_SAYS,
                        query_runtime: str = "auto", first_cut: str | None = None,
                        reader: str = RECORD_SAYS, answer_mode: str | None = None,
                        calibration: str | None = None, decision: str | None = None,
                        neighbour_slots: int | str | None = RECORD_SAYS,
                        precompute_doc_states: bool | None = None) -> CFRAGPipeline:
        """Load `run_dir`/{user_encoder, retriever, reranker, docstore}; a missing retriever means
        the untuned encoder. What the run's record (`pipeline.json`, written by `train.py pipeline`)
        says its table's reference row was, chosen on dev, is served by default (serving/served.py):
        the docs' order (`reranker`), the similar users `m` (None: CFRAG's, the paper's 6), the
        neighbour gate (`neighbour_slots`: at most this many of the k docs neighbours'; None: none),
        the reader and the LLM's `answer_mode`, `calibration` and `decision`; an argument given
        explicitly wins (`reranker`, `m`, `neighbour_slots`, `reader`: anything but "record"; the
        others: anything but None). A run without a record serves stage 3's order where its reranker
        is exported (else the first stage's), m = 6, no gate, read by the LLM of `llm`. `serves`
        says which, and why, in one line, printed at load; a second says the float32 GEMM paths taken.

        `users="cluster"` takes the similar users from the cohort export (`cohort_export`, default
        `run_dir`/clusters) as CFRAG's `users: cluster` row of the evaluation does; new users join
        their nearest cohort, nobody is re-clustered. `rerank_top`, `reranker_runtime`,
        `cache_doc_tokens`, `query_runtime`: CFRAG's inference-time settings (retrieval/cfrag.py);
        the serving defaults are what benchmarks/bench_serving.py measured (docs/performance/
        serving.md): docs tokenised once (the same pairs), the cross-encoder and the query encoder
        in the fastest runtime installed (`auto`: `serving_runtime`; a trained reader's encoder
        in the query encoder's); `bf16_if_native`: torch's bf16 autocast where native. Pass
        `reranker_runtime="fp32", query_runtime="fp32", cache_doc_tokens=False` for the evaluation's
        exact CFRAG. `reranker` names the reranker bundle inside `run_dir`, faster students of
        stage 3's included (docs/training/stages.md): "reranker_distilled" (one layer),
        "reranker_split_l5", "reranker_split" (doc states made once per doc; for the whole store at load
        with `precompute_doc_states`, by default with `cache_doc_tokens`); None: the first-stage order.
        `first_cut`: a cheaper reranker bundle choosing the `rerank_top` candidates reranked.
        `reader` (`llm`, a trained reader's bundle or folder), `reader_doc_vectors`: the constructor's."""
        run_dir = Path(run_dir)
        choice = follow_record(run_dir, llm, reranker, reader,
                               {"answer_mode": answer_mode, "calibration": calibration, "decision": decision},
                               m, neighbour_slots)
        strategy = cfrag_from_run(run_dir, choice, users, cohort_export, first_cut, reranker_runtime, query_runtime,
                                  k_per_user=k_per_user, cache_dir=cache_dir, rerank_top=rerank_top,
                                  cache_doc_tokens=cache_doc_tokens)
        pipe = cls(strategy, DocStore(read_docstore(run_dir / "docstore")), choice.llm, k, threads,
                   reader_folder(run_dir, choice.reader), reader_doc_vectors)
        pipe.serves = serves_line(choice, pipe.task, run_dir)
        print(f"[serving] {pipe.serves}\n[serving] {choice.gemm}", file=sys.stderr, flush=True)
        if precompute_doc_states or (precompute_doc_states is None and cache_doc_tokens and pipe.split_models()):
            pipe.precompute_doc_states()
        return pipe

    def precompute_doc_states(self, user_ids: list[str] | None = None) -> int:
        """Compute a split reranker's states of every doc of `user_ids` (None: the whole store, and
        from now on each user attached) now (models/reranker_split.py), so that no query pays for a
        doc's lower layers; returns how many docs were computed. Nothing to do for a reranker that is
        not split."""
        if user_ids is None:
            self._precompute = True
        texts = [self.store.text(r) for r in self._rows(user_ids)]
        with self._torch_threads(self.retrieve_threads):
            return sum(m.precompute_docs(texts) for m in self.split_models())

    def _rows(self, user_ids: list[str] | None = None) -> list[int]:
        """The store's rows of `user_ids` (None: of every user in the store)."""
        if user_ids is None:
            user_ids = [u for u in self.store.corpus.user_ids if u in self.store]
        return [int(r) for u in user_ids for r in self.store.corpus.rows_of(u)]

    def split_models(self) -> list:
        """The split rerankers this pipeline reranks with (the reranker, the first cut)."""
        return [m for m in (self.strategy._reranker, self.strategy._first_cut)
                if m is not None and m.config.split_layer is not None]

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = self.llm_config.load()
        return self._llm

    @property
    def reader(self) -> Reader:
        """Who answers `generate`: the LLM (as `llm` configures it) or the trained reader."""
        return self._reader if self._reader is not None else self._open_reader()

    def _open_reader(self) -> Reader:
        llm = self.llm if self.reader_spec == LLM_READER else None  # the LLM chat answers with too
        self._reader = open_reader(self.reader_spec, self.llm_config, llm=llm)
        runtime, cache_dir = reader_text_runtime(self.strategy), getattr(self.strategy, "cache_dir", None)
        if runtime != "fp32":
            self._reader.use_text_runtime(runtime, cache_dir)
        if self.reader_doc_vectors and self.reader_spec != LLM_READER:  # the LLM reads tokens: nothing to make
            self._reader.prepare_docs(self.task, [self.store.history_doc(r) for r in self._rows()], cache_dir)
        return self._reader

    def retrieve(self, user_id: str, query: str, k: int | None = None) -> list[RetrievedDoc]:
        """Top-k docs for a user's query, with owner, user similarity, retriever and reranker
        scores."""
        return self.retrieve_batch([user_id], [query], k)[0]

    def retrieve_batch(self, user_ids: list[str], queries: list[str], k: int | None = None,
                       example_ids: list[str] | None = None) -> list[list[RetrievedDoc]]:
        """Batched retrieval: queries are embedded together, which is where the throughput comes
        from.

        Args:
            user_ids: who asks each query.
            queries: the task inputs as LaMP writes them.
            k: docs per query (None: the pipeline's `k`).
            example_ids: the LaMP questions the queries are, where the store holds them: each then
                sees its own question's profile, as the evaluation's does (replaying a split); None:
                a new question, which sees the user's whole pool.
        """
        missing = [u for u in user_ids if u not in self.store]
        if missing:
            raise KeyError(f"unknown users {missing[:5]}; add them with add_user(user_id, history)")
        spec = get_task(self.task)
        ids = example_ids if example_ids is not None else [""] * len(user_ids)
        qs = [Query(u, spec.extract_query(q), q, e) for u, q, e in zip(user_ids, queries, ids)]
        with self._torch_threads(self.retrieve_threads):
            return self.strategy.retrieve(qs, k or self.k)

    def generate(self, user_id: str, query: str) -> Generation:
        """`query` is the task input as LaMP writes it (e.g. "Which tag does this movie relate to
        ... description: …")."""
        return self.generate_batch([user_id], [query])[0]

    def generate_batch(self, user_ids: list[str], queries: list[str],
                       example_ids: list[str] | None = None) -> list[Generation]:
        """`generate` for many queries at once; `example_ids` as `retrieve_batch`'s."""
        retrieved = self.retrieve_batch(user_ids, queries, example_ids=example_ids)
        return self.read(user_ids, queries, retrieved, example_ids)

    def read(self, user_ids: list[str], queries: list[str], retrieved: list[list[RetrievedDoc]],
             example_ids: list[str] | None = None) -> list[Generation]:
        """The reader's answers to `queries` over docs already retrieved (the service reads only the
        docs its privacy guard kept), each doc handed over with its provenance (`DocStore.read_docs`).

        Args:
            user_ids: who asks each query.
            queries: the task inputs as LaMP writes them.
            retrieved: each query's docs, in rank order (`retrieve_batch`).
            example_ids: as `retrieve_batch`'s (None: new questions).
        """
        ids = example_ids if example_ids is not None else [""] * len(user_ids)
        docs = [self.store.read_docs(Query(u, "", q, e), ds) for u, q, e, ds in zip(user_ids, queries, ids, retrieved)]
        prompts = self.reader.prompts(self.task, queries, docs)
        answers = self.reader.answer(self.task, queries, docs)
        return [Generation(a, p, ds) for a, p, ds in zip(answers, prompts, retrieved)]

    @torch.no_grad()
    def add_user(self, user_id: str, history: list[dict]) -> None:
        """Make a new user retrievable at once: docs as {id, date, fields}; e_u from the exported
        user encoder over the frozen encoder's doc vectors (the fine-tuned doc table only knows the
        training docs)."""
        self.attach_user(*self.encode_user(user_id, history))

    @torch.no_grad()
    def encode_user(self, user_id: str, history: list[dict],
                    replace: bool = False) -> tuple[User, torch.Tensor, torch.Tensor]:
        """(user, the retriever's doc vectors, e_u) of a new history, computed without changing
        anything, so a caller can persist them before the user becomes visible."""
        user = User(user_id, history_from_json(history))
        if not user.docs:
            raise ValueError(f"user {user_id!r} has an empty history")
        if user_id in self.store and not replace:
            raise ValueError(f"user {user_id!r} already exists")
        spec = get_task(self.task)
        texts = [spec.render_doc(d) for d in user.docs]
        s = self.strategy
        s.retriever.load()
        doc_vectors = s.retriever.encode_docs(texts).float().cpu()
        ue = s.user_encoder
        recent = texts[-ue.config.max_history:]
        vectors = self.text_encoder.encode(recent).unsqueeze(0)
        # a judgments-aware encoder (`label`, `paired`) embeds each doc's label (tag, score) with
        # its text: the new user's judgments enter their embedding as the training users' did
        labels = ue.doc_label_ids(user.docs[-ue.config.max_history:]).unsqueeze(0) if ue.uses_judgments else None
        ue.eval()
        e_u = ue.encode_embeddings(
            vectors, torch.zeros(1, len(recent), dtype=torch.bool), labels
        ).squeeze(0)
        user_vector = e_u if s.user_vector_source() == "encoder" else vectors[0].mean(0)
        return user, doc_vectors, torch.stack([e_u, user_vector])

    @property
    def cohorts(self):
        """The cohort model (`users="cluster"`), else None."""
        return self.strategy._cohort_model

    def cohort_assignment(self, user_vectors: torch.Tensor) -> dict | None:
        """Where a new user (vectors of `encode_user`) will land: the nearest cohort centroid, noise
        policy applied, nothing changed; with the export's fingerprint, so a caller can persist it
        and a restart on the same export reuses it. None without cohorts."""
        if self.cohorts is None:
            return None
        a = self.cohorts.assign(user_vectors[1].float().numpy())
        return {"fingerprint": self.cohorts.data_fingerprint, "label": a.label, "cohort": a.cohort,
                "distance": a.distance}

    def attach_user(self, user: User, doc_vectors: torch.Tensor, user_vectors: torch.Tensor,
                    cohort: dict | None = None, share: bool = True) -> None:
        """Append a user whose vectors are known (encode_user, or a restart reading them back);
        `cohort` is a persisted `cohort_assignment`, reused when it was made on the cohort export
        now loaded. `share: false` is set before the docs are added, so no retrieval ever sees the
        user shared (one step for the caller's lock, not attach-then-hide)."""
        s, ue = self.strategy, self.strategy.user_encoder
        if len(doc_vectors) != len(user.docs):
            raise ValueError(
                f"user {user.user_id!r}: {len(doc_vectors)} doc vectors for {len(user.docs)} docs"
            )
        if not share:
            self.store.set_share(user.user_id, False)
        self.store.add_user(user)
        if self._precompute:
            self.precompute_doc_states([user.user_id])
        if self._reader is not None and self.reader_doc_vectors:  # cached per user: a restart reads them
            self._reader.prepare_docs(self.task, user.docs, getattr(self.strategy, "cache_dir", None))
        s.retriever.load()
        s.retriever.doc_vectors = torch.cat(
            [s.retriever.doc_vectors, doc_vectors.to(s.retriever.doc_vectors)]
        )
        e_u, user_vector = user_vectors[0], user_vectors[1]
        ue.user_ids.append(user.user_id)
        ue.user_embeddings = torch.cat(
            [ue.user_embeddings, e_u.unsqueeze(0).to(ue.user_embeddings)]
        )
        s.user_row[user.user_id] = len(ue.user_ids) - 1
        if self.cohorts is not None:
            # a replaced history: assigned again from its new vector
            self.cohorts.remove([user.user_id])
            given = None
            if cohort is not None and cohort.get("fingerprint") == self.cohorts.data_fingerprint:
                given = Assignment(
                    int(cohort["label"]), int(cohort["cohort"]), float(cohort["distance"])
                )
            self.cohorts.add(user.user_id, user_vector.float().numpy(), given)
            return
        s.user_vectors[user.user_id] = user_vector
        if user.user_id in s.user_index:
            self.rebuild_user_index()
        else:
            s.user_index.add([user.user_id], user_vector.unsqueeze(0))

    @torch.no_grad()
    def remove_user(self, user_id: str) -> None:
        """Forget a user: docs out of the store (rows blanked) and out of the reranker's caches, their
        doc vectors and user embedding zeroed, out of the user index or the cohorts
        (serving/purge.py rewrites the export's files)."""
        s = self.strategy
        rows = self.store.corpus.rows_of(user_id)
        for reranker in (s._reranker, s._first_cut):  # their doc caches: the user's tokens and states
            if reranker is not None:
                reranker.forget_docs([self.store.text(r) for r in rows])
        if self._reader is not None:  # its doc vectors, and the questions it read
            self._reader.forget_docs(self.task, [self.store.history_doc(int(r)) for r in rows])
        self.store.remove_user(user_id)
        s.retriever.load()
        s.retriever.doc_vectors[torch.as_tensor(rows)] = 0
        row = s.user_row.pop(user_id, None)
        if row is not None:
            s.user_encoder.user_embeddings[row] = 0
        if self.cohorts is not None:
            self.cohorts.remove([user_id])
            return
        s.user_vectors.pop(user_id, None)
        self.rebuild_user_index()

    def rebuild_user_index(self) -> None:
        """The user index over the users present, same kind and parameters: a deletion or a replaced
        history rebuilds it (new users are only added). An exact index rebuilds as a copy of the
        vectors; an HNSW one at 1M users takes minutes."""
        s = self.strategy
        if s.user_index is None:  # users="cluster": the cohorts are the index
            return
        ids = [u for u in s.user_vectors if u in self.store]
        s.user_index = UserIndex.build(ids, torch.stack([s.user_vectors[u] for u in ids]),
                                       **index_params(s.user_index.index))

    @property
    def text_encoder(self) -> TextEncoder:
        """The frozen encoder the user encoder's doc table was initialised from."""
        if self._text_encoder is None:
            c = self.strategy.user_encoder.config
            self._text_encoder = TextEncoder.from_pretrained(
                c.text_encoder, c.text_pooling, c.text_max_length
            )
        return self._text_encoder
