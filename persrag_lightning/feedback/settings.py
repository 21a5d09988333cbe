"""The feedback stages' two data groups, each set once: what proposes an example's m·k candidates
(`CandidateSettings`, YAML `data.init_args.candidates`) and what labels them (`FeedbackSettings`,
YAML `data.init_args.feedback`). FeedbackDataModule takes them whole and hands them to
FeedbackBuilder."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.stages import bundle_address

__all__ = ["CandidateSettings", "FeedbackSettings"]

FeedbackMetric = Literal["task", "loglik", "gain", "teacher"]


@dataclass(frozen=True)
class CandidateSettings:
    """What proposes an example's m·k candidates: the query user's m most similar users (the user
    included, as the official code), k docs of each.

    Args:
        user_encoder: stage 1's export, whose user table finds the m similar users; the default's
            run folder (`stages.RUN_DIR`) is checkpoints/<run_name>.
        retriever: what ranks each user's docs: an encoder name for the retriever stage (the untuned
            encoder, Eq. 3), the retriever export for the reranker stage (Eq. 5).
        encoder_max_length: token limit of the candidate retriever's queries and docs.
        m: similar users, the query user included (the paper's m = 6 with the user; it tunes 2..6).
        k: docs per user, so m·k candidates per example (the paper's k = 5).
        owners: `all` users' candidates, or `self`: only the query user's own, the ROPG-style
            baseline trained on the same labels (no extra LLM calls), since the user ranks first
            among its m similar users.
    """

    user_encoder: str = bundle_address("user_encoder")
    retriever: str = "minilm"
    encoder_max_length: int = 256
    m: int = 6
    k: int = 5
    owners: Literal["all", "self"] = "all"


@dataclass(frozen=True)
class FeedbackSettings:
    """What labels each candidate (Eq. 6): the LLM's answer with the candidate alone in the prompt,
    scored, or a teacher reranker's score of it.

    Args:
        llm: the LLM whose answers label the candidates (backend, model, batch size, prompt budget);
            None = `backend: auto`.
        metric: a candidate's label: `task` (the task metric of the LLM's answer against the target:
            accuracy, -MAE or ROUGE-1), `loglik` (the target's log-likelihood), `gain` (what the
            candidate adds to the asker's own docs: the target's log-likelihood read with the
            asker's best own candidates and this one, minus that without it, so a neighbour's doc
            is rewarded for what the user's own docs do not already say) or `teacher` (the scores
            of the `teacher` reranker instead of the LLM's feedback: the data of a distilled
            reranker, configs/cfrag_reranker_distilled.yaml).
        chunk_size: examples per feedback-cache chunk; labels are written, and a killed build
            resumes, chunk by chunk.
        teacher: a reranker export whose scores are the labels when `metric` is `teacher`.
        reader: who reads each candidate: `llm` (the `llm` setting's LLM, the paper's feedback) or a
            trained reader's export (the run's `reader` bundle: reading/trained.py), whose label
            distribution then gives the `loglik` and `task` labels.
        cross_fit: 0 reads every question with `reader`; K ≥ 2 cross-fits a trained reader: a
            question of a user in fold f of K (data/splits.user_fold) is read by `reader` with
            `{fold}` filled by f, a reader trained with that fold held out (the reader stage's
            `holdout: {folds: K, fold: f}`), so no question is labelled by a reader that trained
            on it (the run's `reader_fold0`, `reader_fold1` under K = 2).
    """

    llm: LLMConfig | None = None
    metric: FeedbackMetric = "task"
    chunk_size: int = 32
    teacher: str | None = None
    reader: str = "llm"
    cross_fit: int = 0

    def __post_init__(self) -> None:
        if self.cross_fit and (self.cross_fit < 2 or "{fold}" not in self.reader):
            raise ValueError(f"feedback.cross_fit {self.cross_fit}: cross-fitting needs K ≥ 2 folds and a trained "
                             f"reader named with a {{fold}} placeholder (e.g. {{run_dir}}/reader_fold{{fold}}); "
                             f"reader is {self.reader!r}")

    def fold_readers(self) -> dict[int | None, str]:
        """The reader of each fold's questions (None: every question's, without cross-fitting)."""
        if not self.cross_fit:
            return {None: self.reader}
        return {f: self.reader.replace("{fold}", str(f)) for f in range(self.cross_fit)}

    def resolved(self) -> FeedbackSettings:
        """These settings with the LLM the configs default to (`backend: auto`,
        docs/performance/llm-feedback.md) in place of None: resolved where the settings are used,
        not at import, where the default instance is made (`auto` may time the backends once per
        machine)."""
        return self if self.llm is not None else replace(self, llm=LLMConfig(backend="auto"))
