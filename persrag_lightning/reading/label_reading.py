"""What a reader of labels gives: every label's score for every question, read into answers by the
rules of reading/decision.py, and stored beside the answers so a table can be re-read under another
rule without the reader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from persrag_lightning.reading.decision import calibrated, check_reading, decide, resolve_decision

__all__ = ["LabelReading"]


@dataclass(frozen=True)
class LabelReading:
    """Every label's score for every prompt, the calibration terms, and the answers the decision
    rule gives: what an answer file stores beside the labels, so a table can be recomputed under
    another rule without the LLM."""

    task: str
    labels: tuple[str, ...]
    log_scores: list[list[float]]  # log p(label | prompt), one row per prompt
    calibration: str  # the one applied
    decision: str  # resolved: argmax | median | mean
    terms_by: dict[str, list[float] | None]  # calibration -> its terms (at least the one applied)

    @property
    def terms(self) -> list[float] | None:
        return self.terms_by.get(self.calibration)

    @property
    def probabilities(self) -> list[list[float]]:
        return [calibrated(row, self.terms) for row in self.log_scores]

    @property
    def answers(self) -> list[str]:
        return [decide(self.labels, probs, self.decision) for probs in self.probabilities]

    def under(self, calibration: str, decision: str = "auto") -> LabelReading:
        """The same scores read under another rule, without an LLM call (its terms must have been
        computed)."""
        check_reading(calibration, decision)
        if calibration not in self.terms_by:
            raise ValueError(f"no {calibration!r} terms were computed for these scores (have: {sorted(self.terms_by)})")
        return LabelReading(self.task, self.labels, self.log_scores, calibration,
                            resolve_decision(self.task, decision), self.terms_by)

    def to_json(self, ids: Sequence[str], golds: Sequence[str | None] | None = None) -> dict:
        golds = golds if golds is not None else [None] * len(ids)
        return {"task": self.task, "labels": list(self.labels), "calibration": self.calibration,
                "decision": self.decision, "terms": self.terms_by,
                "rows": [{"id": i, "gold": g, "answer": a, "log_p": row, "p": [round(v, 6) for v in probs]}
                         for i, g, a, row, probs in zip(ids, golds, self.answers, self.log_scores,
                                                         self.probabilities)]}

    @classmethod
    def from_json(cls, obj: dict) -> LabelReading:
        """A stored reading (predictions/<row>.labels.json), rows in their stored order."""
        return cls(obj["task"], tuple(obj["labels"]), [r["log_p"] for r in obj["rows"]], obj["calibration"],
                   obj["decision"], dict(obj["terms"]))
