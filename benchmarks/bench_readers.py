"""Which reader reads a label task: each design's dev quality, train minutes and answers/s on a LaMP folder, next to
the rows that need no reader.

Designs (`--designs`, any subset, in this order):
- `trained`: the reader stage (`fit --config reader.yaml`: frozen MiniLM vectors of the question and of BM25's docs
  with their labels, a small fusion transformer, an ordinal head on ordered labels), read through `TrainedReader`;
  stopped on the train users it holds out and read with the decision fitted on them, and, on the same reading, with
  the task metric's rule (the median, the arg max);
- `trained_tuned`: the same reader with the encoder's top `--tune_layers` layers fine-tuned on the question's text
  (`tune_layers`, at `--tune_lr`; models/question_tower.py), on `--tune_threads` threads;
- `trained_dev_stopped`: the same reader with no train user held out (`holdout.fold: null`): dev stops it, and it
  reads with the metric's rule (LaMP's protocol, the design before the holdout);
- `trained_before`: the same reader without the asker's label habit and the docs' provenance (`prior: false,
  provenance: false`: the design before them);
- `llm`: the embedded LLM (SmolLM2) reading the evaluation's Table 4 prompts under `answer_mode: choose`, one row
  per label calibration (one reading, every calibration's terms);
- `generator`: the LoRA generator (`fit --config generator.yaml`, BM25's prompts, loss on the label tokens) trained
  on the whole train split until dev stops improving (EarlyStopping on val/metric, at most `--generator_epochs`),
  its export read as the LLM under each calibration. Tens of minutes on a CPU.

Every design reads the same dev questions with the same docs: BM25's top-k of the question's own profile (the
evaluation's `bm25` row). Dev chooses the checkpoints of `trained_dev_stopped`, `trained_before` and `generator`,
so their dev numbers lean optimistic; `trained` never reads dev before this table; the main job's tables report
test. Train minutes are the fit's wall
time (embedding the texts included); answers/s time the whole read of the dev questions (prompts or vectors
included) after a short warm-up. MAE and accuracy carry 95 % bootstrap intervals; Spearman is the expected rating's
(Σ p·label) with the gold for a reader, the answer's for a reader-free row. The default folder is the shared real
reviews converted as `persrag data convert ... --dedupe` does. Prints Markdown; asserts nothing about time.

    python benchmarks/bench_readers.py [--designs trained,llm] [--data_dir FOLDER --task LaMP-3]
    python benchmarks/bench_readers.py --designs generator --max_train 32 --generator_epochs 1   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from persrag_lightning.commands.train import lightning_command
from persrag_lightning.data.convert import ConvertOptions, convert_log
from persrag_lightning.data.records import Example, ReadDocs
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.tasks import get_task
from persrag_lightning.evaluation.reader_free import reader_free_rows, top_answer
from persrag_lightning.evaluation.stats import LampMetricFn, bootstrap_ci, metric_names
from persrag_lightning.hardware import describe_cpu
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading.decision import CALIBRATIONS, resolve_decision
from persrag_lightning.reading.label_reading import LabelReading
from persrag_lightning.reading.llm import LLMReader
from persrag_lightning.reading.trained import TrainedReader
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.strategies import cached_retrieval, strategy_by_name
from persrag_lightning.utils import resolve_config_path

REPO = Path(__file__).resolve().parents[1]
SHARED_LOG = REPO.parent / "shared" / "data" / "real" / "Magazine_Subscriptions_5.json"
# the shared reviews' columns (their README): LaMP-3, one review per (user, product), repeated texts kept once
SHARED_OPTIONS = ConvertOptions(task="LaMP-3", user="reviewerID", date="unixReviewTime", text="reviewText",
                                label="overall", item="asin", dedupe=True)
DESIGNS = ("trained", "trained_tuned", "trained_dev_stopped", "trained_before", "llm", "generator")
WARM_UP = 4  # questions read before the clock starts (first-call allocations, kernel choices)


@dataclass
class Row:
    """One row of the table: a design's (or a reader-free rule's) dev answers, with what they cost."""

    name: str
    answers: list[str]
    expected: list[float] | None = None  # a reader's expected rating per question (ordered labels)
    train_s: float | None = None
    per_s: float | None = None


@dataclass
class Dev:
    """The dev questions every design reads, with BM25's docs, and what the reader-free rows need."""

    task: str
    data_dir: Path
    store: DocStore
    examples: list[Example]
    docs: list[ReadDocs]  # with their provenance and the asker's habit (DocStore.read_docs)
    free: dict[str, list[str]]
    n_train: int

    @property
    def inputs(self) -> list[str]:
        return [e.input for e in self.examples]

    @property
    def golds(self) -> list[str]:
        return [e.target or "" for e in self.examples]


