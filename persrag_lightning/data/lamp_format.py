"""The LaMP format's conventions, shared by its reader (lamp.py) and its writer (lamp_write.py): the
splits and their file names, the task's code in an outputs file, dates, and the JSON type names that
messages about bad input use."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from persrag_lightning.data.errors import LampFormatError
from persrag_lightning.data.tasks import TaskSpec, get_task

__all__ = ["DATE_PATTERN", "SPLITS", "format_date", "json_type_name", "outputs_path", "parse_date", "questions_path",
           "task_code", "task_spec"]

SPLITS = ("train", "dev", "test")
_DATE = re.compile(DATE_PATTERN := r"[0-9]+(?:-[0-9]+)*")  # serving's request models check the same


def questions_path(data_dir: str | Path, split: str) -> Path:
    """Where a split's questions live, by the LaMP naming convention."""
    return Path(data_dir) / f"{split}_questions.json"


def outputs_path(data_dir: str | Path, split: str) -> Path:
    """Where a split's golds live, by the LaMP naming convention."""
    return Path(data_dir) / f"{split}_outputs.json"


def task_spec(task: str | TaskSpec) -> TaskSpec:
    """get_task, with an unknown name raised as LampFormatError like every other bad input of the LaMP reader and writer."""
    if isinstance(task, TaskSpec):
        return task
    try:
        return get_task(task)
    except ValueError as e:
        raise LampFormatError(f"task: {e}") from None


def task_code(task: str | TaskSpec) -> str:
    """The spelling of the outputs file's `task` field: `LaMP_2` for LaMP-2."""
    return task_spec(task).name.replace("-", "_")


def parse_date(text: str) -> tuple[int, ...]:
    """'2016-03-27' -> (2016, 3, 27); anything but '-'-separated integers raises ValueError."""
    if not isinstance(text, str) or not _DATE.fullmatch(text):
        raise ValueError(f"expected '-'-separated integers, got {text!r}")
    return tuple(map(int, text.split("-")))


def format_date(date: tuple[int, ...]) -> str:
    """(2016, 3, 7) -> '2016-03-07': year padded to 4 digits, the other parts to 2, so parse_date inverts it."""
    return "-".join(f"{p:04d}" if i == 0 else f"{p:02d}" for i, p in enumerate(date))


def json_type_name(value: Any) -> str:
    """What a message calls a JSON value's type: null for None, else the Python type's name."""
    return "null" if value is None else type(value).__name__
