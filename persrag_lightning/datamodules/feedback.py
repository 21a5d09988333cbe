"""DataModule of stages 2 and 3: builds missing LLM-feedback labels once per node, yields
CandidateBatches."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from persrag_lightning.data.candidates import FeedbackExample, collate_candidates
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.splits import SplitSettingsWithTest
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.feedback.builder import FeedbackBuilder, feedback_stats
from persrag_lightning.feedback.settings import CandidateSettings, FeedbackSettings
from persrag_lightning.retrieval.corpus_retriever import open_corpus_retriever
from persrag_lightning.utils import as_settings, trainer_validates

__all__ = ["FeedbackDataModule", "UninformativeFeedbackWarning"]

# Below this share of examples whose candidates got different labels, the stage is told: every other
# example's KL target is uniform, so it trains the model towards equal scores. SmolLM2-135M's greedy
# answers to LaMP-2 under the task metric gave none (docs/training/feedback.md).
UNINFORMATIVE_SHARE = 0.1


class UninformativeFeedbackWarning(UserWarning):
    """Feedback labels that barely rank the candidates: KL training to them teaches (almost)
    nothing."""


def _warn_if_uninformative(examples: list[FeedbackExample], split: str, metric: str) -> None:
    """One warning when fewer than UNINFORMATIVE_SHARE of `split`'s examples have candidates with
    different labels.

    Args:
        examples: the split's feedback examples with their candidates' labels.
        split: the split's name, for the warning.
        metric: the feedback metric the labels were scored with, for the warning.
    """
    if not examples:
        return
    share = feedback_stats(examples).informative_fraction
    if share >= UNINFORMATIVE_SHARE:
        return
    hint = ("; under `task` a small LLM's answers may never match a label exactly: `feedback.metric: loglik` ranks "
            "the candidates by the target's log-likelihood" if metric == "task" else "")
    rank_zero_warn(f"{split} feedback labels: only {share:.0%} of {len(examples)} examples have candidates with "
                   f"different labels (feedback.metric {metric}); the others give the stage a uniform target{hint}",
                   category=UninformativeFeedbackWarning)


class FeedbackDataModule(L.LightningDataModule):
    """Train on the train split's feedback, validate (select checkpoints) on the dev split's, test
    on the test split's (labels built only when `test` runs).

    Args:
        task: the LaMP task (LaMP-1 ... LaMP-7); must match stage 1's.
        data_dir: a folder of LaMP files; None = the embedded SynthLaMP (must match stage 1's).
        synth: size and seed of the SynthLaMP dataset (used only when `data_dir` is None); None =
            its defaults.
        cache_dir: where embeddings, generated data and feedback labels are cached, keyed by
            fingerprints.
        candidates: what proposes each example's m·k candidates (stage 1's users, the candidate
            retriever, m, k, whose candidates are kept).
        feedback: what labels the candidates (the LLM and the metric, or a teacher reranker) and the
            cache's chunks.
        splits: the splits trained, validated and tested on, and how many examples of each (each
            train example costs m·k LLM calls).
        batch_size: examples per step (4 = the official code's batch 1 with 4 accumulated steps, as
            one batch: the KL is the mean over examples).
        num_workers: DataLoader worker processes.
    """

    def __init__(self, task: str = "LaMP-2", data_dir: str | None = None, synth: SynthConfig | None = None,
                 cache_dir: str = ".cache/persrag", candidates: CandidateSettings = CandidateSettings(),
                 feedback: FeedbackSettings = FeedbackSettings(),
                 splits: SplitSettingsWithTest = SplitSettingsWithTest(), batch_size: int = 4,
                 num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.source = LampSource(task, data_dir, synth, cache_dir)
        # typed, whatever form the hyperparameters hold them in (utils.as_settings)
        self.candidates = as_settings(CandidateSettings, candidates)
        self.splits = as_settings(SplitSettingsWithTest, splits)
        self.feedback = as_settings(FeedbackSettings, feedback).resolved()  # once, not per builder
        self.corpus: Corpus | None = None
        self.user_ids: list[str] = []
        self.user_embeddings: torch.Tensor | None = None
        self.train_examples: list[FeedbackExample] = []
        self.val_examples: list[FeedbackExample] = []
        self.test_examples: list[FeedbackExample] = []

    def _limits(self) -> dict[str, int | None]:
        """Splits whose labels this run needs: train and dev (selection) for fit/validate; test only
        for `test`, so fitting never spends LLM calls on (nor looks at) the reported split."""
        s = self.splits
        if self._testing():
            return {s.test_split: s.max_test_examples}
        return s.fit_limits(trainer_validates(self))

    def _testing(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return trainer is not None and trainer.state.fn == "test"

    def builder(self) -> FeedbackBuilder:
        """The feedback cache of this configuration (loads data; loads no model until labels are
        built)."""
        dataset = self.source.load()
        corpus = Corpus.from_dataset(dataset)
        retriever = open_corpus_retriever(self.candidates.retriever, corpus, self.hparams.cache_dir,
                                          self.candidates.encoder_max_length)
        return FeedbackBuilder(
            dataset, corpus, retriever, self.candidates, self.feedback, self.hparams.cache_dir
        )

    def build_feedback(self, shard: int = 0, num_shards: int = 1) -> FeedbackBuilder:
        """Build this shard's missing chunks of both splits (what `persrag feedback --shard` runs).
        Builders of the same shard of one cache (every node's prepare_data on a shared folder) take
        turns: the first labels, the others wait and find nothing missing; other shards go on in
        parallel.

        Args:
            shard: which shard of the examples this process labels (0-based).
            num_shards: how many shards the examples are cut into.
        """
        self.source.prepare()
        builder = self.builder()
        with builder.cache.build_lock(shard, num_shards):
            for split, limit in self._limits().items():
                if builder.missing_chunks(split, limit):
                    builder.retriever.prepare()
                    builder.build(split, shard, num_shards, limit)
        return builder

    def prepare_data(self) -> None:
        """Once per node (`prepare_data_per_node`): data, corpus embeddings of the candidate
        retriever, and all missing labels. On a cache folder that the nodes share, the first node
        builds and the others wait for it (file locks), so the labels are built once per cluster and
        never raced."""
        self.build_feedback()

    def setup(self, stage: str | None = None) -> None:
        """On every rank: read the cached labels and the frozen user table; never calls the LLM.

        Args:
            stage: Lightning's stage: `test` reads the test split's labels, any other the train
                split's.
        """
        builder = self.builder()
        if self.corpus is None:
            self.corpus = builder.corpus
            self.user_ids = builder.user_encoder.user_ids
            self.user_embeddings = builder.user_encoder.user_embeddings
        hint = "--config <this stage's config>"
        s = self.splits
        if stage == "test":
            if not self.test_examples:
                self.test_examples = self.select(
                    builder.load(s.test_split, s.max_test_examples, hint)
                )
        elif not self.train_examples:
            self.train_examples = self.select(
                builder.load(s.train_split, s.max_train_examples, hint)
            )
            _warn_if_uninformative(self.train_examples, s.train_split, self.feedback.metric)
            if trainer_validates(self):
                self.val_examples = self.select(builder.load(s.val_split, s.max_val_examples, hint))

    def select(self, examples: list[FeedbackExample]) -> list[FeedbackExample]:
        if self.candidates.owners == "all":
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
