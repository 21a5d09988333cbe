"""Stage 1 of CFRAG (§4.1): contrastive training of the user encoder, and its export for serving."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch

from persrag_lightning.data.docstore import write_docstore
from persrag_lightning.data.histories import pad_histories
from persrag_lightning.datamodules.user_history import UserHistoryBatch, UserHistoryDataModule
from persrag_lightning.index import IndexKind
from persrag_lightning.metrics import UserRetrievalQuality
from persrag_lightning.models.user_encoder import (
    UserEncoder,
    UserEncoderConfig,
    UserEncoderSettings,
    judgment_labels,
)
from persrag_lightning.modules.losses import Negatives, info_nce
from persrag_lightning.utils import ConfigError, as_settings, atomic_directory

__all__ = ["ContrastiveSettings", "UserEncoderModule"]


@dataclass
class ContrastiveSettings:
    """How stage 1 learns: symmetric InfoNCE between two augmented views per user (Eq. 2), Adam; the
    defaults are the official CFRAG code's.

    Args:
        temperature: tau1 of the InfoNCE loss (Eq. 2); the paper tunes it in {0.01, 0.1, 1}.
        negatives: `all_views` contrasts each view with the other 2N - 1 views of the batch (SimCLR,
            as the official code); `cross_view` only with the other user's views, Eq. 2 literally.
        gather_negatives: under DDP, contrast against every rank's users (the single-process loss on
            the global batch) instead of this rank's only.
        lr: Adam's learning rate.
        weight_decay: Adam's weight decay.
        freeze_doc_table: keep the frozen text encoder's doc-embedding table fixed; the official
            code fine-tunes it (False).
    """

    temperature: float = 0.1
    negatives: Negatives = "all_views"
    gather_negatives: bool = False
    lr: float = 1e-3
    weight_decay: float = 1e-5
    freeze_doc_table: bool = False



# a checkpoint's hyperparameters hold these settings objects: torch.load (weights_only) must know
# them
torch.serialization.add_safe_globals([UserEncoderSettings, ContrastiveSettings])

class UserEncoderModule(L.LightningModule):
    """Two augmented views per user, symmetric InfoNCE (Eq. 2), Adam; validates user-retrieval
    quality.

    Args:
        config: the user encoder's shape and what it reads (exported as its config.json, with the
            doc table, the history length and the text encoder added from the data).
        training: the contrastive loss and its optimiser.
        eval_m: neighbours scored by validation's community precision (the paper retrieves m = 6
            users including the user itself, i.e. 5 others).
        index: the exported user index: `auto` is exact cosine up to `index.AUTO_EXACT_MAX_USERS`
            users and HNSW above; or `flat`, `ivf`, `hnsw`. Serving loads this index.
    """

    bundle_name = "user_encoder"

    def __init__(self, config: UserEncoderSettings = UserEncoderSettings(),
                 training: ContrastiveSettings = ContrastiveSettings(), eval_m: int = 5,
                 index: IndexKind = "auto") -> None:
        super().__init__()
        self.save_hyperparameters()
        # typed, whatever form the hyperparameters hold them in (utils.as_settings)
        self.config = as_settings(UserEncoderSettings, config)
        self.settings = as_settings(ContrastiveSettings, training)
        self.encoder: UserEncoder | None = None
        self.val_quality: UserRetrievalQuality | None = None

    # ---- model construction (needs the data's doc table, so it happens in setup or from a
    # checkpoint) -------

    def _build(self, config: UserEncoderConfig, doc_embeddings: torch.Tensor | None = None,
               mask_embedding: torch.Tensor | None = None) -> None:
        self.encoder = UserEncoder(config, doc_embeddings, mask_embedding)
        self.encoder.doc_table.weight.requires_grad_(not self.settings.freeze_doc_table)

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule
        if not isinstance(dm, UserHistoryDataModule):
            raise TypeError("UserEncoderModule needs a UserHistoryDataModule")
        settings = self.config
        if settings.judgments != "none":
            try:
                judgment_labels(dm.source.task)
            except ValueError as e:
                raise ConfigError(f"model.init_args.config.judgments: {e}") from None
        if self.encoder is None:
            h = dm.hparams
            self._build(UserEncoderConfig(
                **asdict(settings), dim=dm.doc_embeddings.shape[1], num_docs=dm.doc_embeddings.shape[0],
                max_history=h.max_history, text_encoder=h.encoder, text_max_length=h.encoder_max_length,
                text_pooling=h.encoder_pooling, task=dm.source.task,
            ), dm.doc_embeddings, dm.mask_embedding)
            if self.encoder.uses_judgments:
                self.encoder.set_doc_labels(torch.as_tensor(dm.doc_labels))
        communities = None if dm.communities is None else torch.as_tensor(dm.communities)
        self.val_quality = UserRetrievalQuality(self.hparams.eval_m, communities)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["user_encoder_config"] = asdict(self.encoder.config)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.encoder is None:
            self._build(UserEncoderConfig(**checkpoint["user_encoder_config"]))

    # ---- training --------------------------------------------------------------------------------

    def forward(self, doc_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(doc_ids)

    def on_train_start(self) -> None:
        if not self.encoder.trains:  # `judgments: profile`: validation and the export only
            self.trainer.should_stop = True

    def training_step(self, batch: UserHistoryBatch, batch_idx: int) -> torch.Tensor:
        t = self.settings
        loss = info_nce(self(batch.view_a), self(batch.view_b), t.temperature, t.negatives,
                        gather_negatives=t.gather_negatives)
        # gathered: each rank holds world × its share, so the ranks' mean is the global batch's loss
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch.users), sync_dist=t.gather_negatives)
        return loss

    def _evaluation_step(self, batch: UserHistoryBatch, prefix: str) -> None:
        view_a, view_b = self(batch.view_a), self(batch.view_b)
        t = self.settings
        loss = info_nce(view_a, view_b, t.temperature, t.negatives,
                        # the same figure for any number of ranks
                        gather_negatives=t.gather_negatives)
        self.log(f"{prefix}/loss", loss, sync_dist=True, batch_size=len(batch.users))
        self.val_quality.update(batch.users, self(batch.history), view_a, view_b)

    def _evaluation_epoch_end(self, prefix: str) -> None:
        for name, value in self.val_quality.compute().items():
            self.log(
                f"{prefix}/{name}", value, prog_bar=True, sync_dist=False, rank_zero_only=False
            )
        self.val_quality.reset()

    def validation_step(self, batch: UserHistoryBatch, batch_idx: int) -> None:
        self._evaluation_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._evaluation_epoch_end("val")

    def test_step(self, batch: UserHistoryBatch, batch_idx: int) -> None:
        self._evaluation_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._evaluation_epoch_end("test")

    def predict_step(self, batch: UserHistoryBatch, batch_idx: int) -> torch.Tensor:
        return self(batch.history)

    def configure_optimizers(self) -> torch.optim.Optimizer | None:
        # `judgments: profile` trains nothing: no optimizer, and no step (`on_train_start`). Its parameters keep
        # requires_grad, so DDP, which refuses a module without one, still wraps it.
        if not self.encoder.trains:
            return None
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.Adam(
            params, lr=self.settings.lr, weight_decay=self.settings.weight_decay
        )

    # ---- export ----------------------------------------------------------------------------------

    @torch.no_grad()
    def user_embeddings(
        self, datamodule: UserHistoryDataModule, batch_size: int = 256
    ) -> torch.Tensor:
        """Every pooled user's embedding from their pool (recent-100 docs), in datamodule user
        order."""
        was_training = self.encoder.training
        self.encoder.eval()
        out = []
        for start in range(0, datamodule.num_users, batch_size):
            users = range(start, min(start + batch_size, datamodule.num_users))
            ids = pad_histories([datamodule.user_history(u) for u in users]).to(self.device)
            out.append(self.encoder(ids).float().cpu())
        self.encoder.train(was_training)
        return torch.cat(out)

    def export(self, path: str | Path, datamodule: UserHistoryDataModule) -> Path:
        """Write the serving bundle (weights, config, user-embedding table, faiss index) and, beside
        it, the docstore of the users' histories that serving retrieves from."""
        self.encoder.index_users(datamodule.user_ids, self.user_embeddings(datamodule),
                                 self.hparams.index)
        with atomic_directory(Path(path).parent / "docstore") as tmp:
            write_docstore(tmp, datamodule.dataset)
        # a killed export leaves the previous bundle, never half of one
        with atomic_directory(path) as tmp:
            self.encoder.save_pretrained(tmp)
        return Path(path)