def shared_folder(work: Path) -> Path:
    """The shared reviews converted once into the work folder (kept for later runs)."""
    out = work / "magazines"
    if not (out / "convert.json").exists():
        convert_log(SHARED_LOG, out, SHARED_OPTIONS, overwrite=True)
    return out


def load_dev(task: str, data_dir: Path, cache_dir: str, k: int, max_dev: int | None) -> Dev:
    source = LampSource(task, str(data_dir), None, cache_dir)
    source.prepare()
    dataset = source.load()
    store = DocStore(dataset)
    examples = sorted((e for e in dataset.examples["dev"] if e.target is not None), key=lambda e: e.example_id)
    examples = examples[:max_dev] if max_dev else examples
    bm25 = strategy_by_name(resolve_config_path("evaluate_cfrag.yaml"), "bm25", "checkpoints/unused")
    retrieved, _ = cached_retrieval(bm25, store, examples, k, cache_dir, source.data_dir.name)
    train_golds = [e.target for e in dataset.examples["train"] if e.target is not None]
    free = reader_free_rows(source.task, store, examples, train_golds, {"BM25": retrieved})
    docs = [store.read_docs(Query(e.user_id, e.query, e.input, e.example_id), ds) for e, ds in zip(examples, retrieved)]
    return Dev(source.task, Path(data_dir), store, examples, docs, free, len(train_golds))


def expected_ratings(reading: LabelReading) -> list[float] | None:
    if get_task(reading.task).kind != "regression":
        return None
    values = [float(label) for label in reading.labels]
    return [float(np.dot(values, p)) for p in reading.probabilities]


@contextlib.contextmanager
def inside(folder: Path):
    """A fit writes runs/ and checkpoints/ under the current folder: the work folder's, not the repository's."""
    before = Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def fit(config: str, dev: Dev, args: argparse.Namespace, *extra: str) -> tuple[Path, float]:
    """`fit --config <config>` on the folder's train split (dev validates), in the work folder, with a cache of its
    own (a later run embeds, retrieves and builds its prompts again: train minutes always count them); its export
    and wall seconds."""
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work, prefix="fit-cache-") as cache, inside(work):
        caps = [f"--data.init_args.splits.{key}={n}" for key, n in (("max_train_examples", args.max_train),
                                                                      ("max_val_examples", args.max_dev)) if n]
        command = ["fit", "--config", config, "--run_name", "bench_readers", "--trainer.enable_progress_bar=false",
                   f"--data.init_args.task={dev.task}", f"--data.init_args.data_dir={dev.data_dir}",
                   f"--data.init_args.cache_dir={cache}", f"--data.init_args.k={args.k}", *caps, *extra]
        started = time.perf_counter()
        lightning_command(command)
        seconds = time.perf_counter() - started
    stage = "reader" if config == "reader.yaml" else "generator"
    return work / "checkpoints" / "bench_readers" / stage, seconds


def timed_read(read, dev: Dev) -> tuple[LabelReading, float]:
    """A reading of every dev question and its answers per second, after a warm-up on the first few."""
    read(dev.inputs[:WARM_UP], dev.docs[:WARM_UP])
    started = time.perf_counter()
    reading = read(dev.inputs, dev.docs)
    return reading, len(dev.inputs) / (time.perf_counter() - started)


