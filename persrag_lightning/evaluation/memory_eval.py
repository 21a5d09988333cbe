"""What remembered facts add, counted: simulated conversations plant facts in the memory bank
(memory/simulate.py), then each strategy answers the later questions about them (`MemoryEvaluation`,
the evaluator a config names). Per strategy: recall@k of the planted memory, the share of answers
that contain the planted value (95 % bootstrap interval), and foreign memories (another user's: must
be 0). Runs from `persrag evaluate --config evaluate_memory.yaml` or `benchmarks/bench_memory.py
--end-to-end`.

Simulated users are mapped onto the run's docstore users (conversation i ↔ the i-th user), so CFRAG
retrieves their real histories and neighbours next to the memories.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from persrag_lightning.bundles import exported_bundle
from persrag_lightning.data.docstore import read_docstore
from persrag_lightning.data.prompt_store import PROMPT_STORE, PromptStore
from persrag_lightning.evaluation.base import EvaluationReport, Evaluator
from persrag_lightning.evaluation.stats import bootstrap_interval
from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.prompts import build_chat_prompt
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.memory.bank import MemoryBank, MemorySettings
from persrag_lightning.memory.recall import RecallSettings
from persrag_lightning.memory.simulate import (
    PlantedFact,
    SimulatedConversation,
    feed_conversations,
    questionnaire_answers,
    simulate_conversations,
)
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.retrieval.baselines import ZeroShot
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.retrieval.memory import CFRAGMemory, MemoryRecall
from persrag_lightning.stages import bundle_path
from persrag_lightning.utils import atomic_write_json, atomic_write_text

__all__ = ["MemoryEvaluation", "table"]

STRATEGIES = ("zero_shot", "Memory", "CFRAG", "CFRAG + memory")


@dataclass
class MemoryEvalConfig:
    """What configs/evaluate_memory.yaml sets (section `evaluation`'s init_args).

    Args:
        run_dir: the run whose exported bundles (docstore, CFRAG's stages) the strategies read.
        users: simulated users, mapped onto the first docstore users.
        facts_per_user: facts planted in each user's conversation.
        fillers_per_fact: other messages per planted fact, between the fact and its question.
        seed: seed of the simulated conversations and of the bootstrap intervals.
        k: docs (CFRAG) and memories (the seed's k = 5) per prompt.
        encoder: the memory bank's text encoder (`minilm`, any Hugging Face name or folder).
        extraction: `verbatim` (each message stored as is) or `llm` (the seed's extraction, slow on
            a CPU).
        questionnaire: sign each user up with the seed's five-category questionnaire first.
        recall_query: what recall embeds: `summary` (the LLM's summary, the seed's; raw without an
            LLM) or `raw`.
        strategies: the strategies compared, a subset of zero_shot, Memory, CFRAG and CFRAG +
            memory.
        llm: the LLM that answers (and extracts, summarises); short answers, as a fact's value is a
            few words.
        cache_dir: where corpus embeddings are cached, keyed by fingerprints.
        out_dir: where the report is written.
    """

    run_dir: str = "checkpoints/synthlamp-quick"
    users: int = 20
    facts_per_user: int = 3
    fillers_per_fact: int = 2
    seed: int = 0
    k: int = 5
    encoder: str = "minilm"
    extraction: str = "verbatim"
    questionnaire: bool = False
    recall_query: str = "summary"
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    llm: LLMConfig = field(default_factory=lambda: LLMConfig(max_new_tokens=24))
    cache_dir: str = ".cache/persrag"
    out_dir: str = "runs/memory_eval"


@dataclass
class StrategyResult:
    name: str
    questions: int
    recall_at_k: float | None       # None: the strategy recalls no memories
    answer_hits: float
    answer_ci: tuple[float, float]
    foreign_memories: int
    own_docs: float | None
    seconds: float


def _interval(hits: np.ndarray, seed: int) -> tuple[float, float]:
    """95 % bootstrap interval of the share of answers holding the fact; zeros when there were no
    questions."""
    return bootstrap_interval(hits, seed=seed) if len(hits) else (0.0, 0.0)


def _make_strategy(name: str, run_dir: Path, cfg: MemoryEvalConfig) -> Strategy:
    cfrag_args = {"user_encoder": str(bundle_path(run_dir, "user_encoder")),
                  "retriever": exported_bundle(run_dir, "retriever") or "minilm",
                  "reranker": exported_bundle(run_dir, "reranker"),
                  "cache_dir": cfg.cache_dir}
    if name == "zero_shot":
        return ZeroShot()
    if name == "Memory":
        return MemoryRecall(name="Memory")
    if name == "CFRAG":
        return CFRAG(**cfrag_args, name="CFRAG")
    if name == "CFRAG + memory":
        return CFRAGMemory(**cfrag_args, memory_k=cfg.k)
    raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")


def _fresh_bank(cfg: MemoryEvalConfig, out: Path, llm) -> MemoryBank:
    """An empty bank under `out`/bank (a previous run's removed), extracting as `cfg.extraction` says."""
    shutil.rmtree(out / "bank", ignore_errors=True)
    if cfg.extraction not in ("verbatim", "llm"):
        raise ValueError(f"evaluation.extraction must be 'verbatim' or 'llm', got {cfg.extraction!r}")
    settings = MemorySettings(recall=RecallSettings(k=cfg.k), extract_query_tags=cfg.extraction == "llm",
                              recall_query=cfg.recall_query)
    return MemoryBank.open(out / "bank", cfg.encoder, llm if cfg.extraction == "llm" else None, settings)


def _extraction_counts(bank: MemoryBank, convs: list[SimulatedConversation]) -> dict:
    """What the bank's extraction did: LLM calls, fallbacks, repairs, memories per user, tagged memories."""
    return {"calls": bank.extractor.calls if bank.extractor else 0, "fallbacks": bank.fallbacks,
            "repaired": bank.repaired,
            "memories_per_user": float(np.mean([len(bank.list(c.user_id)) for c in convs])) if convs else 0.0,
            "tagged_memories": sum(bool(m.tags.flat()) for c in convs for m in bank.list(c.user_id))}


def _prompts_and_counts(questions: list[tuple[str, PlantedFact]], retrieved: list[list[RetrievedDoc]], llm: LLM,
                        cfg: MemoryEvalConfig) -> tuple[list[str], list[bool], int, int, int]:
    """Each question's chat prompt from what a strategy retrieved, and what it retrieved: per question
    whether the asker's own memories recall the fact, then the memories of other users, the asker's
    own corpus docs and all corpus docs, counted over the questions."""
    prompts, recall_hits, foreign, own, n_docs = [], [], 0, 0, 0
    for (user, fact), docs in zip(questions, retrieved):
        memories = [d for d in docs if d.source == "memory"]
        corpus_docs = [d for d in docs if d.source == "doc"]
        foreign += sum(d.owner != user for d in memories)
        recall_hits.append(any(d.owner == user and fact.value.lower() in d.text.lower() for d in memories))
        own += sum(d.owner == user for d in corpus_docs)
        n_docs += len(corpus_docs)
        prompts.append(build_chat_prompt(fact.question, [d.text for d in memories],
                                         [d.text for d in corpus_docs], [], llm.count_tokens,
                                         cfg.llm.max_prompt_tokens))
    return prompts, recall_hits, foreign, own, n_docs


def run_memory_evaluation(cfg: MemoryEvalConfig, bank: MemoryBank | None = None) -> list[StrategyResult]:
    """Plant, ask, answer, count; writes metrics.json, results.md and answers.jsonl (each strategy's
    answer to each question, and whether it holds the fact: two runs compare question by question)
    under `out_dir`."""
    run_dir = Path(cfg.run_dir)
    store = DocStore(read_docstore(run_dir / "docstore"))
    users = [u for u in store.corpus.user_ids if u in store][: cfg.users]
    convs = [SimulatedConversation(u, c.session_id, c.messages, c.facts) for u, c in
             zip(users, simulate_conversations(len(users), cfg.facts_per_user, cfg.fillers_per_fact, cfg.seed))]
    llm = cfg.llm.load()
    out = Path(cfg.out_dir)
    if bank is None:
        bank = _fresh_bank(cfg, out, llm)
    rng = random.Random(cfg.seed)
    feed_conversations(bank, convs, {c.user_id: questionnaire_answers(rng) for c in convs} if cfg.questionnaire
                       else None)
    questions = [(c.user_id, f) for c in convs for f in c.facts]
    queries = [Query(u, f.question, f.question) for u, f in questions]
    prompts_store = PromptStore(Path(cfg.cache_dir) / PROMPT_STORE)
    results, rows = [], []
    for name in cfg.strategies:
        t0 = time.perf_counter()
        strategy = _make_strategy(name, run_dir, cfg)
        if isinstance(strategy, (MemoryRecall, CFRAGMemory)):
            strategy.attach(bank)
        strategy.prepare(store)
        retrieved = strategy.retrieve(queries, cfg.k)
        prompts, recall_hits, foreign, own, n_docs = _prompts_and_counts(questions, retrieved, llm, cfg)
        answers = cfg.llm.chat(llm, prompts, prompts_store, phase=f"memory evaluation {name}")
        hits = np.array(
            [f.value.lower() in a.lower() for (_, f), a in zip(questions, answers)], dtype=float
        )
        rows += [{"strategy": name, "user_id": u, "question": f.question, "fact": f.value, "answer": a,
                  "hit": bool(h)} for (u, f), a, h in zip(questions, answers, hits)]
        has_memory = isinstance(strategy, (MemoryRecall, CFRAGMemory))
        results.append(StrategyResult(name, len(questions), float(np.mean(recall_hits)) if has_memory else None,
                                      float(hits.mean()) if len(hits) else 0.0, _interval(hits, cfg.seed),
                                      foreign, own / n_docs if n_docs else None, time.perf_counter() - t0))
    extraction = _extraction_counts(bank, convs)
    atomic_write_json(out / "metrics.json", {"config": {**asdict(cfg), "llm": asdict(cfg.llm)},
                                             "results": [asdict(r) for r in results],
                                             "extraction_fallbacks": bank.fallbacks, "extraction": extraction,
                                             "recall_inputs": dict(bank.recall_inputs)})
    atomic_write_text(out / "results.md", table(results, cfg, extraction, dict(bank.recall_inputs)))
    atomic_write_text(out / "answers.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return results


def table(results: list[StrategyResult], cfg: MemoryEvalConfig, extraction: dict | None = None,
          recall_inputs: dict | None = None) -> str:
    ex = extraction or {}
    ri = recall_inputs or {}
    head = (f"Simulated conversations: {cfg.users} users × {cfg.facts_per_user} planted facts, "
            f"{cfg.fillers_per_fact} other messages per fact{', questionnaire sign-up' if cfg.questionnaire else ''}"
            f"; {ex.get('memories_per_user', 0):.1f} memories per user; k = {cfg.k}; extraction {cfg.extraction} "
            f"({ex.get('calls', 0)} LLM extractions, {ex.get('fallbacks', 0)} fell back to the raw message, "
            f"{ex.get('repaired', 0)} repaired; {ex.get('tagged_memories', 0)} memories with tags); recall embedded "
            f"the LLM summary {ri.get('summary', 0)}×, the raw query {ri.get('raw', 0)}× by setting and "
            f"{ri.get('raw_fallback', 0)}× as fallback; LLM {cfg.llm.backend}:{cfg.llm.model}"
            f"{f' ({dtype})' if (dtype := cfg.llm.options.get('dtype')) else ''}\n\n"
            "| strategy | questions | recall@k of the planted memory | answer contains the fact [95 % CI] "
            "| foreign memories | own docs | seconds |\n|---|---|---|---|---|---|---|\n")
    rows = "".join(
        f"| {r.name} | {r.questions} | {'-' if r.recall_at_k is None else f'{r.recall_at_k:.3f}'} | "
        f"{r.answer_hits:.3f} [{r.answer_ci[0]:.3f}, {r.answer_ci[1]:.3f}] | {r.foreign_memories} | "
        f"{'-' if r.own_docs is None else f'{r.own_docs:.3f}'} | {r.seconds:.1f} |\n"
        for r in results
    )
    return head + rows


@dataclass
class MemoryEvaluation(MemoryEvalConfig, Evaluator):
    """What remembered facts add, as an evaluator (configs/evaluate_memory.yaml)."""

    primary_metric = "answer_hits"

    def evaluate(self, strategies: Sequence[Strategy] = ()) -> EvaluationReport:
        self.refuse_strategies(strategies, "evaluation.strategies")
        docstore = bundle_path(self.run_dir, "docstore")
        if not docstore.is_dir():
            raise FileNotFoundError(f"{docstore}: no exported run; train one first "
                                    "(`python train.py pipeline --preset quick`)")
        results = run_memory_evaluation(self)
        out = Path(self.out_dir)
        return EvaluationReport(self.primary_metric, self.greater_is_better, (out / "results.md").read_text(),
                                {r.name: {"recall@k": r.recall_at_k, "answer_hits": r.answer_hits} for r in results},
                                out)
