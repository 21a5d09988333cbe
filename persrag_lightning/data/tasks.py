"""Per-task facts of LaMP: profile fields, query extraction, doc rendering and label space; and the
label tasks a converted folder defines (`persrag data convert --task labels`), known to `get_task`
once the folder is read."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from persrag_lightning.data.records import HistoryDoc

__all__ = ["LABEL_MARKER", "LABEL_TASK", "LAMP2_LABELS", "TaskSpec", "define_task", "get_task",
           "label_task", "task_record"]

TaskKind = Literal["classification", "regression", "generation"]

LAMP2_LABELS = (
    "sci-fi", "based on a book", "comedy", "action", "twist ending", "dystopia", "dark comedy", "classic",
    "psychology", "fantasy", "romance", "thought-provoking", "social commentary", "violence", "true story",
)


def _after(marker: str) -> Callable[[str], str]:
    """Query = text after the first occurrence of `marker` (the whole input if absent)."""

    def extract(text: str) -> str:
        i = text.find(marker)
        return text[i + len(marker):].strip() if i >= 0 else text.strip()

    return extract


def _quoted_title(text: str) -> str:
    """LaMP-1 inputs hold the paper title in double quotes; the query is that title."""
    found = re.findall(r'"([^"]+)"', text)
    return found[0].strip() if found else text.strip()


@dataclass(frozen=True)
class TaskSpec:
    """What the framework must know about one LaMP task."""

    name: str
    kind: TaskKind
    profile_fields: tuple[str, ...]
    extract_query: Callable[[str], str]
    labels: tuple[str, ...] | None = None
    # the profile field that holds the user's *judgment* of a history doc, one of `labels` (LaMP-2's
    # tag, LaMP-3's score); None where profile items carry no label: LaMP-1's profile is the user's
    # own papers (the citation choice exists only in the question), LaMP-4/5/7 are generation tasks
    label_field: str | None = None

    def label_index(self, value: str | None) -> int | None:
        """Index of `value` in `labels`; None when it is not a label (LaMP-3 scores written as
        numbers, "4.0", count as "4")."""
        if self.labels is None or value is None:
            return None
        value = str(value).strip()
        if self.kind == "regression":
            try:
                number = float(value)
                value = str(int(number)) if number.is_integer() else value
            except ValueError:
                pass
        return self.labels.index(value) if value in self.labels else None

    def doc_label(self, doc: HistoryDoc) -> int:
        """Index of a history doc's judgment in `labels`, + 1; 0 when the task has no label field or
        the doc's value is missing or not a label."""
        if self.label_field is None:
            return 0
        index = self.label_index(doc.fields.get(self.label_field))
        return 0 if index is None else index + 1

    def render_doc(self, doc: HistoryDoc) -> str:
        """A history doc as the text the encoders and prompts see: its fields in the task's
        order."""
        return " ".join(doc.fields[f] for f in self.profile_fields if doc.fields.get(f))


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("LaMP-1", "classification", ("title", "abstract"), _quoted_title, ("[1]", "[2]")),
        TaskSpec("LaMP-2", "classification", ("description", "tag"), _after("description:"), LAMP2_LABELS,
                 "tag"),
        TaskSpec("LaMP-3", "regression", ("text", "score"), _after("review:"), ("1", "2", "3", "4", "5"),
                 "score"),
        TaskSpec("LaMP-4", "generation", ("text", "title"), _after("article:")),
        TaskSpec("LaMP-5", "generation", ("title", "abstract"), _after("paper:")),
        TaskSpec("LaMP-7", "generation", ("text",), _after(":")),
    )
}


# ---- label tasks of converted folders ------------------------------------------------------------

# a classification task whose label set is a converted folder's (its convert.json)
LABEL_TASK = "labels"
# the words of a label task's question after which its query (the item's text) starts
LABEL_MARKER = "text:"
_FOLDER_TASKS: dict[str, TaskSpec] = {}  # label tasks of the folders this process has read


@lru_cache(maxsize=64)
def label_task(labels: tuple[str, ...]) -> TaskSpec:
    """The task of a folder converted with `--task labels`: LaMP-2's shape (a text and its label per
    profile item) over the folder's own labels; the same labels give the same object."""
    return TaskSpec(LABEL_TASK, "classification", ("text", "label"), _after(LABEL_MARKER), tuple(labels), "label")


def register_task(spec: TaskSpec) -> TaskSpec:
    """Make a folder's label task known to `get_task` in this process (data/folder_task.py does it
    when a folder is read); a process holds one label set per task name, the last folder's."""
    _FOLDER_TASKS[spec.name] = spec
    return spec


def task_record(name: str) -> dict[str, Any]:
    """What a folder or an export stores to name its task: the name, and a label task's labels."""
    spec = get_task(name)
    return {"name": spec.name, **({"labels": list(spec.labels or ())} if spec.name not in TASKS else {})}


def define_task(record: dict[str, Any]) -> str:
    """The task a `task_record` names, a label task registered with its labels; ValueError on a
    malformed one."""
    name = record.get("name") if isinstance(record, dict) else None
    if name != LABEL_TASK:
        return get_task(str(name)).name
    labels = record.get("labels")
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) and x.strip() for x in labels):
        raise ValueError(f"task {LABEL_TASK!r}: expected its labels as a list of non-empty strings, got {labels!r}")
    return register_task(label_task(tuple(labels))).name


def get_task(name: str) -> TaskSpec:
    """Look a task up by `LaMP-2`, `LaMP_2`, `lamp2` or `2`, or a label task of a folder this
    process has read (`labels`); unknown names list the known ones."""
    folder_task = _FOLDER_TASKS.get(str(name).strip().lower())
    if folder_task is not None:
        return folder_task
    if str(name).strip().lower() == LABEL_TASK:
        raise ValueError(
            f"task {LABEL_TASK!r} takes its labels from a converted folder: name the folder with "
            "--data_dir (written by `persrag data convert --task labels`; its convert.json lists them)"
        )
    key = re.sub(r"[^0-9]", "", str(name))
    spec = TASKS.get(f"LaMP-{key}")
    if spec is None:
        raise ValueError(
            f"unknown task {name!r}; known tasks: {', '.join(TASKS)}, {LABEL_TASK} (a converted "
            "folder's own labels)"
        )
    return spec
