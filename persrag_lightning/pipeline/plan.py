"""The pipeline's plan, printed before anything trains: the stages it trains and the exports it
skips, the rows the table will report, and the whole job's minutes estimated on this machine.

The estimate counts the prompts the LLM will read (the feedback labels of each feedback stage; the
answers of the dev choice and of the test table) and divides them by the rates of the evaluation's
reader, measured at the start of the run on a few prompts of the main job's size: a label reads one
doc and scores one target, an answer reads k docs and scores every label of the task. Training and
retrieval are counted in the unit of the compute they are, measured the same way: the encoder stages
and retrieval in texts the frozen text encoder embeds (`encoder_rate`), the generator's tuning in
LLM answers (TRAINING_WORK, RETRIEVAL_PER_ANSWER; where they come from:
docs/getting-started.md#where-the-plans-constants-come-from). The two rates do not move together from
one CPU class to the next, so neither stands in for the other. `pipeline.json` keeps the estimate
beside the measured minutes, so each run checks it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from persrag_lightning.data.tasks import TaskSpec
from persrag_lightning.models.user_encoder import judgments_train
from persrag_lightning.pipeline import rates
from persrag_lightning.pipeline.constants import (
    LLM_STAGES,
    MIX_ITEMS_WORK,
    PAIR_TOKENS,
    QUICK_SCALE,
    RETRIEVAL_PER_ANSWER,
    TRAINED_TEXTS,
    TRAINING_WORK,
)
from persrag_lightning.presets import Preset
from persrag_lightning.stages import FOLD_READERS, STAGES

__all__ = ["Plan", "build_plan", "measure_rates", "pair_scale", "question_counts"]

PAIR_SAMPLE = 3000  # docs whose length `pair_scale` counts (a sample: a large log has many)

if TYPE_CHECKING:
    from jsonargparse import Namespace


@dataclass
class Plan:
    """What a pipeline run will do and how long it should take here, for each reader the dev choice
    may take."""

    train: list[str]
    skip: list[str]
    rows: list[str] | None
    # the stages' non-reading work: `encoder` texts and `llm` answers (TRAINING_WORK); `fold_readers`: the
    # encoder texts of the cross-fitted feedback's readers, which train only if dev chooses the trained reader
    training: dict[str, float] = field(default_factory=dict)
    # feedback labels the feedback stages compute (by the chosen reader)
    labels: int = 0
    answers: dict[str, int] = field(default_factory=dict)  # phase → answers the chosen reader reads
    llm_answers: dict[str, int] = field(default_factory=dict)  # phase → answers only the LLM reads
    # the readers the dev choice may take
    readers: list[str] = field(default_factory=lambda: ["llm"])
    # per second here: LLM answers / labels, trained ones
    rates: dict[str, float] = field(default_factory=dict)
    reason: str = ""                   # why there is no estimate
    # the main job's budget on this CPU class (BUDGET_MINUTES; None on a GPU)
    budget: int | None = None

    def minutes_for(self, reader: str) -> float | None:
        """The whole job's minutes if `reader` reads the label task (`llm` or `trained`).

        Args:
            reader: `llm` or `trained`, the reader the estimate assumes.
        """
        if not self.rates:
            return None
        llm = sum(self.llm_answers.values()) + self.training.get("llm", 0.0)
        encoder = (self.training.get("encoder", 0.0) - (reader != "trained") * self.training.get("fold_readers", 0.0)
                   + RETRIEVAL_PER_ANSWER * (sum(self.answers.values()) + sum(self.llm_answers.values())))
        if reader == "trained":
            seconds = (self.labels / self.rates["trained_labels"]
                       + sum(self.answers.values()) / self.rates["trained_answers"])
        else:
            seconds = self.labels / self.rates["labels"]
            llm += sum(self.answers.values())
        return (seconds + llm / self.rates["answers"] + encoder / self.rates["encoder_texts"]) / 60

    @property
    def minutes(self) -> float | None:
        """The estimate of the reader the preset lists first (the one a tie on dev keeps)."""
        return self.minutes_for(self.readers[0])

    def lines(self) -> list[str]:
        out = [f"[pipeline] plan: train {', '.join(self.train) or 'nothing'}"
               + (f"; already exported, so not trained again: {', '.join(self.skip)}" if self.skip else "")]
        out.append("[pipeline] rows: " + (", ".join(self.rows) if self.rows else "every strategy of evaluate_cfrag.yaml"))
        if self.minutes is None:
            out.append(f"[pipeline] no time estimate: {self.reason}")
            return out
        reads = ", ".join([f"{self.labels} feedback labels"] * bool(self.labels)
                          + [f"{n} answers ({phase})" for phase, n in {**self.answers, **self.llm_answers}.items() if n])
        by_reader = ", ".join(
            f"{self.minutes_for(r):.0f} if dev chooses the {'LLM' if r == 'llm' else r + ' reader'}"
            for r in self.readers
        )
        rates = f"the LLM here: {self.rates['answers']:.1f} answers/s, {self.rates['labels']:.1f} labels/s"
        if "trained" in self.readers:
            rates += f"; the trained reader: {self.rates['trained_answers']:.0f} answers/s"
        out.append(f"[pipeline] estimate: about {self.minutes:.0f} min on this machine"
                   + (f" ({by_reader})" if len(self.readers) > 1 else "")
                   + f"; {reads}, plus training; {rates}"
                   + (f"; the quick preset's budget on this CPU class: {self.budget} min" if self.budget else ""))
        return out

    def record(self) -> dict:
        return {**asdict(self), "minutes": None if self.minutes is None else round(self.minutes, 1),
                "minutes_by_reader": {r: round(self.minutes_for(r), 1) for r in self.readers}
                if self.rates else {}}


# ---- prompt counts -------------------------------------------------------------------------------

def _data(config: Namespace) -> Namespace:
    """The data settings of a resolved stage configuration (`Runner.stage_config`: the
    `fit` subcommand's)."""
    return config.fit.data.init_args


def _examples(limit: int | None, questions: int) -> int:
    """The questions a stage uses of a split that has `questions`, at most `limit` (None: all)."""
    return min(int(limit or questions), questions)


def training_work(stages: Mapping[str, Namespace], counts: dict[str, int],
                  pair_length: float = 1.0) -> dict[str, float]:
    """The stages' non-reading work (TRAINING_WORK scaled to each stage's size: its epochs x users
    for stage 1, none for an untrained `profile` one; for a `distilled` stage, its train and dev
    questions times `pair_length`, since it scores every candidate pair of each; its train examples
    for the others), read from their resolved configurations: `encoder` texts and `llm` answers.

    Args:
        stages: each trained stage's resolved configuration, by stage name.
        counts: questions per split (`question_counts`).
        pair_length: how long the data's (question, doc) pairs are against the quick preset's
            (`pair_scale`).
    """
    from persrag_lightning.data.synth_world import QUESTIONS_PER_USER

    users = counts["train"] // QUESTIONS_PER_USER["train"] or 1
    total = {"encoder": 0.0, "llm": 0.0, "fold_readers": 0.0}
    for stage, config in stages.items():
        kind = STAGES[stage].kind
        if kind == "user_encoder":
            # a `judgments: profile` encoder trains nothing: its stage validates and exports
            trains = judgments_train(config.fit.model.init_args.config.judgments)
            size = int(config.fit.trainer.max_epochs) * users * trains
        elif kind == "distilled":
            splits = _data(config).splits
            size = pair_length * (_examples(splits.max_train_examples, counts["train"])
                                 + _examples(splits.max_val_examples, counts["dev"]))
        else:
            size = _examples(_data(config).splits.max_train_examples, counts["train"])
        work = TRAINING_WORK[kind] * size / QUICK_SCALE[kind]
        if kind == "reader" and getattr(_data(config), "mix_items", False):
            work *= MIX_ITEMS_WORK  # every profile item read twice, and each first stage's retrieval
        total["llm" if kind in LLM_STAGES else "encoder"] += work
        total["fold_readers"] += work if stage in FOLD_READERS else 0.0
    return total


def feedback_prompts(stages: Mapping[str, Namespace], train_questions: int) -> int:
    """The LLM-feedback labels the feedback stages compute: m x k candidates per train question,
    read from their resolved configurations.

    Args:
        stages: each trained stage's resolved configuration, by stage name.
        train_questions: the train split's questions.
    """
    total = 0
    for stage, config in stages.items():
        if STAGES[stage].kind != "feedback":
            continue
        data = _data(config)
        total += int(data.candidates.m) * int(data.candidates.k) * _examples(data.splits.max_train_examples,
                                                                            train_questions)
    return total


# ---- the plan of a run ---------------------------------------------------------------------------

def question_counts(data_dir: str | None, users: int | None) -> dict[str, int]:
    """Questions per split: a LaMP folder's, or those of the SynthLaMP of `users` users the stages
    generate.

    Args:
        data_dir: a LaMP folder; None counts the embedded SynthLaMP's.
        users: SynthLaMP users the stages generate (None: its default).
    """
    if data_dir is not None:
        from persrag_lightning.data.lamp import questions_path

        return {s: len(json.loads(questions_path(data_dir, s).read_text())) if questions_path(data_dir, s).is_file()
                else 0 for s in ("train", "dev", "test")}
    from persrag_lightning.data.synth_world import DEFAULT_USERS, QUESTIONS_PER_USER

    users = users or DEFAULT_USERS
    return {s: n * int(users) for s, n in QUESTIONS_PER_USER.items()}


def pair_scale(data_dir: str | None, spec: TaskSpec) -> float:
    """How long the (question, doc) pairs a cross-encoder reads are in `data_dir` against those of the
    quick preset's SynthLaMP (PAIR_TOKENS): the mean tokens of the train questions' queries plus those
    of up to PAIR_SAMPLE of the folder's docs, each cut at 256 as the reranker cuts them, counted
    with MiniLM's tokenizer. 1 for the embedded SynthLaMP (None), which PAIR_TOKENS is of.

    Args:
        data_dir: a LaMP folder; None is the embedded SynthLaMP.
        spec: the folder's task.
    """
    if data_dir is None:
        return 1.0
    import random

    from transformers import AutoTokenizer

    from persrag_lightning.data.lamp import load_lamp
    from persrag_lightning.models.text_encoder import resolve_model_path

    data = load_lamp(data_dir, spec.name, splits=("train",))
    docs = [spec.render_doc(d) for user in data.users.values() for d in user.docs]
    docs = random.Random(0).sample(docs, min(PAIR_SAMPLE, len(docs)))
    queries = [spec.extract_query(e.input) for e in data.examples["train"]]
    if not docs or not queries:
        return 1.0
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))

    def mean_tokens(texts: list[str]) -> float:
        ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=256)["input_ids"]
        return sum(map(len, ids)) / len(ids)

    return (mean_tokens(queries) + mean_tokens(docs)) / PAIR_TOKENS


