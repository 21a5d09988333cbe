"""What switches a preset to another task: the overrides every stage's data, the generator stage and the
evaluation take from `--task` (LaMP-2 is the configs' own task)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from persrag_lightning.data.tasks import TaskSpec
from persrag_lightning.presets import Preset
from persrag_lightning.stages import Key

__all__ = ["TaskOverrides", "task_overrides"]


@dataclass(frozen=True)
class TaskOverrides:
    """What switches a preset to a task: every stage's data, the generator stage's and the
    evaluation's overrides."""

    data: dict[str, Any]
    generator: dict[str, Any]
    evaluate: dict[str, Any]


def task_overrides(spec: TaskSpec, preset: Preset) -> TaskOverrides:
    """Label tasks keep the preset's answer mode; generation tasks (LaMP-4/5/7) have no labels to
    `choose` among, so they generate, in the evaluation and in the generator stage's validation
    alike. LaMP-2 is the configs'.

    Args:
        spec: the task `--task` names (or the data folder's), looked up once by the job.
        preset: the run's preset, whose evaluation overrides the task's are added to.
    """
    evaluate = preset.overrides("evaluate")
    if spec.name == "LaMP-2":
        return TaskOverrides({}, {}, evaluate)
    if spec.labels is None:
        evaluate = {k: v for k, v in evaluate.items() if not k.startswith(Key.LLM_ANSWER_MODE)}
        return TaskOverrides({Key.TASK: spec.name}, {Key.ANSWER_MODE: "generate"},
                             {Key.EVALUATION_TASK: spec.name, **evaluate, Key.LLM_ANSWER_MODE: "generate"})
    return TaskOverrides({Key.TASK: spec.name}, {}, {Key.EVALUATION_TASK: spec.name, **evaluate})
