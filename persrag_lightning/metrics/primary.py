"""Which metric a LaMP task is judged on and which way is better: one answer for the tables, the dev
choices and the checkpoints that monitor `val/metric`."""

from __future__ import annotations

from dataclasses import dataclass

from persrag_lightning.data.tasks import get_task

__all__ = ["HIGHER_IS_BETTER", "METRIC_NAMES", "PrimaryMetric", "primary_metric"]

# The metrics a table reports per task kind (the first is the primary one), and which way each is
# better.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "classification": ("accuracy", "f1"),
    "regression": ("mae", "rmse"),
    "generation": ("rouge-1", "rouge-L"),
}
HIGHER_IS_BETTER = {"accuracy": True, "f1": True, "mae": False, "rmse": False, "neg_mae": True,
                    "rouge-1": True, "rouge-L": True}


@dataclass(frozen=True)
class PrimaryMetric:
    """The metric a task's rows are compared on and which way is better: one answer for the tables,
    the dev choices and the checkpoints that monitor `val/metric`.

    Args:
        name: the metric's key in a LaMP metric's output (accuracy, mae or rouge-1).
        greater_is_better: whether a larger value is better (False for MAE).
    """

    name: str
    greater_is_better: bool

    def ascending(self, value: float) -> float:
        """`value` turned so that larger is better (an MAE negated): what a `max` or a `mode: max`
        compares."""
        return value if self.greater_is_better else -value


def primary_metric(task_name: str) -> PrimaryMetric:
    """The task's primary metric: the table's first (accuracy, mae or rouge-1) with its direction.

    Args:
        task_name: a LaMP task (`LaMP-2`, `LaMP_2`, `2`, ...) or a registered label set.
    """
    name = METRIC_NAMES[get_task(task_name).kind][0]
    return PrimaryMetric(name, HIGHER_IS_BETTER[name])
