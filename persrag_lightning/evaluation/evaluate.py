"""`persrag evaluate`: run retrieval strategies on a split, prompt the LLM, and report like the
paper's Table 2.

Reports come from the **test** split (dev only when asked: dev is for selection). Writes, under
`out_dir`: predictions/<strategy>.json in the official LaMP output format, metrics.json, results.md
(methods × metrics with 95 % bootstrap intervals and paired tests against CFRAG) and results.png
(bars with the intervals). Each strategy's predictions are cached under a fingerprint of its
configuration — exported bundles by their content, not their path —, the examples and the LLM, so a
re-run evaluates only what changed, and a retrained model under the same run name gets new numbers.
Every LLM output goes through the shared prompt store.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from persrag_lightning.data.lamp import LampFormatError, write_predictions
from persrag_lightning.data.prompt_store import PROMPT_STORE, PromptStore
from persrag_lightning.data.records import Example
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig, load_communities
from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.base import EvaluationReport, Evaluator
from persrag_lightning.evaluation.breakdown import Stratum, breakdown, breakdown_table
from persrag_lightning.evaluation.diagnostics import retrieval_diagnostics
from persrag_lightning.evaluation.reader_free import (
    collapse_warnings,
    reader_free_rows,
    reading_diagnostics,
    top_answer,
)
from persrag_lightning.evaluation.report import Summary, plot_results, summarise
from persrag_lightning.evaluation.row_readers import RowReaders
from persrag_lightning.llm.prompts import PROMPT_VERSION
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.metrics import primary_metric
from persrag_lightning.progress import eta, progress
from persrag_lightning.reading import LLM_READER, Reader
from persrag_lightning.reading.decision import Calibration
from persrag_lightning.reading.label_reading import LabelReading
from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.retrieval.strategies import (
    bind_strategies,
    cached_retrieval,
    docs_from_store,
    file_name,
    resolve_reranker_runtime,
    set_reranker_runtime,
    stored_docs,
    strategy_config,
)
from persrag_lightning.utils import (
    ConfigError,
    atomic_write_json,
    atomic_write_text,
    fingerprint,
)

__all__ = ["Evaluation"]

log = logging.getLogger(__name__)

def paired_tests(pairs: list[list[str]] | None) -> list[list[str]]:
    """`evaluation.pairs` checked: each pair names two strategies (a tested against b)."""
    for pair in pairs or []:
        if len(pair) != 2:
            raise ValueError(f"evaluation.pairs: each pair names two strategies, got {pair!r}")
    return [list(p) for p in pairs or []]


class Evaluation(Evaluator):
    """Runs strategies over one split with one LLM and reports them with intervals and paired tests
    (LaMP)."""

    readings: dict[str, LabelReading]  # row → its label scores, as the last `run` read them
    golds: tuple[str, ...] = ()  # the last run's questions' golds, in order

    def __init__(self, task: str = "LaMP-2", data_dir: str | None = None, synth: SynthConfig | None = None,
                 cache_dir: str = ".cache/persrag", split: str = "test", k: int = 5, llm: LLMConfig | None = None,
                 max_examples: int | None = None, out_dir: str = "runs/synthlamp/evaluate",
                 reference: str = "CFRAG", n_resamples: int = 1000, seed: int = 0,
                 pairs: list[list[str]] | None = None, reranker_runtime: str = "fp32", reader_free: bool = True,
                 votes: list[str] | None = None, generator_calibration: Calibration | None = None,
                 reader: str = LLM_READER, by_history: list[str] | None = None) -> None:
        """The `evaluation:` section of an evaluate config that names no evaluator (configs/evaluate_cfrag.yaml).

        Args:
            task: the LaMP task (LaMP-1 ... LaMP-7); must match the training stages'.
            data_dir: a folder of LaMP files; None = the embedded SynthLaMP (must match the training stages).
            synth: size and seed of the SynthLaMP dataset (used only when `data_dir` is None); None = its defaults.
            cache_dir: where embeddings, generated data, prompts and answers are cached, keyed by fingerprints.
            split: `test` reports (default); `dev` selects.
            k: docs per prompt (the paper's k = 5).
            llm: the LLM that answers every row's prompts (backend, model, prompt budget, answer mode) when
                `reader` is `llm`, and the "+ tuned generator" rows' settings; None = LLMConfig().
            max_examples: the first N examples by id (a fixed subset); None = all.
            out_dir: where the table, metrics.json and the per-example answers are written.
            reference: the strategy every other one is tested against (paired test, same examples).
            n_resamples: resamples of the bootstrap intervals and the paired tests.
            seed: seed of the bootstrap and the paired tests.
            pairs: further paired tests, [a, b] each (a against b), reported under the table and in metrics.json.
            reranker_runtime: how every reranking row's cross-encoder runs (`set_reranker_runtime`): fp32 as
                trained (default), or e.g. bf16_if_native (the quick preset).
            reader_free: on a label task, add the rows that need no LLM (evaluation/reader_free.py).
            votes: the rows whose retrieved docs also vote as a row of their own (None: every row that puts docs
                in its prompt, wrappers excepted).
            generator_calibration: the label calibration of the "+ tuned generator" rows (None: `llm.calibration`);
                a model tuned on the task's labels has another label prior than the base reader.
            reader: who reads every row's question and docs: `llm` (the `llm` settings' LLM) or a trained reader's
                export (`stages.RUN_DIR`/reader, label tasks); "+ tuned generator" rows are read by their generator.
            by_history: rows the reference is also tested against in thirds of the questions by the asker's visible
                history size, under the table and in metrics.json (evaluation/breakdown.py); None: none.
        """
        self.source = LampSource(task, data_dir, synth, cache_dir)
        self.task = self.source.task
        self.split, self.k, self.max_examples = split, k, max_examples
        self.llm_config = llm or LLMConfig()
        self.out_dir = Path(out_dir)
        self.reference, self.n_resamples, self.seed = reference, n_resamples, seed
        self.pairs = paired_tests(pairs)
        self.by_history = list(by_history or [])
        resolve_reranker_runtime(reranker_runtime)  # a bad value fails here, before any strategy runs
        self.reranker_runtime = reranker_runtime
        self.reader_free, self.votes = reader_free, votes
        self.prompts = PromptStore(Path(cache_dir) / PROMPT_STORE)
        self.readers = RowReaders(self.task, reader, self.llm_config, self.prompts, generator_calibration)
        self.no_findings()

    def no_findings(self) -> None:
        """What a run finds besides its table, empty until it runs."""
        self.skipped: dict[str, str] = {}  # strategy → why it could not run (a bundle not trained yet)
        self.warnings: list[str] = []  # rows whose answers collapse onto one label (reader_free.py)
        self.top_answers: dict[str, tuple[str, float]] = {}
        self.strata: list[Stratum] = []  # the reference by the asker's history size (`by_history`)

    def rename(self, names: dict[str, str]) -> None:
        """Follow `arguments.rename_strategies`' renames in the reference, the votes and the paired tests.

        Args:
            names: config name → table name (`arguments.rename_strategies`' result).
        """
        self.reference = names.get(self.reference, self.reference)
        self.votes = None if self.votes is None else [names.get(n, n) for n in self.votes]
        self.pairs = [[names.get(n, n) for n in pair] for pair in self.pairs]
        self.by_history = [names.get(n, n) for n in self.by_history]

    @property
    def reader(self) -> Reader:
        """The reader of every row but the tuned generators' (`reader`), opened once."""
        return self.readers.main

    @property
    def reader_spec(self) -> str:
        """`llm` or the trained reader's export, as `reader` named it."""
        return self.readers.spec

    @property
    def generator_calibration(self) -> Calibration | None:
        return self.readers.generator_calibration

    def reader_for(self, strategy: Strategy) -> Reader:
        """Who reads a strategy's prompts: the evaluation's reader, or for a `TunedGenerator` row
        its generator's export, read as the LLM with the same settings and its own calibration; each
        is opened once.

        Args:
            strategy: the row whose prompts are read.
        """
        return self.readers.for_row(strategy)

    def examples(self, dataset) -> list[Example]:
        examples = sorted((e for e in dataset.examples.get(self.split, []) if e.target is not None),
                          key=lambda e: e.example_id)
        if not examples:
            raise LampFormatError(
                f"split {self.split!r} of {self.source.data_dir} has no labelled examples"
            )
        return examples[: self.max_examples] if self.max_examples else examples

    @property
    def primary_metric(self) -> str:
        """The task's first metric (accuracy, MAE or ROUGE-1), as the tables put it first."""
        return primary_metric(self.task).name

    @property
    def greater_is_better(self) -> bool:
        return primary_metric(self.task).greater_is_better

    def evaluate(self, strategies: Sequence[Strategy] = ()) -> EvaluationReport:
        """`run`, as the evaluator contract reports it.

        Args:
            strategies: the rows to evaluate, bound to the run's exports.
        """
        if not strategies:
            raise ConfigError("strategies: the LaMP evaluation needs at least one strategy")
        summary = self.run(list(strategies))
        return EvaluationReport(self.primary_metric, self.greater_is_better, self.table(summary, self.skipped),
                                summary.results, self.out_dir, dict(self.readings), self.golds)

    def run(self, strategies: list[Strategy]) -> Summary:
        self.source.prepare()
        dataset = self.source.load()
        store = DocStore(dataset)
        examples = self.examples(dataset)
        communities = load_communities(self.source.data_dir)
        predictions, diagnostics, retrieved = self.read_rows(strategies, store, examples, communities)
        golds = [e.target for e in examples]
        self.golds = tuple(golds)
        # the alarm is for rows that read their prompt: a reader-free row is constant or rule-made
        # by design
        self.warnings = collapse_warnings(predictions, golds) if get_task(self.task).labels else []
        if self.reader_free:
            predictions.update(self.reader_free_answers(dataset, store, examples, retrieved))
        summary = summarise(self.task, predictions, golds, self.reference, self.n_resamples,
                            seed=self.seed, pairs=self.pairs)
        self.strata = breakdown(self.task, predictions, golds, [len(e.profile) for e in examples], self.reference,
                                 self.by_history, n_resamples=self.n_resamples, seed=self.seed) if self.by_history else []
        for name, extra in diagnostics.items():
            summary.results[name].update(extra)
        self.top_answers = {name: top_answer(answers) for name, answers in predictions.items()}
        # how constant each row is (a reader answering by prior)
        for name, (_, share) in self.top_answers.items():
            summary.results[name]["top_answer_share"] = share
        self.write_reports(summary, self.skipped)
        return summary

    def read_rows(self, strategies: list[Strategy], store: DocStore, examples: list[Example],
                  communities: dict[str, int] | None) -> tuple[dict, dict, dict]:
        """Each row's answers and diagnostics, and the retrieved docs of the rows that vote, by row name; a row
        whose bundle is not exported yet is skipped (`skipped` says why), a label row's reading is kept
        (`readings`)."""
        predictions: dict[str, list[str]] = {}
        diagnostics: dict[str, dict[str, float]] = {}
        retrieved: dict[str, list[list[RetrievedDoc]]] = {}
        self.skipped, self.readings = {}, {}
        started = time.perf_counter()
        set_reranker_runtime(strategies, self.reranker_runtime)
        bind_strategies(strategies)
        for i, strategy in enumerate(strategies):
            progress(f"[evaluate {i + 1}/{len(strategies)}] {strategy.name}: {len(examples)} {self.split} examples"
                     + eta(started, i, len(strategies)))
            try:
                outcome = self.run_strategy(strategy, store, examples, communities)
            # a bundle its stage has not exported yet: a row says so
            except FileNotFoundError as err:
                log.warning("%s skipped: %s", strategy.name, err)
                self.skipped[strategy.name] = str(err)
                continue
            predictions[strategy.name], diagnostics[strategy.name] = outcome["predictions"], outcome["diagnostics"]
            if outcome["labels"] is not None:
                self.readings[strategy.name] = outcome["labels"]
            if self.votes_for(strategy) and outcome["diagnostics"].get("docs_per_query"):
                retrieved[strategy.name] = outcome["retrieved"]
        return predictions, diagnostics, retrieved

    def reader_free_answers(self, dataset, store: DocStore, examples: list[Example],
                            retrieved: dict[str, list[list[RetrievedDoc]]]) -> dict[str, list[str]]:
        """The rows that need no reader (evaluation/reader_free.py), their answers written as a read row's are."""
        train_golds = [e.target for e in dataset.examples.get("train", []) if e.target is not None]
        rows = reader_free_rows(self.task, store, examples, train_golds, retrieved)
        for name, answers in rows.items():
            write_predictions(self.out_dir / "predictions" / f"{file_name(name)}.json", self.task,
                              {e.example_id: a for e, a in zip(examples, answers)})
        return rows

    def votes_for(self, strategy: Strategy) -> bool:
        """Whether a row's retrieved docs vote as a reader-free row: the named rows, or (None) every
        row that retrieves for itself (a tuned generator's row reads another row's docs).

        Args:
            strategy: the row.
        """
        if self.votes is not None:
            return strategy.name in self.votes
        return strategy.wrapped_name is None

    def run_strategy(self, strategy: Strategy, store: DocStore, examples: list[Example],
                     communities: dict[str, int] | None) -> dict:
        """Predictions (one per example, in order), the retrieved docs, retrieval diagnostics and,
        under `choose`, the row's `LabelReading` (every label's score and the calibration terms,
        also written beside the answers as predictions/<row>.labels.json); cached by content."""
        reader = self.reader_for(strategy)
        reading = reader.reading(self.task)
        # v4: answers read with each neighbour's similarity (v3's could come from a cached retrieval without it)
        key = fingerprint("evaluate/v4", strategy_config(strategy), reader.identity(), PROMPT_VERSION,
                          self.k, [(e.example_id, e.input, e.target, e.profile) for e in examples],
                          self.source.data_dir.name, *([reading] if reading else []))
        cached = self.out_dir / "cache" / f"{file_name(strategy.name)}-{key}.json"
        labels_file = self.out_dir / "predictions" / f"{file_name(strategy.name)}.labels.json"
        # predictions and retrieved rows; diagnostics are recomputed (new ones cost no LLM)
        if cached.exists():
            outcome = json.loads(cached.read_text())
            retrieved = docs_from_store(store, outcome)
            if "labels" not in outcome and reader.reads_labels and labels_file.is_file():
                # an entry cached before it kept them
                outcome["labels"] = json.loads(labels_file.read_text())
        else:
            retrieved, ms_per_query = cached_retrieval(
                strategy, store, examples, self.k, self.source.cache_dir, self.source.data_dir.name
            )
            predictions, reading, labels = self.answers(strategy, store, examples, retrieved)
            outcome = {"predictions": predictions, **stored_docs(retrieved),
                       "retrieve_ms_per_query": ms_per_query, "reading": reading,
                       **({"labels": labels.to_json([e.example_id for e in examples], [e.target for e in examples])}
                          if labels is not None else {})}
            atomic_write_json(cached, outcome, indent=None)
        write_predictions(self.out_dir / "predictions" / f"{file_name(strategy.name)}.json", self.task,
                          {e.example_id: p for e, p in zip(examples, outcome["predictions"])})
        if "labels" in outcome:
            atomic_write_json(labels_file, outcome["labels"], indent=None)
        diagnostics = retrieval_diagnostics(self.task, store, examples, retrieved, communities)
        diagnostics["retrieve_ms_per_query"] = outcome["retrieve_ms_per_query"]
        diagnostics.update(outcome.get("reading") or {})
        return {"predictions": outcome["predictions"], "diagnostics": diagnostics, "retrieved": retrieved,
                "labels": LabelReading.from_json(outcome["labels"]) if "labels" in outcome else None}

    def answers(self, strategy: Strategy, store: DocStore, examples: list[Example],
                retrieved: list[list[RetrievedDoc]]) -> tuple[list[str], dict[str, float], LabelReading | None]:
        """The reader's answers to a row's questions, what its label distributions say of the golds
        (`reading_diagnostics`) and, for a reader of labels, the reading itself (None for generated
        answers)."""
        reader = self.reader_for(strategy)
        inputs = [e.input for e in examples]
        docs = [store.read_docs(Query(e.user_id, e.query, e.input, e.example_id), ds)
                for e, ds in zip(examples, retrieved)]
        phase = f"evaluate {strategy.name}"
        if not reader.reads_labels:
            return reader.answer(self.task, inputs, docs, prompt_gamma=strategy.prompt_gamma, phase=phase), {}, None
        reading = reader.read(self.task, inputs, docs, prompt_gamma=strategy.prompt_gamma, phase=phase,
                              every_calibration=True)
        return reading.answers, reading_diagnostics(reading, [e.target for e in examples]), reading

    @property
    def answer_mode(self) -> str:
        """How the rows are read, as the table's header names it, with the tuned generators' reading
        where it differs from the other rows'."""
        text, reading = self.reader.describe(self.task), self.llm_config.reading(self.task)
        tuned = self.generator_calibration or (reading or {}).get("calibration")
        if self.reader_spec != LLM_READER and reading:
            return f"{text}; tuned generator rows: choose (calibration {tuned})"
        if reading and tuned != reading["calibration"]:
            return f"{text[:-1]}; tuned generator rows: calibration {tuned})"
        return text

    def write_reports(self, summary: Summary, skipped: dict[str, str]) -> None:
        mode = self.answer_mode
        atomic_write_json(self.out_dir / "metrics.json", {
            "task": self.task, "split": self.split, "examples": summary.n_examples, "k": self.k,
            "synth": asdict(self.source.synth) if self.source.synth is not None else None,
            "answer_mode": self.llm_config.answer_mode, "reader": self.reader_spec,
            "reading": self.reader.reading(self.task),
            "generator_calibration": self.generator_calibration,
            "postprocessing": self.llm_config.postprocessing, "llm": asdict(self.llm_config),
            "top_answers": {n: {"answer": a, "share": share} for n, (a, share) in self.top_answers.items()},
            "warnings": self.warnings,
            "reference": summary.reference, "results": summary.results,
            "intervals": {n: {m: list(ci) for m, ci in by.items()} for n, by in summary.intervals.items()},
            "p_values": {n: {m: c.p_value for m, c in by.items()} for n, by in summary.comparisons.items()},
            "pairs": [{"strategy": next(iter(by.values())).strategy, "against": next(iter(by.values())).reference,
                       "difference": {m: c.difference for m, c in by.items()},
                       "p_values": {m: c.p_value for m, c in by.items()}} for by in summary.pairs],
            "by_history": [s.to_json() for s in self.strata],
            "skipped": skipped, "prompt_store": {"hits": self.prompts.hits, "misses": self.prompts.misses,
                                                 "hit_rate": self.prompts.hit_rate}})
        atomic_write_text(self.out_dir / "results.md", self.table(summary, skipped))
        plot_results(self.task, summary.results, summary.intervals, self.out_dir / "results.png", mode,
                     split=self.split, n_examples=summary.n_examples)

    def table(self, summary: Summary, skipped: dict[str, str]) -> str:
        """results.md: the table with intervals, then one line per strategy that could not run.

        Args:
            summary: the rows' metrics with their intervals.
            skipped: rows that could not run → why.
        """
        text = summary.table(self.answer_mode, self.split)
        if self.warnings:
            text += "\n" + "".join(f"{line}\n" for line in self.warnings)
        if skipped:
            text += "\nNot trained (skipped):\n" + "".join(
                f"- {n}: {why}\n" for n, why in skipped.items()
            )
        if self.strata:
            text += "\n" + breakdown_table(self.task, self.strata, self.reference)
        return text
