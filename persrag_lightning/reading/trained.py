"""The trained reader: the reader stage's export (models/reader.py) reading a question with its docs
and their labels, behind the same `Reader` door as the LLM. Its scores are a trained distribution
over the task's labels, so there is no LLM label prior to calibrate: its readings carry the
calibration `none` only. Its `auto` decision is the one its export carries, fitted on the train
users the reader stage held out of training (a quantile level, or the arg max over its train label
prior to a power); an export without one reads with the task metric's rule."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import get_task
from persrag_lightning.models.reader import LabelReader
from persrag_lightning.models.reader_inputs import doc_text, reader_inputs
from persrag_lightning.progress import in_blocks
from persrag_lightning.reading.base import Docs, Reader
from persrag_lightning.reading.decision import log_softmax, prior_terms, resolve_decision
from persrag_lightning.reading.doc_vectors import pin_doc_vectors
from persrag_lightning.reading.label_reading import LabelReading
from persrag_lightning.utils import ConfigError, bundle_digest

__all__ = ["TrainedReader"]

BATCH = 64  # questions per forward at inference


class TrainedReader(Reader):
    """A `LabelReader` export read without Lightning; `decision` as the LLM reader's, but `auto` is
    the export's fitted decision where it has one."""

    kind = "trained"

    def __init__(self, path: str | Path, decision: str = "auto", batch_size: int = BATCH) -> None:
        """Args:
            path: the reader stage's export (checkpoints/<run>/reader).
            decision: the answer taken from the label distribution (`auto`: the export's fitted
                decision, else arg max for accuracy and median for MAE).
            batch_size: questions per forward.
        """
        self.path, self.decision, self.batch_size = Path(path), decision, batch_size
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.path}: no trained reader export (config.json); make it with `python "
                "train.py fit --config reader.yaml` (same --run_name)"
            )
        self._model: LabelReader | None = None
        self._digest: str | None = None
        stored = json.loads((self.path / "config.json").read_text())
        self.fitted: tuple[str, float] | None = (
            (stored["decision"], float(stored.get("prior_power", 0.0))) if stored.get("decision") else None)

    def resolved_decision(self, task: str) -> tuple[str, float]:
        """The decision read with and the prior's power it divides by: the fitted ones under `auto`
        where the export has them."""
        if self.decision == "auto" and self.fitted is not None:
            return self.fitted
        return resolve_decision(task, self.decision), 0.0

    @property
    def model(self) -> LabelReader:
        if self._model is None:
            self._model = LabelReader.from_pretrained(self.path).eval()
        return self._model

    def identity(self) -> dict:
        if self._digest is None:
            self._digest = bundle_digest(self.path)
        runtime = self._model.text_runtime if self._model is not None else "fp32"
        return {"reader": "trained", "digest": self._digest, "decision": self.decision,
                **({"text_runtime": runtime} if runtime != "fp32" else {})}

    def use_text_runtime(self, runtime: str, cache_dir: str | None = None) -> None:
        """The frozen text encoder's runtime (`LabelReader.use_text_runtime`)."""
        self.model.use_text_runtime(runtime, cache_dir)

    def prepare_docs(self, task: str, docs: Sequence[HistoryDoc], cache_dir: str | None = None) -> int:
        """Every doc's text vector by the frozen encoder, now (reading/doc_vectors.py)."""
        spec = get_task(self._check_task(task))
        return pin_doc_vectors(self.model, [doc_text(spec, d) for d in docs], cache_dir)

    def forget_docs(self, task: str, docs: Sequence[HistoryDoc]) -> None:
        if self._model is not None:
            spec = get_task(task)
            self._model.forget([doc_text(spec, d) for d in docs])

    def reading(self, task: str) -> dict:
        decision, power = self.resolved_decision(task)
        return {"calibration": "none", "decision": decision, **({"prior_power": power} if power else {})}

    def describe(self, task: str) -> str:
        decision, power = self.resolved_decision(task)
        fitted = self.decision == "auto" and self.fitted is not None
        return (f"trained reader (decision {decision}" + (f" over its train label prior^{power:g}" if power else "")
                + (", fitted on held-out train users)" if fitted else ")"))

    def _check_task(self, task: str) -> str:
        """The task's name; a reader of another task, or of another folder's label set (every
        `--task labels` folder is named `labels`), is refused."""
        spec, config = get_task(task), self.model.config
        if spec.name != config.task:
            raise ConfigError(
                f"{self.path}: this reader was trained on {config.task}, not {spec.name}"
            )
        if tuple(spec.labels or ()) != tuple(config.labels):
            raise ConfigError(
                f"{self.path}: this reader was trained on the labels {list(config.labels)}, not "
                f"{list(spec.labels or ())}; train it on this folder"
            )
        return spec.name

    @torch.inference_mode()
    def log_scores(
        self, task: str, inputs: Sequence[str], docs: Docs, phase: str | None = None
    ) -> list[list[float]]:
        """log p(label | question, docs) for every label of the task, one row per question."""
        self._check_task(task)
        inputs, docs = list(inputs), list(docs)  # each question's docs as given: ReadDocs keep the habit

        def compute(part: list[int]) -> list[list[float]]:
            return self.model.log_probs([inputs[i] for i in part], [docs[i] for i in part]).tolist()

        return in_blocks(list(range(len(inputs))), compute, phase, 8 * self.batch_size) if inputs else []

    def read(self, task: str, inputs: Sequence[str], docs: Docs, *, prompt_gamma: float | None = None,
             phase: str | None = None, every_calibration: bool = False) -> LabelReading:
        name = self._check_task(task)
        rows = self.log_scores(task, inputs, docs, phase)
        decision, power = self.resolved_decision(task)
        if power:  # the fitted arg max reads the distribution divided by the train label prior^power
            terms = prior_terms(self.model.config.label_prior, power)
            rows = [log_softmax([v - t for v, t in zip(row, terms)]) for row in rows]
        return LabelReading(name, self.model.config.labels, rows, "none", decision, {"none": None})

    def score_targets(self, task: str, inputs: Sequence[str], docs: Docs, targets: Sequence[str], *,
                      phase: str | None = None) -> list[float]:
        """log p(target) under the reader's distribution; a target outside the labels is impossible
        (-inf)."""
        spec = get_task(task)
        rows = self.log_scores(task, inputs, docs, phase)
        index = [spec.label_index(t) for t in targets]
        return [row[i] if i is not None else float("-inf") for row, i in zip(rows, index)]

    def prompts(self, task: str, inputs: Sequence[str], docs: Docs, *,
                prompt_gamma: float | None = None) -> list[str]:
        self._check_task(task)
        return [q.text for q in reader_inputs(self.model.config, list(inputs), list(docs))]

    def close(self) -> None:
        self._model = None
