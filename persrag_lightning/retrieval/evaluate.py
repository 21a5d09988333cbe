"""`persrag evaluate`: run retrieval strategies on a split, prompt the LLM, and report like the paper's Table 2.

Writes, under `out_dir`: predictions/<strategy>.json in the official LaMP output format, metrics.json,
results.md (methods × metrics, the layout of Table 2) and results.png (a bar chart of the methods). Each
strategy's predictions are cached under a fingerprint of its configuration, the examples and the LLM, so a re-run
evaluates only what changed.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from persrag_lightning.data.lamp import write_predictions
from persrag_lightning.data.records import Example
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig, load_communities
from persrag_lightning.data.tasks import get_task
from persrag_lightning.llm.answer import build_prompts
from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.prompts import PROMPT_VERSION
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.metrics import lamp_metric, rouge_scorer
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.utils import atomic_replace, atomic_write_json, atomic_write_text, fingerprint

log = logging.getLogger(__name__)

LABEL_FIELDS = {"LaMP-2": "tag", "LaMP-3": "score"}  # a doc "holds the answer" when this field equals the target
TITLE_FIELDS = {"LaMP-4": "title", "LaMP-5": "title"}


def file_name(name: str) -> str:
    """A strategy name as a file name ("w/o user retrieval" → "w_o_user_retrieval")."""
    return re.sub(r"[^\w.-]+", "_", name).strip("_")


def strategy_config(strategy: Strategy) -> dict:
    """What identifies a strategy's retrievals: its class and constructor settings."""
    return {"class": type(strategy).__qualname__,
            **{k: v for k, v in vars(strategy).items() if isinstance(v, (str, int, float, bool, type(None)))}}


def retrieval_diagnostics(task: str, store: DocStore, examples: list[Example], retrieved: list[list[RetrievedDoc]],
                          communities: dict[str, int] | None) -> dict[str, float]:
    """Figures that isolate retrieval from the LLM: whose docs were retrieved, and do they hold the answer."""
    out: dict[str, float] = {}
    docs = [d for ds in retrieved for d in ds]
    if not docs:
        return out
    out["own_docs"] = float(np.mean([d.owner == ex.user_id for ex, ds in zip(examples, retrieved) for d in ds]))
    if communities:
        out["same_community_docs"] = float(np.mean([
            communities.get(d.owner) == communities.get(ex.user_id) for ex, ds in zip(examples, retrieved) for d in ds]))
    if task in LABEL_FIELDS:
        field = LABEL_FIELDS[task]
        out["answer_in_docs"] = float(np.mean([
            any(str(store.history_doc(d.row).fields.get(field, "")).strip() == (ex.target or "").strip() for d in ds)
            for ex, ds in zip(examples, retrieved)]))
    elif task in TITLE_FIELDS:
        scorer, field = rouge_scorer(), TITLE_FIELDS[task]
        out["best_doc_rouge1"] = float(np.mean([
            max((scorer.score(ex.target or "", str(store.history_doc(d.row).fields.get(field, "")))["rouge1"].fmeasure
                 for d in ds), default=0.0) for ex, ds in zip(examples, retrieved)]))
    return out


