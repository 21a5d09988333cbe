"""What switches a preset to another task: the overrides every stage's data, the generator stage and the
evaluation take from `--task` (LaMP-2 is the configs' own task)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from persrag_lightning.data.tasks import get_task
from persrag_lightning.presets import Preset

__all__ = ["TaskOverrides", "task_overrides"]


@dataclass
class TaskOverrides:
    """What switches a preset to a task: every stage's data, the generator stage's and the
    evaluation's overrides."""

    data: dict[str, Any]
    generator: dict[str, Any]
    evaluate: dict[str, Any]


def task_overrides(task: str, preset: Preset) -> TaskOverrides:
    """Label tasks keep the preset's answer mode; generation tasks (LaMP-4/5/7) have no labels to
    `choose` among, so they generate, in the evaluation and in the generator stage's validation
    alike. LaMP-2 is the configs'.

    Args:
        task: the task `--task` names (or the data folder's).
        preset: the preset the run trains, whose evaluation overrides the task's are added to.
    """
    spec = get_task(task)
    evaluate = preset.overrides("evaluate")
    if spec.name == "LaMP-2":
        return TaskOverrides({}, {}, evaluate)
    if spec.labels is None:
        evaluate = {k: v for k, v in evaluate.items() if not k.startswith("evaluation.llm.answer_mode")}
        return TaskOverrides({"data.init_args.task": spec.name}, {"model.init_args.answer_mode": "generate"},
                             {"evaluation.task": spec.name, **evaluate, "evaluation.llm.answer_mode": "generate"})
    return TaskOverrides({"data.init_args.task": spec.name}, {}, {"evaluation.task": spec.name, **evaluate})