def build_plan(stages: Mapping[str, Namespace], skip: list[str], rows: list[str] | None, preset: Preset,
               spec: TaskSpec, counts: dict[str, int], dev: tuple[int, Namespace], table: Namespace,
               pair_length: float = 1.0) -> Plan:
    """The plan of the stages `stages` (each wanted stage's resolved configuration; `skip`: exported
    already), with the reader's rates measured when the estimate can be made.

    Args:
        stages: stage name → its resolved `fit` configuration, every stage the run wants.
        skip: the stages exported already.
        rows: the table's rows (None: every strategy of evaluate_cfrag.yaml).
        preset: the run's preset (whether it chooses on dev, its readers and calibrations).
        spec: the run's task.
        counts: questions per split (`question_counts`).
        dev: the dev choice's number of configurations and its resolved evaluate configuration.
        table: the test table's resolved evaluate configuration (its reader, its questions).
        pair_length: the data's (question, doc) pairs' length against SynthLaMP's (`pair_scale`).
    """
    candidates, dev_config = dev
    train = [s for s in stages if s not in skip]
    test = min(
        n for n in (counts["test"], table.evaluation.init_args.max_examples) if n is not None
    )
    dev_questions = min(
        n for n in (counts["dev"], dev_config.evaluation.init_args.max_examples) if n is not None
    )
    n_rows = len(table.strategies) if rows is None else len(rows)
    # read by the tuned LLM whatever reads
    tuned = sum(1 for r in rows or [] if r.endswith(" + tuned generator"))
    reads_labels = spec.labels is not None
    readers = [r for r in preset.readers or [] if r != "trained" or "reader" in stages] if reads_labels else []
    answers = {"dev choice": dev_questions * candidates * preset.select_order_on_dev,
               "test table": test * (n_rows - tuned)}
    llm_answers = {"tuned generator's rows": test * tuned}
    if preset.select_order_on_dev and "generator" in stages and preset.calibrations and reads_labels:
        llm_answers["tuned generator's calibration"] = dev_questions
    # each reader reads BM25's dev prompts once; only the trained one's cost is negligible
    if len(readers) > 1:
        llm_answers["the reader's dev choice"] = dev_questions
    trained = {s: stages[s] for s in train}
    plan = Plan(train, skip, rows, training_work(trained, counts, pair_length),
                feedback_prompts(trained, counts["train"]), answers, llm_answers, readers or ["llm"],
                budget=rates.budget_minutes())
    measure_rates(plan, spec, rates.evaluation_llm_settings(table))
    return plan


def measure_rates(plan: Plan, spec: TaskSpec, llm: dict) -> None:
    """The rates of `plan`'s readers measured here now, or the reason there is no estimate.

    Args:
        plan: the plan whose `rates` (or `reason`) are set.
        spec: the run's task.
        llm: the evaluation's resolved LLM settings (`evaluation_llm_settings`).
    """
    if spec.labels is None or llm.get("answer_mode") != "choose":
        plan.reason = "answers are generated (the estimate covers chosen labels)"
    elif llm.get("backend") != "hf":
        plan.reason = (
            f"the estimate measures the hf reader, and this run reads with {llm.get('backend')}"
        )
    else:
        texts = rates.encoder_rate()
        plan.rates = {**rates.reader_rates(spec.labels, llm["model"], rates.reader_dtype(llm), int(llm.get("batch_size", 8))),
                      "encoder_texts": texts}
        if "trained" in plan.readers:
            plan.rates.update({f"trained_{kind}": texts / n for kind, n in TRAINED_TEXTS.items()})
