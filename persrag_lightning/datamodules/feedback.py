"""DataModule of stages 2 and 3: builds missing LLM-feedback labels once per node, yields CandidateBatches."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from persrag_lightning.data.candidates import FeedbackExample, collate_candidates
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.feedback.builder import (
    FeedbackBuilder,
    FeedbackMetric,
    FeedbackSettings,
    feedback_stats,
)
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.retrieval.corpus_retriever import open_corpus_retriever
from persrag_lightning.utils import trainer_validates

# Below this share of examples whose candidates got different labels, the stage is told: every other example's KL
# target is uniform, so it trains the model towards equal scores. SmolLM2-135M's greedy answers to LaMP-2 under the
# task metric gave none (docs/training/feedback.md).
UNINFORMATIVE_SHARE = 0.1


class UninformativeFeedbackWarning(UserWarning):
    """Feedback labels that barely rank the candidates: KL training to them teaches (almost) nothing."""


def warn_if_uninformative(examples: list[FeedbackExample], split: str, metric: str) -> None:
    """One warning when fewer than UNINFORMATIVE_SHARE of `split`'s examples have candidates with different labels."""
    if not examples:
        return
    share = feedback_stats(examples).informative_fraction
    if share >= UNINFORMATIVE_SHARE:
        return
    hint = ("; under `task` a small LLM's answers may never match a label exactly: `feedback_metric: loglik` ranks "
            "the candidates by the target's log-likelihood" if metric == "task" else "")
    rank_zero_warn(f"{split} feedback labels: only {share:.0%} of {len(examples)} examples have candidates with "
                   f"different labels (feedback_metric {metric}); the others give the stage a uniform target{hint}",
                   category=UninformativeFeedbackWarning)


