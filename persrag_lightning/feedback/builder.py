"""LLM-feedback labels (CFRAG §4.2.2 Eq. 6, §4.3.2): m·k candidates per example, each alone in a
prompt, scored. With `metric="teacher"` the labels are a trained reranker's scores of the same
candidates instead (no LLM): what a smaller reranker is distilled from
(configs/cfrag_reranker_distilled.yaml).

The labels are cached content-addressed: one folder per fingerprint of everything that changes them,
one JSONL file per chunk of examples written atomically. A killed build resumes from its finished
chunks, and `--shard i --num_shards n` builds the chunks c with c % n == i (Slurm arrays), so any
sharding merges into exactly the single-process result.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from persrag_lightning.data.candidates import Candidate, FeedbackExample
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.feedback_cache import FeedbackCache
from persrag_lightning.data.prompt_store import PROMPT_STORE, PromptStore
from persrag_lightning.data.records import Example, LampDataset
from persrag_lightning.data.splits import user_fold
from persrag_lightning.feedback.settings import CandidateSettings, FeedbackSettings
from persrag_lightning.llm.prompts import PROMPT_VERSION
from persrag_lightning.metrics import score_prediction
from persrag_lightning.models.reranker import PersonalizedReranker
from persrag_lightning.models.user_encoder import UserEncoder
from persrag_lightning.progress import Progress
from persrag_lightning.reading import LLM_READER, Reader, open_reader
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc
from persrag_lightning.retrieval.candidates import CandidateSource
from persrag_lightning.retrieval.corpus_retriever import CorpusRetriever
from persrag_lightning.utils import bundle_digest, fingerprint

__all__ = ["FeedbackBuilder", "feedback_stats"]

log = logging.getLogger(__name__)

FEEDBACK_VERSION = "feedback/v2"  # v2: own docs = the question's profile, others' = their pools


class FeedbackBuilder:
    """Builds, resumes and loads the feedback cache of one configuration."""

    def __init__(self, dataset: LampDataset, corpus: Corpus, retriever: CorpusRetriever,
                 candidates: CandidateSettings, feedback: FeedbackSettings, cache_dir: str | Path) -> None:
        """`retriever`: the opened `candidates.retriever`. `feedback.teacher`: a reranker export
        (stage 3's bundle) whose scores are the labels when feedback.metric is "teacher"; it
        replaces the LLM in the cache key."""
        self.dataset, self.corpus, self.retriever = dataset, corpus, retriever
        self.candidates, self.feedback = candidates, feedback.resolved()
        self.llm_config = self.feedback.llm
        teacher = feedback.teacher
        self.user_encoder_path = Path(candidates.user_encoder)
        if not (self.user_encoder_path / "user_embeddings.safetensors").exists():
            raise FileNotFoundError(
                f"no user-encoder export at {self.user_encoder_path}; make it with "
                "`python train.py fit --config cfrag_user_encoder.yaml` (same --run_name)")
        if (feedback.metric == "teacher") != (teacher is not None):
            raise ValueError(f"feedback.metric 'teacher' and a feedback.teacher reranker go together; got metric "
                             f"{feedback.metric!r} with teacher {teacher!r}")
        self.teacher_path = None if teacher is None else Path(teacher)
        if self.teacher_path is not None and not (self.teacher_path / "config.json").is_file():
            raise FileNotFoundError(
                f"no reranker export at {self.teacher_path} to distil from; make it with "
                "`python train.py fit --config cfrag_reranker.yaml` (same --run_name)"
            )
        # shared with every build and evaluation
        self.prompts = PromptStore(Path(cache_dir) / PROMPT_STORE)
        # the reader of each fold's questions (one, None's, without cross-fitting)
        self.readers: dict[int | None, Reader] = {
            fold: open_reader(spec, self.llm_config, self.prompts) for fold, spec in self.feedback.fold_readers().items()}
        labeller = ({"teacher": bundle_digest(self.teacher_path)} if teacher is not None
                    else self.llm_config.identity() if self.feedback.reader == LLM_READER
                    else [r.identity() for r in self.readers.values()])
        self.key = fingerprint(
            FEEDBACK_VERSION, corpus.digest(), self._examples_digest(), bundle_digest(self.user_encoder_path),
            retriever.identity(), labeller, PROMPT_VERSION, self.settings(), dataset.task)
        self.cache = FeedbackCache(Path(cache_dir) / "feedback" / self.key, feedback.chunk_size)
        self.root = self.cache.root
        self.store = DocStore(dataset, corpus)
        self._user_encoder: UserEncoder | None = None
        self._teacher: PersonalizedReranker | None = None
        # user id → row of the user-encoder export's table
        self._user_row: dict[str, int] | None = None
        # prompts actually sent to the LLM by this builder (after the store and de-duplication)
        self.llm_calls = 0

    def settings(self) -> dict[str, int | str]:
        """What of the two groups changes the labels besides the LLM, the teacher and the retriever
        (in the cache key and its config.json, as the cache has always named them)."""
        cross_fit = {"cross_fit": self.feedback.cross_fit} if self.feedback.cross_fit else {}
        return {"m": self.candidates.m, "k": self.candidates.k, "metric": self.feedback.metric,
                "chunk_size": self.feedback.chunk_size, **cross_fit}

    def _examples_digest(self) -> str:
        h = hashlib.sha256()
        for split in sorted(self.dataset.examples):
            for ex in self.dataset.examples[split]:
                h.update(json.dumps([split, ex.example_id, ex.user_id, ex.input, ex.target, ex.profile]).encode())
        return h.hexdigest()

    # ---- layout ----------------------------------------------------------------------------------

    def examples(self, split: str) -> list[Example]:
        """A split's labelled examples in a stable order (by id), the basis of chunking."""
        if split not in self.dataset.examples:
            raise KeyError(
                f"split {split!r} not in the data (have {sorted(self.dataset.examples)})"
            )
        return sorted((e for e in self.dataset.examples[split] if e.target is not None), key=lambda e: e.example_id)

    def num_examples(self, split: str, limit: int | None = None) -> int:
        n = len(self.examples(split))
        return n if limit is None else min(limit, n)

    def missing_chunks(self, split: str, limit: int | None = None) -> list[int]:
        return self.cache.missing_chunks(split, self.num_examples(split, limit))

    # ---- build -----------------------------------------------------------------------------------

    def build(
        self, split: str, shard: int = 0, num_shards: int = 1, limit: int | None = None
    ) -> int:
        """Build this shard's missing chunks of `split` (first `limit` examples); returns chunks
        written."""
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in [0, {num_shards})")
        todo = [c for c in self.missing_chunks(split, limit) if c % num_shards == shard]
        if not todo:
            return 0
        self.cache.write_config({
            "task": self.dataset.task, "user_encoder": str(self.user_encoder_path), "retriever": self.retriever.spec,
            "llm": asdict(self.llm_config), "reader": self.feedback.reader,
            "teacher": None if self.teacher_path is None else str(self.teacher_path),
            "settings": self.settings(), "prompt_version": PROMPT_VERSION})
        self.retriever.load()
        examples = self.examples(split)
        # the whole build's ETA (chunks take alike)
        bar = Progress(f"feedback {split}", len(todo), "chunks")
        for c in todo:
            chunk = examples[c * self.feedback.chunk_size:(c + 1) * self.feedback.chunk_size]
            records = self.label_chunk(chunk)
            self.cache.write_chunk(split, c, records)
            log.info("feedback %s chunk %d: %d examples", split, c, len(records))
            bar.advance()
        return len(todo)

    @property
    def user_encoder(self) -> UserEncoder:
        if self._user_encoder is None:
            self._user_encoder = UserEncoder.from_pretrained(self.user_encoder_path)
        return self._user_encoder

    @property
    def teacher(self) -> PersonalizedReranker:
        if self._teacher is None:
            self._teacher = PersonalizedReranker.from_pretrained(self.teacher_path).eval()
        return self._teacher

    @torch.inference_mode()
    def teacher_scores(self, flat: list[tuple[Example, RetrievedDoc]]) -> list[float]:
        """The teacher's fp32 scores of (query, candidate) with the query user's e_u, as CFRAG's
        rerank computes them at inference."""
        users = torch.stack([self.e_u(ex.user_id) for ex, _ in flat]) if self.teacher.config.use_user else None
        return self.teacher.score_pairs([ex.query for ex, _ in flat], [self.store.text(d.row) for _, d in flat],
                                        users).float().tolist()

    def e_u(self, user_id: str) -> torch.Tensor:
        """The user's stage-1 embedding (the retriever's user term and the teacher's e_u)."""
        if self._user_row is None:
            self._user_row = {u: i for i, u in enumerate(self.user_encoder.user_ids)}
        if user_id not in self._user_row:
            raise KeyError(
                f"user {user_id!r} is not in the user-encoder export {self.user_encoder_path}; "
                "retrain it on this data"
            )
        return self.user_encoder.user_embeddings[self._user_row[user_id]]

    def candidate_source(self) -> CandidateSource:
        """The first stage CFRAG's inference runs too: top-m users by the stage-1 export, top-k docs
        of each."""
        ue = self.user_encoder
        m, hidden = self.candidates.m, len(self.store.dataset.private)

        def similar(u: str) -> list[tuple[str, float]]:  # `share: false` users are never neighbours
            return self.store.shared_neighbours(u, ue.similar_users(u, m + hidden), m)

        return CandidateSource(self.store, self.retriever, similar, self.e_u, self.candidates.k)

    def label_chunk(self, examples: list[Example]) -> list[FeedbackExample]:
        """The examples' labelled candidates, in order; under cross-fitting each fold's questions are
        read by the reader that held that fold out of its training."""
        if not self.feedback.cross_fit:
            return self.label_with(self.readers[None], examples)
        labelled: dict[str, FeedbackExample] = {}
        for fold, reader in self.readers.items():
            part = [e for e in examples if user_fold(e.user_id, self.feedback.cross_fit) == fold]
            labelled |= {r.example_id: r for r in self.label_with(reader, part)} if part else {}
        return [labelled[e.example_id] for e in examples]

    def label_with(self, reader: Reader, examples: list[Example]) -> list[FeedbackExample]:
        """One reading per candidate (the doc alone, as Eq. 6), by `reader`; a prompt any earlier
        build, shard, stage or run sent to this LLM is read from the shared prompt store, not sent
        again."""
        proposals = self.candidate_source().propose(
            [Query(e.user_id, e.query, e.input, e.example_id) for e in examples])
        task = self.dataset.task
        flat = [(ex, d) for ex, cands in zip(examples, proposals) for d in cands]
        if self.feedback.metric == "teacher":  # no LLM: the teacher reranker's scores
            labels = [("", s) for s in self.teacher_scores(flat)]
            return self._records(examples, flat, labels)
        inputs = [ex.input for ex, _ in flat]
        docs = [self.store.read_docs(Query(ex.user_id, ex.query, ex.input, ex.example_id), [d]) for ex, d in flat]
        misses = self.prompts.misses
        if self.feedback.metric == "gain":
            scores = self.gains(reader, examples, proposals)
            return self._records(examples, flat, [("", s) for s in scores])
        if self.feedback.metric == "loglik":  # eval(y, O) = log p(y | prompt)
            scores = reader.score_targets(task, inputs, docs, [ex.target for ex, _ in flat],
                                          phase="feedback labels")
            labels = [("", float(s)) for s in scores]
        # eval(y, O) = task metric of the reader's answer (generated or chosen, as its settings say)
        else:
            answers = reader.answer(task, inputs, docs, phase="feedback labels")
            labels = [
                (a, score_prediction(task, a, ex.target)) for a, (ex, _) in zip(answers, flat)
            ]
        self.llm_calls += self.prompts.misses - misses
        return self._records(examples, flat, labels)

    def gains(self, reader: Reader, examples: list[Example], proposals: list[list[RetrievedDoc]]) -> list[float]:
        """Each candidate's label under `gain`: log p(y | own docs + candidate) − log p(y | own
        docs), where the own docs are the asker's other own candidates (the user ranks first among
        its m similar users, so its k docs are candidates), best first stage first, read in one call
        per side. The reader still knows the asker's habit on both sides (`ReadDocs`)."""
        inputs, with_doc, targets = [], [], []
        bases: dict[tuple[str, tuple[int, ...]], int] = {}  # each distinct (question, own docs) read once
        base_of, base_reads = [], []
        for ex, cands in zip(examples, proposals):
            query = Query(ex.user_id, ex.query, ex.input, ex.example_id)
            own = sorted((d for d in cands if d.owner == ex.user_id), key=lambda d: -d.retriever_score)
            for d in cands:
                base = [o for o in own if o.row != d.row][:max(0, self.candidates.k - 1)]
                inputs.append(ex.input)
                targets.append(ex.target)
                with_doc.append(self.store.read_docs(query, [*base, d]))
                key = (ex.example_id, tuple(o.row for o in base))
                if key not in bases:
                    bases[key] = len(base_reads)
                    base_reads.append((ex, self.store.read_docs(query, base)))
                base_of.append(bases[key])
        task = self.dataset.task
        plus = reader.score_targets(task, inputs, with_doc, targets, phase="feedback labels")
        minus = reader.score_targets(task, [ex.input for ex, _ in base_reads], [ds for _, ds in base_reads],
                                     [ex.target for ex, _ in base_reads], phase="feedback labels (own docs)")
        return [float(a - minus[i]) for a, i in zip(plus, base_of)]

    @staticmethod
    def _records(examples: list[Example], flat: list[tuple[Example, RetrievedDoc]],
                 labels: list[tuple[str, float]]) -> list[FeedbackExample]:
        by_example: dict[str, list[Candidate]] = {ex.example_id: [] for ex in examples}
        for (ex, d), (output, label) in zip(flat, labels):
            by_example[ex.example_id].append(
                Candidate(d.row, d.doc_id, d.owner, d.user_sim, d.retriever_score, output, label)
            )
        return [FeedbackExample(ex.example_id, ex.user_id, ex.input, ex.query, ex.target,
                                tuple(by_example[ex.example_id])) for ex in examples]

    # ---- load ------------------------------------------------------------------------------------

    def load(
        self, split: str, limit: int | None = None, command_hint: str = ""
    ) -> list[FeedbackExample]:
        """Merge the split's chunks (all must exist) into FeedbackExamples in example-id order."""
        missing = self.missing_chunks(split, limit)
        if missing:
            raise FileNotFoundError(
                f"feedback labels of split {split!r} are missing {len(missing)} chunk(s) under {self.root / split}; "
                f"build them with `persrag feedback {command_hint}` (or run `fit`, whose prepare_data builds them)")
        return self.cache.read(split, self.num_examples(split, limit))


@dataclass
class FeedbackStats:
    examples: int
    candidates_per_example: float
    mean_label: float
    best_label: float
    informative_fraction: float  # examples whose candidates disagree: the labels carry signal
    # candidates from users other than the query user (collaborative share)
    other_user_fraction: float

    def table(self) -> str:
        rows = [
            (k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in asdict(self).items()
        ]
        return "\n".join(
            f"| {k} | {v} |" for k, v in [("statistic", "value"), ("---", "---"), *rows]
        )


def feedback_stats(examples: list[FeedbackExample]) -> FeedbackStats:
    labels = [[c.label for c in e.candidates] for e in examples]
    flat = [x for row in labels for x in row]
    n_cand = sum(len(r) for r in labels)
    other = sum(c.owner != e.user_id for e in examples for c in e.candidates)
    return FeedbackStats(
        examples=len(examples),
        candidates_per_example=n_cand / max(1, len(examples)),
        mean_label=float(np.mean(flat)) if flat else float("nan"),
        best_label=float(np.mean([max(r) for r in labels if r])) if flat else float("nan"),
        informative_fraction=float(np.mean([len(set(r)) > 1 for r in labels]))
        if labels
        else float("nan"),
        other_user_fraction=other / max(1, n_cand),
    )

