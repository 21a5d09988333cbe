"""A user's interaction log (CSV, JSON Lines, JSON or Parquet, gzipped or not) → a LaMP folder in
CFRAG's time-based layout.

One log row is one item a user produced: a review with its star rating, a post with its tag, an
article with its category. `convert_log` reads the columns the options name, checks every value
(data/log_rows.py: a bad row is skipped and counted by reason, or under `strict` refuses the log),
and writes, per user, items oldest first:

- the latest item is the user's **test** question, the one before it **dev**, the `train_per_user`
  before those **train** questions (the question's text comes from the item's text column through
  the task's prompt, its gold is the item's label);
- each question's **profile** is the user's items dated strictly before it: items of the same time
  are never in each other's profiles, and a question with no older item is not asked; items of one
  user and one time are ordered by their content (item id, then text, then label), so the last of
  them in that order is the latest, whatever the file's row order (data/log_table.py);
- users with fewer than `min_items` items are dropped (counted); `max_test_users` / `max_dev_users`
  keep a seeded random subset of users' test / dev questions (the others keep their train questions
  only).

A label task (`task="labels"`) takes its label set from the log: the labels of the train questions
and their profiles, in alphabetical order; a dev or test question whose label train never shows is
not asked (counted). The output folder appears whole or not at all, and the same log with the same
options gives byte-identical files (docs/data/your-own-data.md).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from persrag_lightning.data.folder_task import MANIFEST
from persrag_lightning.data.lamp import (
    OutputsWriter,
    QuestionsWriter,
    gc_paused,
    outputs_path,
    profile_item_json,
    questions_path,
    task_spec,
)
from persrag_lightning.data.log_files import LogFormatError
from persrag_lightning.data.log_rows import describe
from persrag_lightning.data.log_table import LogTable, check_log
from persrag_lightning.data.synth_text import LAMP2_PROMPT, LAMP3_PROMPT, LAMP4_PROMPT, LAMP5_PROMPT
from persrag_lightning.data.tasks import LABEL_MARKER, LABEL_TASK, TaskSpec, label_task
from persrag_lightning.utils import atomic_directory, atomic_write_json

__all__ = ["LAYOUTS", "ConvertOptions", "convert_log"]

TEXT = "{text}"  # where a question's template puts the item's text
LABELS_PROMPT = (
    "Which label does the following text belong to? Just answer with the label without further "
    f"explanation. {LABEL_MARKER} "
)


@dataclass(frozen=True)
class TaskLayout:
    """How a log item becomes a LaMP item of one task: which profile field holds the text column,
    which the label column (the question's gold), and LaMP's prompt before the text."""

    text_field: str
    label_field: str
    template: str
    marker: str  # the words after which the task's query extraction (data/tasks.py) reads the text


LAYOUTS: dict[str, TaskLayout] = {
    "LaMP-2": TaskLayout("description", "tag", LAMP2_PROMPT + TEXT, "description:"),
    "LaMP-3": TaskLayout("text", "score", LAMP3_PROMPT + TEXT, "review:"),
    "LaMP-4": TaskLayout("text", "title", LAMP4_PROMPT + TEXT, "article:"),
    "LaMP-5": TaskLayout("abstract", "title", LAMP5_PROMPT + TEXT, "paper:"),
    LABEL_TASK: TaskLayout("text", "label", LABELS_PROMPT + TEXT, LABEL_MARKER),
}
# LaMP-1 (a choice between two references) and LaMP-7 (a tweet from its paraphrase) ask questions a
# log of single items does not hold.


@dataclass(frozen=True)
class ConvertOptions:
    """What `persrag data convert` reads and how it splits; column options name the log's columns
    (`text` may name several, comma-separated, joined in that order)."""

    task: str
    user: str
    date: str
    text: str
    label: str
    item: str | None = None
    # the k-core convention of review data: a user needs a history to personalize
    min_items: int = 5
    # train questions per user, before the dev and test items (SynthLaMP has 2)
    train_per_user: int = 2
    # a seeded random subset of test users (a 2-core main job reads 300)
    max_test_users: int | None = None
    max_dev_users: int | None = None
    seed: int = 0
    template: str | None = None   # the question's input; `{text}` is replaced by the item's text
    strict: bool = False          # refuse the log at its first bad row instead of skipping bad rows
    # several users in one cell (co-authors "A, B"): each named user gets the item
    user_sep: str | None = None
    dedupe: bool = False          # keep one of a user's items with the same text (the oldest)

    @property
    def labels_from_log(self) -> bool:
        return self.task.strip().lower() == LABEL_TASK

    def spec(self) -> TaskSpec:
        """The task, a label task with no labels yet (the log gives them)."""
        return label_task(()) if self.labels_from_log else task_spec(self.task)

    def check(self) -> TaskLayout:
        """The task's layout, with the options' combination checked (one line each, exit code 2)."""
        spec = self.spec()
        if spec.name not in LAYOUTS:
            raise LogFormatError(
                f"--task: {spec.name} cannot be made from a log of single items; convert to one of "
                f"{', '.join(LAYOUTS)}"
            )
        if self.train_per_user < 1:
            raise LogFormatError(f"--train_per_user: must be at least 1, got {self.train_per_user}")
        # test, dev, the train questions, and one item in the oldest profile
        need = self.train_per_user + 3
        if self.min_items < need:
            raise LogFormatError(f"--min_items: {self.min_items} is too few for --train_per_user "
                                 f"{self.train_per_user}: a user needs {need} items (test, dev, "
                                 f"{self.train_per_user} train, one profile item before them)")
        for name in ("max_test_users", "max_dev_users"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LogFormatError(f"--{name}: must be at least 1, got {value}")
        if self.user_sep is not None and not self.user_sep:
            raise LogFormatError(
                "--user_sep: an empty separator; give the text between two users, e.g. ','"
            )
        if not all(self.text_columns()):
            raise LogFormatError(
                f"--text: an empty column name in {self.text!r}; name columns as a,b"
            )
        return self._layout(spec, LAYOUTS[spec.name])

    def _layout(self, spec: TaskSpec, layout: TaskLayout) -> TaskLayout:
        if self.template is None:
            return layout
        if self.template.count(TEXT) != 1:
            raise LogFormatError(
                f"--template: must hold {TEXT} exactly once, got {self.template!r}"
            )
        probe = "an item's own words"
        if spec.extract_query(self.template.replace(TEXT, probe)) != probe:
            raise LogFormatError(
                f"--template: {spec.name} reads the query after {layout.marker!r}; end the "
                f"template with {layout.marker} {TEXT}, got {self.template!r}"
            )
        return TaskLayout(layout.text_field, layout.label_field, self.template, layout.marker)

    def text_columns(self) -> list[str]:
        return [c.strip() for c in self.text.split(",")]

    def columns(self) -> dict[str, str]:
        """Option name → the log column it names (`text`: the first of its columns)."""
        out = {"user": self.user, "date": self.date, "text": self.text_columns()[0], "label": self.label}
        if self.item is not None:
            out["item"] = self.item
        return out


@dataclass
class Conversion:
    """What a conversion kept, skipped, dropped and wrote (printed by `persrag data convert`, stored
    in convert.json)."""

    task: str
    rows: int
    users: int
    items: int
    dropped_users: int
    dropped_rows: int  # items of the dropped users
    questions: dict[str, int]
    items_per_user: dict[str, float]
    labels: dict[str, int] = field(default_factory=dict)  # label → items (label tasks)
    # the majority label of train, scored on test
    baseline: dict[str, Any] = field(default_factory=dict)
    skipped_rows: int = 0
    skipped: dict[str, dict[str, Any]] = field(default_factory=dict)  # reason → {rows, first_rows}
    repeated_texts: int = 0  # items whose (user, text) an older item of the user has
    deduplicated: int = 0    # of those, dropped by `dedupe`
    # why planned questions were not asked → how many
    not_asked: dict[str, int] = field(default_factory=dict)
    label_set: list[str] = field(default_factory=list)  # a label task's labels (the train split's)
    # of the dropped users: every question would have had no older item
    users_without_questions: int = 0

    def summary(self) -> str:
        """The lines a researcher checks first."""
        q = self.items_per_user
        few = self.dropped_users - self.users_without_questions
        lines = [(f"{self.task}: {self.rows} rows → {self.users} users, {self.items} items "
                  f"(dropped {few} users with too few items"
                  + (f" and {self.users_without_questions} whose items fall on too few dates"
                     if self.users_without_questions else "") + f": {self.dropped_rows} items)")]
        if self.skipped_rows:
            lines.append(
                f"skipped {self.skipped_rows} of {self.rows} rows: {describe(self.skipped)}"
            )
        if self.repeated_texts:
            lines.append(
                f"repeated texts: {self.repeated_texts} items repeat an older item's text of the same user; "
                + ("dropped (--dedupe)" if self.deduplicated else "kept (--dedupe keeps one)")
            )
        lines += [("items per user: min {min:.0f}, 25 % {p25:.0f}, median {p50:.0f}, 75 % {p75:.0f}, "
                   "max {max:.0f}").format(**q),
                  "questions: " + ", ".join(f"{s} {n}" for s, n in self.questions.items())
                  + "".join(f"; not asked, {why}: {n}" for why, n in self.not_asked.items() if n)]
        if self.label_set:
            lines.append(
                f"label set ({len(self.label_set)}, the train split's): {', '.join(self.label_set)}"
            )
        if self.labels:
            total = sum(self.labels.values())
            lines.append("labels: " + ", ".join(f"{k!r} {100 * n / total:.1f} %" for k, n in
                                                sorted(self.labels.items(), key=lambda kv: (-kv[1], kv[0]))))
        if self.baseline:
            b = self.baseline
            scores = ", ".join(f"{k} {v:.3f}" for k, v in b["test"].items())
            lines.append(f"test, majority label of train ({b['label']!r}), no reader: {scores}")
        return "\n".join(lines)


def convert_log(
    log: str | Path, out: str | Path, options: ConvertOptions, overwrite: bool = False
) -> Conversion:
    """Check the whole log, then write the LaMP folder `out` (atomically) with its manifest
    convert.json."""
    path, out = Path(log), Path(out)
    layout = options.check()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LogFormatError(
            f"--out: {out} exists and is not empty; pass --overwrite to replace it"
        )
    table = check_log(path, options, options.spec())
    plan = _plan_questions(table, options)
    spec = label_task(tuple(plan.label_set)) if options.labels_from_log else options.spec()
    with atomic_directory(out) as tmp, gc_paused():
        questions, train_labels, test_golds = write_questions(tmp, table, plan, spec, layout)
        conversion = _conversion(
            table, plan, spec, questions, _majority_baseline(spec, train_labels, test_golds)
        )
        task = {"name": spec.name, **({"labels": list(spec.labels or ())} if options.labels_from_log else {})}
        atomic_write_json(tmp / MANIFEST, {"source": path.name, "sha256": _digest(path), "task": task,
                                           "options": asdict(options), "conversion": asdict(conversion)})
    return conversion


def _conversion(table: LogTable, plan: QuestionPlan, spec: TaskSpec, questions: dict[str, int],
                baseline: dict[str, Any]) -> Conversion:
    """What was read, skipped, dropped and written; users are those who ask a question."""
    asking = [(user, len(user)) for user, asked in zip(table.user_rows(), plan.asked.any(axis=1).tolist()) if asked]
    kept = [r for user, _ in asking for r in user]
    counts = np.array([n for _, n in asking] or [0])
    silent = len(plan.asked) - len(asking)
    return Conversion(
        spec.name, table.rows, len(asking), len(kept), table.dropped_users + silent,
        table.dropped_items + int(table.counts.sum()) - len(kept), questions,
        {k: float(v) for k, v in zip(("min", "p25", "p50", "p75", "max"),
                                     np.percentile(counts, [0, 25, 50, 75, 100]))},
        labels=dict(Counter(table.labels[r] for r in kept)) if spec.labels is not None else {}, baseline=baseline,
        skipped_rows=table.checks.skipped, skipped=table.checks.report(), repeated_texts=table.repeated,
        deduplicated=table.deduplicated, not_asked=plan.not_asked, label_set=list(plan.label_set),
        users_without_questions=silent)


# ------------------------------------------------------------------------------------ the questions

NO_OLDER_ITEM = "no older item"  # every earlier item of the user has the question's time
# a label task's dev or test gold that train never shows
UNSEEN_LABEL = "label not in the train split"


@dataclass
class QuestionPlan:
    """Every kept user's questions as a grid (users × slots): slot k asks the user's item at
    `positions[u, k]` in split `splits[k]`, with a profile of the user's first `cuts[u, k]` items,
    where `asked[u, k]`."""

    splits: list[str]
    positions: np.ndarray
    cuts: np.ndarray
    asked: np.ndarray
    not_asked: dict[str, int]
    label_set: list[str]


def _plan_questions(table: LogTable, options: ConvertOptions) -> QuestionPlan:
    """Which of each user's items are asked, in which split, with which profile: every item dated
    strictly before the question. A label task's label set is the train questions' and their
    profiles' labels."""
    asks_test, asks_dev = _split_rows(table.counts, options)
    splits = ["train"] * options.train_per_user + ["dev", "test"]
    positions = table.counts[:, None] - len(splits) + np.arange(len(splits))
    cuts = table.cuts[table.starts[:, None] + positions]
    wanted = np.ones(positions.shape, dtype=bool)
    wanted[:, -2], wanted[:, -1] = asks_dev, asks_test
    asked = wanted & (cuts > 0)
    not_asked = {NO_OLDER_ITEM: int((wanted & (cuts == 0)).sum()), UNSEEN_LABEL: 0}
    label_set: list[str] = []
    if options.labels_from_log:
        label_set = _train_labels(table, positions, cuts, asked[:, :-2])
        known = set(label_set)
        golds = table.order[table.starts[:, None] + positions[:, -2:]]
        seen = np.array(
            [[table.labels[e] in known for e in row] for row in golds.tolist()], dtype=bool
        )
        unseen = asked[:, -2:] & ~seen.reshape(golds.shape)
        not_asked[UNSEEN_LABEL] = int(unseen.sum())
        asked[:, -2:] &= ~unseen
    return QuestionPlan(
        splits, positions, cuts, asked, {k: v for k, v in not_asked.items() if v}, label_set
    )


def _train_labels(
    table: LogTable, positions: np.ndarray, cuts: np.ndarray, train: np.ndarray
) -> list[str]:
    """The labels of the asked train questions (`train`: users × train slots) and of their profiles,
    sorted: a label task's label set."""
    found: set[str] = set()
    for user, ps, cs, ok in zip(
        table.user_rows(), positions.tolist(), cuts.tolist(), train.tolist()
    ):
        asked = [(p, c) for p, c, a in zip(ps, cs, ok) if a]
        if asked:
            found.update(table.labels[r] for r in user[:max(c for _, c in asked)])
            found.update(table.labels[user[p]] for p, _ in asked)
    return sorted(found)


def write_questions(folder: Path, table: LogTable, plan: QuestionPlan, spec: TaskSpec,
                    layout: TaskLayout) -> tuple[dict[str, int], Counter[str], list[str]]:
    """Each kept user's questions into the split files of `folder`: (questions per split, train
    labels, test golds)."""
    questions = {"train": 0, "dev": 0, "test": 0}
    train_labels: Counter[str] = Counter()
    test_golds: list[str] = []
    grid = zip(table.user_rows(), plan.positions.tolist(), plan.cuts.tolist(), plan.asked.tolist())
    with ExitStack() as stack:
        qw = {s: stack.enter_context(QuestionsWriter(questions_path(folder, s), spec)) for s in questions}
        ow = {
            s: stack.enter_context(OutputsWriter(outputs_path(folder, s), spec)) for s in questions
        }
        for user, positions, cuts, asked in grid:
            if not any(asked):
                continue
            docs = [profile_item_json(table.doc_ids[r], table.dates[r],
                                      _fields(spec, layout, table.texts[r], table.labels[r])) for r in user]
            for p, split, cut, ask in zip(positions, plan.splits, cuts, asked):
                if not ask:
                    continue
                r = user[p]
                qw[split].write_record(table.doc_ids[r], layout.template.replace(TEXT, table.texts[r]),
                                       table.users[r], "[" + ", ".join(docs[:cut]) + "]")
                ow[split].write(table.doc_ids[r], table.labels[r])
                questions[split] += 1
                if split == "train":
                    train_labels[table.labels[r]] += 1
                elif split == "test":
                    test_golds.append(table.labels[r])
    return questions, train_labels, test_golds


def _split_rows(counts: np.ndarray, options: ConvertOptions) -> tuple[np.ndarray, np.ndarray]:
    """Which kept users (by index) ask a test and a dev question: all, or a seeded random subset of
    each."""
    n = len(counts)
    order = np.random.default_rng(options.seed).permutation(n)
    test = np.zeros(n, dtype=bool)
    dev = np.zeros(n, dtype=bool)
    test[order[:options.max_test_users or n]] = True
    dev[order[:options.max_dev_users or n]] = True
    return test, dev


def _fields(spec: TaskSpec, layout: TaskLayout, text: str, label: str) -> dict[str, str]:
    values = {layout.text_field: text, layout.label_field: label}
    return {f: values[f] for f in spec.profile_fields}


def _majority_baseline(spec: TaskSpec, train: Counter[str], test: list[str]) -> dict[str, Any]:
    """The reader-free floor every LLM row must beat: train's most frequent label answered to every
    test question (ties: the label listed first by the task)."""
    if not spec.labels or not train or not test:
        return {}
    label = max(spec.labels, key=lambda lab: (train[lab], -spec.labels.index(lab)))
    scores = {"accuracy": float(np.mean([g == label for g in test]))}
    if spec.kind == "regression":
        errors = np.array([float(g) - float(label) for g in test])
        scores.update(mae=float(np.abs(errors).mean()), rmse=float(np.sqrt((errors ** 2).mean())))
    return {"label": label, "test": scores}


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
