"""The LLM's label calibration terms: what a small LLM's label prior is, measured on content-free
prompts of the task's template.

`choose` scores every allowed label by the reader's log-probability. A small LLM's prior for one
label string can outweigh everything the prompt says (SmolLM2-135M answers "1" to every LaMP-3
review), so the scores are calibrated before a label is chosen (reading/decision.py applies the
terms and decides):

- `contextual`: contextual calibration (Zhao et al., 2021, "Calibrate Before Use", Eq. 1 with W =
  diag(p_cf)^-1, b = 0): divide the label distribution by its average under content-free inputs
  ("N/A", "", "[MASK]") of the same template;
- `pmi`: domain-conditional PMI (Holtzman et al., 2021, "Surface Form Competition", Eq. 3): log p(y
  | prompt) minus log p(y | domain premise), the task's instruction alone.

Both terms depend on the template only, so they cost a few LLM calls per task, not one per prompt.
"""

from __future__ import annotations

import math

from persrag_lightning.llm.prompts import content_free_prompt, domain_premise
from persrag_lightning.reading.decision import check_reading, log_softmax

__all__ = ["CONTENT_FREE_INPUTS", "calibration_prompts", "calibration_terms"]

# Zhao et al. (2021), section 5: averaged over these three
CONTENT_FREE_INPUTS = ("N/A", "", "[MASK]")


def calibration_prompts(task: str, calibration: str) -> list[str]:
    """The prompts whose label scores make the calibration terms (none for `none`)."""
    if calibration == "contextual":
        return [content_free_prompt(task, filler) for filler in CONTENT_FREE_INPUTS]
    if calibration == "pmi":
        return [domain_premise(task)]
    check_reading(calibration, "auto")
    return []


def calibration_terms(calibration: str, rows: list[list[float]]) -> list[float] | None:
    """What is subtracted from every prompt's label log-scores: log of the mean content-free
    distribution (`contextual`), the premise's log p per label (`pmi`), nothing (`none`)."""
    if calibration == "none" or not rows:
        return None
    if calibration == "contextual":
        mean = [sum(math.exp(v) for v in col) / len(rows) for col in zip(*(log_softmax(r) for r in rows))]
        return [math.log(max(p, 1e-300)) for p in mean]
    return list(rows[0])
