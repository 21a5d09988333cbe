"""The task a LaMP folder was converted for, read from its convert.json: the one door through which
a converted folder's own label set reaches `get_task` (every DataModule, evaluation and command
reads a folder through it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from persrag_lightning.data.errors import LampFormatError
from persrag_lightning.data.tasks import define_task, get_task

__all__ = ["MANIFEST", "resolve_task"]

MANIFEST = "convert.json"  # what `persrag data convert` writes beside the LaMP files
# a folder without a manifest, or no folder (SynthLaMP): the main job's task
DEFAULT_TASK = "LaMP-2"


def folder_task(data_dir: str | Path) -> str | None:
    """The task of a converted folder (None for a folder without convert.json, e.g. LaMP's own
    files); a label task's labels are registered with `get_task` on the way."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest: Any = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LampFormatError(f"{path}: not a readable convert.json: {e}") from None
    record = manifest.get("task") if isinstance(manifest, dict) else None
    # written before convert.json named its task on its own
    if record is None and isinstance(manifest, dict):
        record = {"name": (manifest.get("conversion") or {}).get("task")}
    try:
        return define_task(record)
    except ValueError as e:
        raise LampFormatError(f"{path}: task: {e}") from None


def resolve_task(task: str | None, data_dir: str | Path | None) -> str:
    """The task a run reads `data_dir` as: the folder's own when `task` is None (LaMP-2 without
    one); a task that contradicts the folder's convert.json is refused in one line naming both."""
    found = folder_task(data_dir) if data_dir is not None else None
    if task is None:
        return found or DEFAULT_TASK
    try:
        name = get_task(task).name
    except ValueError as e:
        raise LampFormatError(f"task: {e}") from None
    if found is not None and found != name:
        raise LampFormatError(
            f"task: {task!r}, but {data_dir} was converted for {found} (its {MANIFEST}); name "
            f"{found} as the task (--task {found}, or the config's task)"
        )
    return name