def trained_rows(dev: Dev, args: argparse.Namespace, before: bool = False, dev_stopped: bool = False,
                 tuned: bool = False) -> list[Row]:
    """The reader stage's design read on dev (under its fitted decision and under the metric's rule, one reading);
    `before`: without the asker's habit and the docs' provenance; `dev_stopped`: no train user held out; `tuned`:
    the question tower fine-tuned."""
    extra = [f"--trainer.max_epochs={args.reader_epochs}"] if args.reader_epochs else []
    extra += [f"--seed_everything={args.seed}", f"--model.init_args.select_on={args.select_on}"]
    if tuned:
        extra += [f"--model.init_args.config.tune_layers={args.tune_layers}", f"--model.init_args.tune_lr={args.tune_lr}",
                  f"--model.init_args.cpu_threads={args.tune_threads}"]
    if before:
        extra += ["--model.init_args.config.prior=false", "--model.init_args.config.provenance=false"]
    if before or dev_stopped:
        extra += ['--data.init_args.holdout={"folds": 5, "fold": null}']  # (`holdout.fold=null` alone fails to parse)
    export, seconds = fit("reader.yaml", dev, args, *extra)
    reader = TrainedReader(export)

    def read(inputs, docs):
        reader.model._vectors.clear()  # each timed read embeds its texts, as a fresh process would
        return reader.read(dev.task, inputs, docs)

    reading, per_s = timed_read(read, dev)
    name = ("trained reader, no habit or provenance" if before else "trained reader, dev stops it" if dev_stopped
            else f"trained reader, top {args.tune_layers} layer(s) tuned" if tuned else "trained reader")
    rule = resolve_decision(dev.task, "auto")
    detail = reader.describe(dev.task).removeprefix("trained reader (").removesuffix(")")
    rows = [Row(f"{name} ({detail})", reading.answers, expected_ratings(reading), seconds, per_s)]
    if reader.fitted is not None and reader.fitted != (rule, 0.0):  # the same scores under the metric's rule
        under = TrainedReader(export, decision=rule).read(dev.task, dev.inputs, dev.docs)
        rows.append(Row(f"{name} (decision {rule}, the metric's rule)", under.answers, expected_ratings(under),
                        seconds, per_s))
    return rows


def llm_rows(model: str, name: str, dev: Dev, args: argparse.Namespace, train_s: float | None = None) -> list[Row]:
    """The LLM at `model` reading the dev prompts once, every calibration's terms computed; a row per calibration."""
    config = LLMConfig(model=model, answer_mode="choose", batch_size=args.llm_batch_size,
                       max_prompt_tokens=args.max_prompt_tokens)
    reader = LLMReader(config, remember_terms=False)
    reading, per_s = timed_read(lambda inputs, docs: reader.read(dev.task, inputs, docs, every_calibration=True),
                                dev)
    dtype = str(getattr(getattr(reader.llm, "model", None), "dtype", "")).removeprefix("torch.")
    reader.close()
    rows = []
    for calibration in CALIBRATIONS:
        under = reading.under(calibration)
        rows.append(Row(f"{name} {dtype}, calibration {calibration}", under.answers, expected_ratings(under),
                        train_s, per_s))
    return rows


def generator_rows(dev: Dev, args: argparse.Namespace) -> list[Row]:
    """LaMP's fine-tuned reader on the embedded LLM: LoRA on BM25's train prompts, stopped when dev stops improving
    (generator.yaml's checkpoints plus an EarlyStopping on the same dev metric)."""
    export, seconds = fit("generator.yaml", dev, args, "--data.init_args.strategy=bm25",
                          f"--trainer.max_epochs={args.generator_epochs}",
                          "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping",
                          "--trainer.callbacks.monitor=val/metric", "--trainer.callbacks.mode=max",
                          f"--trainer.callbacks.patience={args.generator_patience}",
                          f"--model.init_args.model={args.llm}",
                          f"--data.init_args.max_prompt_tokens={args.max_prompt_tokens}")
    return llm_rows(str(export), "LoRA generator", dev, args, seconds)


def cell_metric(task: str, answers: list[str], golds: list[str]) -> str:
    metric = metric_names(task)[0]
    value, low, high = bootstrap_ci(LampMetricFn(task, metric), answers, golds, n_resamples=1000)
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def cell_spearman(values: list[float], golds: list[str]) -> str:
    if len(set(values)) < 2:
        return "—"
    rho = spearmanr(values, [float(g) for g in golds]).statistic
    return f"{rho:.3f}"


