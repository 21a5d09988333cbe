"""Stage 1 of CFRAG (§4.1): contrastive training of the user encoder, and its export for serving."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch

from persrag_lightning.data.docstore import write_docstore
from persrag_lightning.data.histories import pad_histories
from persrag_lightning.datamodules.user_history import UserHistoryBatch, UserHistoryDataModule
from persrag_lightning.index import IndexKind
from persrag_lightning.metrics import UserRetrievalQuality
from persrag_lightning.models.user_encoder import Judgments, UserEncoder, UserEncoderConfig, judgment_labels
from persrag_lightning.modules.losses import Negatives, info_nce
from persrag_lightning.utils import ConfigError, atomic_directory


class UserEncoderModule(L.LightningModule):
    """Two augmented views per user, symmetric InfoNCE (Eq. 2), Adam; validates user-retrieval quality."""

    bundle_name = "user_encoder"

    def __init__(self, temperature: float = 0.1, negatives: Negatives = "all_views", lr: float = 1e-3,
                 weight_decay: float = 1e-5, freeze_doc_table: bool = False, num_layers: int = 1,
                 num_heads: int = 2, dropout: float = 0.1, eval_m: int = 5, index: IndexKind = "auto",
                 gather_negatives: bool = False, judgments: Judgments = "none") -> None:
        """Hyperparameters of stage 1; the defaults are the official CFRAG code's.

        Args:
            temperature: tau1 of the InfoNCE loss (Eq. 2); the paper tunes it in {0.01, 0.1, 1}.
            negatives: `all_views` contrasts each view with the other 2N - 1 views of the batch (SimCLR, as the
                official code); `cross_view` only with the other user's views, Eq. 2 literally.
            lr: Adam's learning rate.
            weight_decay: Adam's weight decay.
            freeze_doc_table: keep the frozen text encoder's doc-embedding table fixed; the official code
                fine-tunes it (False).
            num_layers: transformer layers over a user's history (1, as the official code).
            num_heads: attention heads of each layer (2, as the official code).
            dropout: dropout inside the transformer.
            eval_m: neighbours scored by validation's community precision (the paper retrieves m = 6 users
                including the user itself, i.e. 5 others).
            index: the exported user index: `auto` is exact cosine up to `index.AUTO_EXACT_MAX_USERS` users and
                HNSW above; or `flat`, `ivf`, `hnsw`. Serving loads this index.
            gather_negatives: under DDP, contrast against every rank's users (the single-process loss on the
                global batch) instead of this rank's only.
            judgments: `none` is the paper's text-only encoder; `label` adds a learned embedding of each history
                doc's label (LaMP-2 tag, LaMP-3 score) to its doc vector (models/user_encoder.py says why a sum);
                `paired` adds also a label-specific linear map of the doc vector, so which doc got which label
                survives pooling; both beyond the paper.
        """
        super().__init__()
        self.save_hyperparameters()
        self.encoder: UserEncoder | None = None
        self.val_quality: UserRetrievalQuality | None = None

    # ---- model construction (needs the data's doc table, so it happens in setup or from a checkpoint) -------

    def _build(self, config: UserEncoderConfig, doc_embeddings: torch.Tensor | None = None,
               mask_embedding: torch.Tensor | None = None) -> None:
        self.encoder = UserEncoder(config, doc_embeddings, mask_embedding)
        self.encoder.doc_table.weight.requires_grad_(not self.hparams.freeze_doc_table)

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule
        if not isinstance(dm, UserHistoryDataModule):
            raise TypeError("UserEncoderModule needs a UserHistoryDataModule")
        judgments = self.hparams.get("judgments", "none")
        if judgments != "none":
            try:
                judgment_labels(dm.source.task)
            except ValueError as e:
                raise ConfigError(f"model.init_args.judgments: {e}") from None
        if self.encoder is None:
            h = dm.hparams
            self._build(UserEncoderConfig(
                dim=dm.doc_embeddings.shape[1], num_docs=dm.doc_embeddings.shape[0], max_history=h.max_history,
                num_layers=self.hparams.num_layers, num_heads=self.hparams.num_heads, dropout=self.hparams.dropout,
                text_encoder=h.encoder, text_max_length=h.encoder_max_length, text_pooling=h.encoder_pooling,
                judgments=judgments, task=dm.source.task,
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

    # ---- training ----------------------------------------------------------------------------------------------

    def forward(self, doc_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(doc_ids)

    def training_step(self, batch: UserHistoryBatch, batch_idx: int) -> torch.Tensor:
        gather = self.hparams.get("gather_negatives", False)
        loss = info_nce(self(batch.view_a), self(batch.view_b), self.hparams.temperature, self.hparams.negatives,
                        gather_negatives=gather)
        # gathered: each rank holds world × its share, so the ranks' mean is the global batch's loss
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch.users), sync_dist=gather)
        return loss

    def _evaluation_step(self, batch: UserHistoryBatch, prefix: str) -> None:
        view_a, view_b = self(batch.view_a), self(batch.view_b)
        loss = info_nce(view_a, view_b, self.hparams.temperature, self.hparams.negatives,
                        gather_negatives=self.hparams.get("gather_negatives", False))  # same figure for any #ranks
        self.log(f"{prefix}/loss", loss, sync_dist=True, batch_size=len(batch.users))
        self.val_quality.update(batch.users, self(batch.history), view_a, view_b)

    def _evaluation_epoch_end(self, prefix: str) -> None:
        for name, value in self.val_quality.compute().items():
            self.log(f"{prefix}/{name}", value, prog_bar=True, sync_dist=False, rank_zero_only=False)
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

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.Adam(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    # ---- export ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def user_embeddings(self, datamodule: UserHistoryDataModule, batch_size: int = 256) -> torch.Tensor:
        """Every pooled user's embedding from their pool (recent-100 docs), in datamodule user order."""
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
        """Write the serving bundle (weights, config, user-embedding table, faiss index) and, beside it, the
        docstore of the users' histories that serving retrieves from."""
        self.encoder.index_users(datamodule.user_ids, self.user_embeddings(datamodule),
                                 self.hparams.index)
        with atomic_directory(Path(path).parent / "docstore") as tmp:
            write_docstore(tmp, datamodule.dataset)
        with atomic_directory(path) as tmp:  # a killed export leaves the previous bundle, never half of one
            self.encoder.save_pretrained(tmp)
        return Path(path)
