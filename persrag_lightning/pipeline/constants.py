"""The constants of the pipeline's estimate that are not measured at the start of a run, read from
plan_constants.json, where each stands with its unit and where it comes from
(docs/getting-started.md#where-the-plans-constants-come-from)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["BUDGET_MINUTES", "LLM_STAGES", "MIX_ITEMS_WORK", "PAIR_TOKENS", "QUICK_SCALE", "RETRIEVAL_PER_ANSWER",
           "TRAINED_TEXTS", "TRAINING_WORK", "plan_constants"]

CONSTANTS_FILE = Path(__file__).with_name("plan_constants.json")


def plan_constants() -> dict[str, dict]:
    """Every constant of plan_constants.json by name: its `value`, `unit` and `source`."""
    return {k: v for k, v in json.loads(CONSTANTS_FILE.read_text()).items() if k != "about"}


_VALUES = {name: entry["value"] for name, entry in plan_constants().items()}
TRAINING_WORK: dict[str, float] = _VALUES["training_work"]
LLM_STAGES: tuple[str, ...] = tuple(_VALUES["llm_stages"])
RETRIEVAL_PER_ANSWER: float = _VALUES["retrieval_per_answer"]
QUICK_SCALE: dict[str, int] = _VALUES["quick_scale"]
BUDGET_MINUTES: dict[str, int] = _VALUES["budget_minutes"]
TRAINED_TEXTS: dict[str, float] = _VALUES["trained_texts"]
MIX_ITEMS_WORK: float = _VALUES["mix_items_work"]
PAIR_TOKENS: float = _VALUES["pair_tokens"]