class Evaluation:
    """Runs strategies over one split with one LLM and keeps the results."""

    def __init__(self, task: str = "LaMP-2", data_dir: str | None = None, synth: SynthConfig | None = None,
                 cache_dir: str = ".cache/persrag", split: str = "dev", k: int = 5, llm: LLMConfig | None = None,
                 max_examples: int | None = None, out_dir: str = "runs/synthlamp/evaluate") -> None:
        self.source = LampSource(task, data_dir, synth, cache_dir)
        self.task = self.source.task
        self.split, self.k, self.max_examples = split, k, max_examples
        self.llm_config = llm or LLMConfig()
        self.out_dir = Path(out_dir)
        self._llm: LLM | None = None

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = self.llm_config.load()
        return self._llm

    def examples(self, dataset) -> list[Example]:
        examples = sorted((e for e in dataset.examples.get(self.split, []) if e.target is not None),
                          key=lambda e: e.example_id)
        if not examples:
            raise ValueError(f"split {self.split!r} has no labelled examples")
        return examples[: self.max_examples] if self.max_examples else examples

    def run(self, strategies: list[Strategy]) -> dict[str, dict[str, float]]:
        self.source.prepare()
        dataset = self.source.load()
        store = DocStore(dataset)
        examples = self.examples(dataset)
        communities = load_communities(self.source.data_dir)
        results: dict[str, dict[str, float]] = {}
        for strategy in strategies:
            results[strategy.name] = self.run_strategy(strategy, store, examples, communities)
            log.info("%s: %s", strategy.name, results[strategy.name])
        self.write_reports(results)
        return results

    def run_strategy(self, strategy: Strategy, store: DocStore, examples: list[Example],
                     communities: dict[str, int] | None) -> dict[str, float]:
        key = fingerprint("evaluate/v1", strategy_config(strategy), self.llm_config.identity(), PROMPT_VERSION,
                          self.k, [(e.example_id, e.input, e.target) for e in examples], self.source.data_dir.name)
        cached = self.out_dir / "cache" / f"{file_name(strategy.name)}-{key}.json"
        if cached.exists():
            return json.loads(cached.read_text())
        t0 = time.perf_counter()
        strategy.prepare(store)
        queries = [Query(e.user_id, e.query, e.input, e.example_id) for e in examples]
        retrieved = strategy.retrieve(queries, self.k)
        retrieve_seconds = time.perf_counter() - t0
        prompts = build_prompts(self.task, self.llm, [e.input for e in examples],
                                [[store.history_doc(d.row) for d in docs] for docs in retrieved],
                                self.llm_config.max_prompt_tokens)
        predictions = self.llm_config.answer(self.llm, self.task, prompts)
        metric = lamp_metric(self.task)
        metric.update(predictions, [e.target for e in examples])
        scores = {name: float(v) for name, v in metric.compute().items()}
        scores.update(retrieval_diagnostics(self.task, store, examples, retrieved, communities))
        scores["retrieve_ms_per_query"] = 1000 * retrieve_seconds / len(examples)
        write_predictions(self.out_dir / "predictions" / f"{file_name(strategy.name)}.json", self.task,
                          {e.example_id: p for e, p in zip(examples, predictions)})
        atomic_write_json(cached, scores)
        return scores

    def write_reports(self, results: dict[str, dict[str, float]]) -> None:
        atomic_write_json(self.out_dir / "metrics.json", {
            "task": self.task, "split": self.split, "k": self.k, "llm": asdict(self.llm_config), "results": results})
        atomic_write_text(self.out_dir / "results.md", results_table(self.task, results))
        plot_results(self.task, results, self.out_dir / "results.png")


def metric_columns(task: str) -> list[str]:
    kind = get_task(task).kind
    return {"classification": ["accuracy", "f1"], "regression": ["mae", "rmse"],
            "generation": ["rouge-1", "rouge-L"]}[kind]


def results_table(task: str, results: dict[str, dict[str, float]]) -> str:
    """Methods × metrics in the layout of the paper's Table 2, plus the retrieval-level diagnostics."""
    columns = metric_columns(task)
    extra = sorted({k for r in results.values() for k in r} - set(columns) - {"neg_mae"})
    header = ["method", *[f"{task} {c}" for c in columns], *extra]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        cells = [name] + [f"{r[c]:.4f}" if c in r and not math.isnan(r[c]) else "-" for c in columns + extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_results(task: str, results: dict[str, dict[str, float]], path: Path) -> None:
    """A bar chart of the task's main metrics per method (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = metric_columns(task)
    names = list(results)
    width = 0.8 / len(columns)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names)), 4))
    for i, column in enumerate(columns):
        ax.bar(np.arange(len(names)) + i * width, [results[n].get(column, np.nan) for n in names], width,
               label=column)
    ax.set_xticks(np.arange(len(names)) + width * (len(columns) - 1) / 2)
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_title(f"{task}: methods")
    ax.legend()
    fig.tight_layout()
    with atomic_replace(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
