"""Per-task facts of LaMP: profile fields, query extraction, doc rendering and label space."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from persrag_lightning.data.records import HistoryDoc

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
    # the profile field that holds the user's *judgment* of a history doc, one of `labels` (LaMP-2's tag, LaMP-3's
    # score); None where profile items carry no label: LaMP-1's profile is the user's own papers (the citation
    # choice exists only in the question), LaMP-4/5/7 are generation tasks
    label_field: str | None = None

    def doc_label(self, doc: HistoryDoc) -> int:
        """Index of a history doc's judgment in `labels`, + 1; 0 when the task has no label field or the doc's
        value is missing or not a label (LaMP-3 scores written as numbers, "4.0", count as "4")."""
        if self.label_field is None or self.labels is None:
            return 0
        value = str(doc.fields.get(self.label_field, "")).strip()
        if self.name == "LaMP-3":
            try:
                number = float(value)
                value = str(int(number)) if number.is_integer() else value
            except ValueError:
                pass
        try:
            return self.labels.index(value) + 1
        except ValueError:
            return 0

    def render_doc(self, doc: HistoryDoc) -> str:
        """A history doc as the text the encoders and prompts see: its fields in the task's order."""
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


def get_task(name: str) -> TaskSpec:
    """Look a task up by `LaMP-2`, `LaMP_2`, `lamp2` or `2`; unknown names list the known ones."""
    key = re.sub(r"[^0-9]", "", str(name))
    spec = TASKS.get(f"LaMP-{key}")
    if spec is None:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return spec