def table(dev: Dev, rows: list[Row]) -> list[str]:
    """The Markdown table: readers first, then the reader-free rows."""
    spec, golds = get_task(dev.task), dev.golds
    ordered = spec.kind == "regression"
    metric = metric_names(dev.task)[0]
    head = f"| reader | dev {metric} (95 % CI) |" + (" Spearman |" if ordered else "") + \
        " top answer (share) | train min | answers/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    free = [Row(name, answers) for name, answers in dev.free.items()]
    for row in rows + free:
        label, share = top_answer(row.answers)
        cells = [row.name, cell_metric(dev.task, row.answers, golds)]
        if ordered:
            values = row.expected if row.expected is not None else [float(a) for a in row.answers]
            cells.append(cell_spearman(values, golds))
        cells += [f"{label} ({share:.0%})", "—" if row.train_s is None else f"{row.train_s / 60:.1f}",
                  "—" if row.per_s is None else f"{row.per_s:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--designs", default="trained,llm,generator",
                        help=f"comma-separated subset of {', '.join(DESIGNS)}")
    parser.add_argument("--data_dir", default=None, help="a LaMP folder (default: the shared real reviews, converted)")
    parser.add_argument("--task", default="LaMP-3")
    parser.add_argument("--work_dir", default=".cache/persrag/bench_readers",
                        help="where the converted reviews, the fits' runs and exports go")
    parser.add_argument("--cache_dir", default=".cache/persrag")
    parser.add_argument("--k", type=int, default=5, help="BM25's docs per question")
    parser.add_argument("--max_train", type=int, default=None, help="train questions (default: all)")
    parser.add_argument("--max_dev", type=int, default=None, help="dev questions (default: all)")
    parser.add_argument("--reader_epochs", type=int, default=None, help="default: reader.yaml's, with its early stop")
    parser.add_argument("--seed", type=int, default=0, help="the trained readers' seed (reader.yaml's is 0)")
    parser.add_argument("--select_on", default="metric", choices=["metric", "loss"],
                        help="what chooses the trained readers' checkpoint on the held-out users (reader.yaml's: metric)")
    parser.add_argument("--tune_layers", type=int, default=1, help="trained_tuned: the encoder's layers tuned")
    parser.add_argument("--tune_lr", type=float, default=5e-5, help="trained_tuned: their learning rate")
    parser.add_argument("--tune_threads", type=int, default=2, help="trained_tuned: torch's threads while fitting")
    parser.add_argument("--generator_epochs", type=int, default=3)
    parser.add_argument("--generator_patience", type=int, default=1)
    parser.add_argument("--llm", default="smollm2", help="the LLM of the llm and generator designs")
    parser.add_argument("--llm_batch_size", type=int, default=16)
    parser.add_argument("--max_prompt_tokens", type=int, default=512, help="the evaluation's prompt budget")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads while reading (default: torch's)")
    args = parser.parse_args(argv)
    unknown = set(args.designs.split(",")) - set(DESIGNS)
    if unknown:
        parser.error(f"--designs: unknown {sorted(unknown)}; choose among {', '.join(DESIGNS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir).resolve()
    data_dir = Path(args.data_dir).resolve() if args.data_dir else shared_folder(work)
    dev = load_dev(args.task, data_dir, args.cache_dir, args.k, args.max_dev)
    designs = args.designs.split(",")
    rows: list[Row] = []
    if "trained" in designs:
        rows += trained_rows(dev, args)
    if "trained_tuned" in designs:
        rows += trained_rows(dev, args, tuned=True)
    if "trained_dev_stopped" in designs:
        rows += trained_rows(dev, args, dev_stopped=True)
    if "trained_before" in designs:
        rows += trained_rows(dev, args, before=True)
    if "llm" in designs:
        rows += llm_rows(args.llm, f"LLM ({args.llm})", dev, args)
    if "generator" in designs:
        rows += generator_rows(dev, args)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"\n{date.today().isoformat()}; {describe_cpu()}; torch threads {torch.get_num_threads()}; seed {args.seed}; "
          f"checkpoint chosen on the held-out {args.select_on}; "
          "load average "
          f"{load} (1, 5, 15 min)")
    print(f"{data_dir.name} ({dev.task}): {len(dev.examples)} dev questions, read with BM25's top {args.k}; "
          f"{dev.n_train if args.max_train is None else min(args.max_train, dev.n_train)} train questions (the trained "
          "reader also reads their profiles' items)\n")
    print("\n".join(table(dev, rows)))
    golds = top_answer(dev.golds)
    print(f"\nGolds' most frequent label: {golds[0]} ({golds[1]:.0%}).")


if __name__ == "__main__":
    main()
