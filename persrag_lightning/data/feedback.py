"""LLM-feedback labels (CFRAG §4.2.2 Eq. 6, §4.3.2): m·k candidates per example, each alone in a prompt, scored.

The labels are cached content-addressed: one folder per fingerprint of everything that changes them, one JSONL
file per chunk of examples written atomically. A killed build resumes from its finished chunks, and
`--shard i --num-shards n` builds the chunks c with c % n == i (Slurm arrays), so any sharding merges into
exactly the single-process result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from persrag_lightning.data.candidates import Candidate, FeedbackExample
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.records import Example, HistoryDoc, LampDataset
from persrag_lightning.llm.base import LLM, LLMBackendError, load_llm, resolve_model
from persrag_lightning.llm.postprocess import default_max_new_tokens, postprocess
from persrag_lightning.llm.prompts import PROMPT_VERSION, build_prompt
from persrag_lightning.metrics import score_prediction
from persrag_lightning.models.user_encoder import UserEncoder
from persrag_lightning.retrieval.corpus_retriever import CorpusRetriever
from persrag_lightning.utils import atomic_open, atomic_write_json, bundle_digest, fingerprint

log = logging.getLogger(__name__)

FeedbackMetric = Literal["task", "loglik"]
FEEDBACK_VERSION = "feedback/v1"


@dataclass
class LLMConfig:
    """Which LLM labels the candidates; `options` go to the backend (e.g. base_url, n_threads, device)."""

    backend: str = "hf"
    model: str = "smollm2"
    batch_size: int = 16
    max_new_tokens: int | None = None  # None: the task's short default (8 tokens for labels, 40 for titles)
    max_prompt_tokens: int = 512
    options: dict = field(default_factory=dict)

    def identity(self) -> dict:
        """What changes the LLM's answers, without loading it (a local model's weights digest included)."""
        try:
            digest = resolve_model(self.model).digest
        except LLMBackendError:
            digest = ""  # a served model (openai backend) is named by the server
        output_options = {k: v for k, v in self.options.items() if k not in ("base_url", "timeout", "n_threads")}
        return {"backend": self.backend, "model": self.model, "digest": digest, "options": output_options,
                "max_new_tokens": self.max_new_tokens, "max_prompt_tokens": self.max_prompt_tokens}

    def load(self) -> LLM:
        return load_llm(self.backend, self.model, batch_size=self.batch_size, **self.options)


@dataclass
class FeedbackSettings:
    """m users (the query user included, as the official code) × k docs each; eval = task metric or log-lik."""

    m: int = 6
    k: int = 5
    metric: FeedbackMetric = "task"
    chunk_size: int = 32


class FeedbackBuilder:
    """Builds, resumes and loads the feedback cache of one configuration."""

    def __init__(self, dataset: LampDataset, corpus: Corpus, user_encoder: str | Path,
                 retriever: CorpusRetriever, llm: LLMConfig, settings: FeedbackSettings,
                 cache_dir: str | Path) -> None:
        self.dataset, self.corpus, self.retriever, self.llm_config = dataset, corpus, retriever, llm
        self.settings = settings
        self.user_encoder_path = Path(user_encoder)
        if not (self.user_encoder_path / "user_embeddings.safetensors").exists():
            raise FileNotFoundError(
                f"no user-encoder export at {self.user_encoder_path}; make it with "
                "`python train.py fit --config cfrag_user_encoder.yaml` (same --run_name)")
        self.key = fingerprint(
            FEEDBACK_VERSION, corpus.digest(), self._examples_digest(), bundle_digest(self.user_encoder_path),
            retriever.identity(), llm.identity(), PROMPT_VERSION, asdict(settings), dataset.task)
        self.root = Path(cache_dir) / "feedback" / self.key
        self._user_encoder: UserEncoder | None = None
        self._llm: LLM | None = None
        self.llm_calls = 0  # prompts actually sent to the LLM by this builder (after de-duplication)

    def _examples_digest(self) -> str:
        h = hashlib.sha256()
        for split in sorted(self.dataset.examples):
            for ex in self.dataset.examples[split]:
                h.update(json.dumps([split, ex.example_id, ex.user_id, ex.input, ex.target]).encode())
        return h.hexdigest()

    # ---- layout ------------------------------------------------------------------------------------------------

    def examples(self, split: str) -> list[Example]:
        """A split's labelled examples in a stable order (by id), the basis of chunking."""
        if split not in self.dataset.examples:
            raise KeyError(f"split {split!r} not in the data (have {sorted(self.dataset.examples)})")
        return sorted((e for e in self.dataset.examples[split] if e.target is not None), key=lambda e: e.example_id)

    def num_chunks(self, split: str, limit: int | None = None) -> int:
        n = len(self.examples(split)) if limit is None else min(limit, len(self.examples(split)))
        return math.ceil(n / self.settings.chunk_size)

    def chunk_path(self, split: str, chunk: int) -> Path:
        return self.root / split / f"chunk-{chunk:05d}.jsonl"

    def missing_chunks(self, split: str, limit: int | None = None) -> list[int]:
        return [c for c in range(self.num_chunks(split, limit)) if not self.chunk_path(split, c).exists()]

    # ---- build ---------------------------------------------------------------------------------------------------

    def build(self, split: str, shard: int = 0, num_shards: int = 1, limit: int | None = None) -> int:
        """Build this shard's missing chunks of `split` (first `limit` examples); returns chunks written."""
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in [0, {num_shards})")
        todo = [c for c in self.missing_chunks(split, limit) if c % num_shards == shard]
        if not todo:
            return 0
        atomic_write_json(self.root / "config.json", {
            "task": self.dataset.task, "user_encoder": str(self.user_encoder_path), "retriever": self.retriever.spec,
            "llm": asdict(self.llm_config), "settings": asdict(self.settings), "prompt_version": PROMPT_VERSION})
        self.retriever.load()
        examples = self.examples(split)
        memo: dict = {}  # prompt → answer (or (prompt, target) → log-lik) across this call's chunks
        for c in todo:
            chunk = examples[c * self.settings.chunk_size:(c + 1) * self.settings.chunk_size]
            records = self.label_chunk(chunk, memo)
            with atomic_open(self.chunk_path(split, c)) as f:
                for rec in records:
                    f.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")
            log.info("feedback %s chunk %d: %d examples", split, c, len(records))
        return len(todo)

    @property
    def user_encoder(self) -> UserEncoder:
        if self._user_encoder is None:
            self._user_encoder = UserEncoder.from_pretrained(self.user_encoder_path)
        return self._user_encoder

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = self.llm_config.load()
        return self._llm

    def propose(self, examples: list[Example]) -> list[list[tuple[int, str, float, float]]]:
        """(row, owner, user_sim, first_stage) of the m·k candidates per example, users by similarity."""
        ue = self.user_encoder
        user_index = self.corpus.user_index()
        table_row = {u: i for i, u in enumerate(ue.user_ids)}
        queries = self.retriever.query_vectors([e.query for e in examples])
        out = []
        for ex, q in zip(examples, queries):
            if ex.user_id not in table_row:
                raise KeyError(f"user {ex.user_id!r} of example {ex.example_id!r} is not in the user-encoder "
                               f"export {self.user_encoder_path}; retrain it on this data")
            e_u = ue.user_embeddings[table_row[ex.user_id]]
            candidates = []
            for owner, sim in ue.similar_users(ex.user_id, self.settings.m):
                rows = self.corpus.user_rows(user_index[owner])
                scores = self.retriever.score(q, rows, e_u)
                top = torch.topk(scores, min(self.settings.k, len(rows)))
                candidates += [(int(rows[i]), owner, sim, float(s)) for s, i in zip(top.values, top.indices)]
            out.append(candidates)
        return out

    def history_doc(self, row: int, owner: str) -> HistoryDoc:
        start = int(self.corpus.offsets[self.corpus.user_index()[owner]])
        return self.dataset.users[owner].docs[row - start]

    def label_chunk(self, examples: list[Example], memo: dict) -> list[FeedbackExample]:
        """One prompt per candidate (the doc alone, as Eq. 6); identical prompts go to the LLM once."""
        proposals = self.propose(examples)
        task, count = self.dataset.task, self.llm.count_tokens
        prompts = [[build_prompt(task, ex.input, [self.history_doc(row, owner)], count,
                                 self.llm_config.max_prompt_tokens) for row, owner, _, _ in cands]
                   for ex, cands in zip(examples, proposals)]
        if self.settings.metric == "loglik":  # eval(y, O) = log p(y | prompt): keyed by (prompt, target)
            todo = sorted({(p, ex.target) for ex, ps in zip(examples, prompts) for p in ps} - memo.keys())
            if todo:
                scores = self.llm.score([p for p, _ in todo], [t for _, t in todo])
                memo.update({key: ("", float(s)) for key, s in zip(todo, scores)})
            label = lambda p, ex: memo[(p, ex.target)]
        else:  # eval(y, O) = task metric of the post-processed answer: keyed by prompt
            todo = sorted({p for ps in prompts for p in ps} - memo.keys())
            if todo:
                budget = self.llm_config.max_new_tokens or default_max_new_tokens(task)
                memo.update(zip(todo, (postprocess(task, o) for o in self.llm.generate(todo, budget))))
            label = lambda p, ex: (memo[p], score_prediction(task, memo[p], ex.target))
        self.llm_calls += len(todo)
        records = []
        for ex, cands, ps in zip(examples, proposals, prompts):
            cs = tuple(Candidate(row, self.corpus.doc_ids[row], owner, sim, first, *label(p, ex))
                       for (row, owner, sim, first), p in zip(cands, ps))
            records.append(FeedbackExample(ex.example_id, ex.user_id, ex.input, ex.query, ex.target, cs))
        return records

    # ---- load ----------------------------------------------------------------------------------------------------

    def load(self, split: str, limit: int | None = None, command_hint: str = "") -> list[FeedbackExample]:
        """Merge the split's chunks (all must exist) into FeedbackExamples in example-id order."""
        missing = self.missing_chunks(split, limit)
        if missing:
            raise FileNotFoundError(
                f"feedback labels of split {split!r} are missing {len(missing)} chunk(s) under {self.root / split}; "
                f"build them with `persrag feedback {command_hint}` (or run `fit`, whose prepare_data builds them)")
        out: list[FeedbackExample] = []
        for c in range(self.num_chunks(split, limit)):
            path = self.chunk_path(split, c)
            for line_no, line in enumerate(path.read_text().splitlines(), 1):
                try:
                    out.append(FeedbackExample.from_json(json.loads(line)))
                except (json.JSONDecodeError, TypeError, KeyError) as err:
                    raise ValueError(f"{path}: line {line_no}: corrupt feedback record ({err}); delete the file "
                                     "and rebuild") from err
        return out[:limit] if limit is not None else out


@dataclass
class FeedbackStats:
    examples: int
    candidates_per_example: float
    mean_label: float
    best_label: float
    informative_fraction: float  # examples whose candidates disagree: the labels carry signal
    other_user_fraction: float   # candidates from users other than the query user (collaborative share)

    def table(self) -> str:
        rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in asdict(self).items()]
        return "\n".join(f"| {k} | {v} |" for k, v in [("statistic", "value"), ("---", "---"), *rows])


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
        informative_fraction=float(np.mean([len(set(r)) > 1 for r in labels])) if labels else float("nan"),
        other_user_fraction=other / max(1, n_cand),
    )