class FeedbackDataModule(L.LightningDataModule):
    """Train on the train split's feedback, validate (select checkpoints) on the dev split's, test on the test
    split's (labels built only when `test` runs).

    Args:
        task: the LaMP task (LaMP-1 ... LaMP-7); must match stage 1's.
        data_dir: a folder of LaMP files; None = the embedded SynthLaMP (must match stage 1's).
        synth: size and seed of the SynthLaMP dataset (used only when `data_dir` is None); None = its defaults.
        cache_dir: where embeddings, generated data and feedback labels are cached, keyed by fingerprints.
        user_encoder: stage 1's export; `{run_dir}` is checkpoints/<run_name>.
        candidate_retriever: what proposes the m·k candidates: an encoder name for the retriever stage (the
            untuned encoder, Eq. 3), the retriever export for the reranker stage (Eq. 5).
        encoder_max_length: token limit of the candidate retriever's queries and docs.
        llm: the LLM whose answers label the candidates (backend, model, batch size, prompt budget); None =
            `backend: auto`.
        m: similar users, the query user included (the paper's m = 6 with the user; it tunes 2..6).
        k: docs per user, so m·k candidates per example (the paper's k = 5).
        feedback_metric: a candidate's label: `task` (the task metric of the LLM's answer against the target:
            accuracy, -MAE or ROUGE-1), `loglik` (the target's log-likelihood) or `teacher` (the scores of the
            `teacher` reranker instead of the LLM's feedback: the data of a distilled reranker,
            configs/cfrag_reranker_distilled.yaml).
        chunk_size: examples per feedback-cache chunk; labels are written, and a killed build resumes, chunk by
            chunk.
        train_split: the split trained on.
        val_split: the split validated on (checkpoint selection).
        test_split: the split `test` reports; its labels are built only when `test` runs.
        max_train_examples: cap on train examples (None = all); each costs m·k LLM calls.
        max_val_examples: cap on validation examples (None = all).
        max_test_examples: cap on test examples (None = all).
        candidate_owners: `all` users' candidates, or `self`: only the query user's own, the ROPG-style baseline
            trained on the same labels (no extra LLM calls), since the user ranks first among its m similar users.
        batch_size: examples per step (4 = the official code's batch 1 with 4 accumulated steps, as one batch:
            the KL is the mean over examples).
        num_workers: DataLoader worker processes.
        teacher: a reranker export whose scores are the labels when `feedback_metric` is `teacher`.
    """

    def __init__(self, task: str = "LaMP-2", data_dir: str | None = None, synth: SynthConfig | None = None,
                 cache_dir: str = ".cache/persrag", user_encoder: str = "{run_dir}/user_encoder",
                 candidate_retriever: str = "minilm", encoder_max_length: int = 256, llm: LLMConfig | None = None,
                 m: int = 6, k: int = 5, feedback_metric: FeedbackMetric = "task", chunk_size: int = 32,
                 train_split: str = "train", val_split: str = "dev", test_split: str = "test",
                 max_train_examples: int | None = None, max_val_examples: int | None = None,
                 max_test_examples: int | None = None, candidate_owners: Literal["all", "self"] = "all",
                 batch_size: int = 4, num_workers: int = 0, teacher: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.source = LampSource(task, data_dir, synth, cache_dir)
        self.llm_config = llm or LLMConfig(backend="auto")  # the configs' default (docs/performance/llm-feedback.md)
        self.settings = FeedbackSettings(m=m, k=k, metric=feedback_metric, chunk_size=chunk_size)
        self.corpus: Corpus | None = None
        self.user_ids: list[str] = []
        self.user_embeddings: torch.Tensor | None = None
        self.train_examples: list[FeedbackExample] = []
        self.val_examples: list[FeedbackExample] = []
        self.test_examples: list[FeedbackExample] = []

    def _limits(self) -> dict[str, int | None]:
        """Splits whose labels this run needs: train and dev (selection) for fit/validate; test only for `test`,
        so fitting never spends LLM calls on (nor looks at) the reported split."""
        h = self.hparams
        if self._testing():
            return {h.test_split: h.max_test_examples}
        if not trainer_validates(self):
            return {h.train_split: h.max_train_examples}
        return {h.train_split: h.max_train_examples, h.val_split: h.max_val_examples}

    def _testing(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return trainer is not None and trainer.state.fn == "test"

    def builder(self) -> FeedbackBuilder:
        """The feedback cache of this configuration (loads data; loads no model until labels are built)."""
        dataset = self.source.load()
        corpus = Corpus.from_dataset(dataset)
        retriever = open_corpus_retriever(self.hparams.candidate_retriever, corpus, self.hparams.cache_dir,
                                          self.hparams.encoder_max_length)
        return FeedbackBuilder(dataset, corpus, self.hparams.user_encoder, retriever, self.llm_config,
                               self.settings, self.hparams.cache_dir, self.hparams.teacher)

    def build_feedback(self, shard: int = 0, num_shards: int = 1) -> FeedbackBuilder:
        """Build this shard's missing chunks of both splits (what `persrag feedback --shard` runs). Builders of the
        same shard of one cache (every node's prepare_data on a shared folder) take turns: the first labels, the
        others wait and find nothing missing; other shards go on in parallel."""
        self.source.prepare()
        builder = self.builder()
        with builder.cache.build_lock(shard, num_shards):
            for split, limit in self._limits().items():
                if builder.missing_chunks(split, limit):
                    builder.retriever.prepare()
                    builder.build(split, shard, num_shards, limit)
        return builder

    def prepare_data(self) -> None:
        """Once per node (`prepare_data_per_node`): data, corpus embeddings of the candidate retriever, and all
        missing labels. On a cache folder that the nodes share, the first node builds and the others wait for it
        (file locks), so the labels are built once per cluster and never raced."""
        self.build_feedback()

    def setup(self, stage: str | None = None) -> None:
        """On every rank: read the cached labels and the frozen user table; never calls the LLM."""
        builder = self.builder()
        if self.corpus is None:
            self.corpus = builder.corpus
            self.user_ids = builder.user_encoder.user_ids
            self.user_embeddings = builder.user_encoder.user_embeddings
        hint = "--config <this stage's config>"
        h = self.hparams
        if stage == "test":
            if not self.test_examples:
                self.test_examples = self.select(builder.load(h.test_split, h.max_test_examples, hint))
        elif not self.train_examples:
            self.train_examples = self.select(builder.load(h.train_split, h.max_train_examples, hint))
            warn_if_uninformative(self.train_examples, h.train_split, h.feedback_metric)
            if trainer_validates(self):
                self.val_examples = self.select(builder.load(h.val_split, h.max_val_examples, hint))

    def select(self, examples: list[FeedbackExample]) -> list[FeedbackExample]:
        if self.hparams.candidate_owners == "all":
            return examples
        return [replace(e, candidates=tuple(c for c in e.candidates if c.owner == e.user_id)) for e in examples]

    def _loader(self, examples: list[FeedbackExample], shuffle: bool) -> DataLoader:
        user_row = {u: i for i, u in enumerate(self.user_ids)}
        return DataLoader(examples, batch_size=self.hparams.batch_size, shuffle=shuffle,
                          num_workers=self.hparams.num_workers,
                          collate_fn=partial(collate_candidates, user_row=user_row, corpus_texts=self.corpus.texts))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_examples, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_examples, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_examples, shuffle=False)
