"""The optimiser settings the stage modules take whole (`training:` in a stage config), and the one
AdamW with warm-up and schedule that stages 2, 3 and the generator build from them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

__all__ = ["DistillationSettings", "OptimizerSettings", "adamw"]

LrSchedule = Literal["constant", "linear"]


@dataclass
class OptimizerSettings:
    """AdamW with an optional linear warm-up and a schedule after it, stepped per optimizer step.

    Args:
        lr: AdamW's peak learning rate.
        weight_decay: AdamW's weight decay (never on biases and norms).
        warmup_ratio: share of the optimizer steps spent warming the learning rate up linearly.
        lr_schedule: after warm-up, `constant` or `linear` decay to 0 at the last step.
    """

    lr: float = 6e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    lr_schedule: LrSchedule = "constant"


@dataclass
class DistillationSettings(OptimizerSettings):
    """How stages 2 and 3 learn from LLM feedback: KL(p_LLM ‖ p_model) over a candidate list (Eq. 8
    / 12) under two temperatures, AdamW, and the cutoff of the validation ranking metrics.

    Args:
        student_temperature: temperature T of the model's softmax over the candidates (Eq. 7 / 11).
        teacher_temperature: temperature T_t of the LLM-feedback (or teacher) softmax (Eq. 6).
        eval_k: cutoff of the validation ranking metrics (NDCG@k, recall@k) against the feedback
            ranking.
    """

    student_temperature: float = 1.0
    teacher_temperature: float = 1.0
    eval_k: int = 5


def _warmup_linear(step: int, warmup: int, total: int, schedule: LrSchedule) -> float:
    """LR factor: linear warmup over `warmup` steps, then constant or linear decay to 0 at
    `total`.

    Args:
        step: the optimizer step.
        warmup: warm-up steps.
        total: the run's optimizer steps.
        schedule: `constant` or `linear` decay after the warm-up.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    return 1.0


def adamw(named_parameters: Iterable[tuple[str, nn.Parameter]], settings: OptimizerSettings, total_steps: int,
          no_decay: Callable[[str, nn.Parameter], bool] = lambda name, p: p.ndim < 2,
          lr_of: Callable[[str], float | None] = lambda name: None):
    """AdamW over the trainable parameters (`no_decay` ones without weight decay), with the
    settings' warm-up and schedule stepped per optimizer step; a bare optimizer when neither applies
    (constant, no warm-up).

    Args:
        named_parameters: the module's parameters by name; the frozen ones are left out.
        settings: lr, weight decay, warm-up and schedule.
        total_steps: the run's optimizer steps (the schedule's length).
        no_decay: which parameters get no weight decay (default: biases and norms, anything under
            2-D).
        lr_of: a parameter's own peak learning rate (None: the settings'), e.g. a pretrained part
            fine-tuned beside a network trained from scratch.
    """
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {}
    for name, p in named_parameters:
        if p.requires_grad:
            lr = lr_of(name)
            groups.setdefault((not no_decay(name, p), settings.lr if lr is None else lr), []).append(p)
    params = [{"params": ps, "lr": lr, "weight_decay": settings.weight_decay if decays else 0.0}
              for (decays, lr), ps in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1]))]
    optimizer = torch.optim.AdamW(params, lr=settings.lr)
    if settings.warmup_ratio <= 0 and settings.lr_schedule == "constant":
        return optimizer
    total = max(1, int(total_steps))
    warmup = math.ceil(settings.warmup_ratio * total)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: _warmup_linear(s, warmup, total, settings.lr_schedule))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
