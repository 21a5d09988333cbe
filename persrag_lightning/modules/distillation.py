"""What stages 2 and 3 share: distil LLM feedback into a ranking model (KL over candidate lists, Eq.
8 / 12), rank metrics against the feedback, the optimiser and its schedule, and the export."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from persrag_lightning.data.candidates import CandidateBatch
from persrag_lightning.metrics import RankingNDCG, RankingRecall
from persrag_lightning.modules.losses import kl_to_llm_feedback
from persrag_lightning.modules.optim import DistillationSettings, adamw
from persrag_lightning.utils import as_settings

__all__ = ["FeedbackDistillationModule"]


class FeedbackDistillationModule(L.LightningModule):
    """KL to LLM feedback (Eq. 8 / 12) over candidate lists, ranking metrics against the feedback,
    AdamW, export.

    Subclasses take `config` (their model's `settings_class`) and `training: DistillationSettings`,
    and name their `model_class` and its `config_class` (the settings plus the user table's width).
    The data module must expose `user_embeddings` [U, du] whose rows match CandidateBatch.users
    (and, when the user table is trained and exported, `user_ids`, one id per row).
    """

    bundle_name = ""
    model_class: type  # has from_config(config_class(...)) → a fresh model
    config_class: type
    settings_class: type

    def _init_state(self, config: object, training: object) -> None:
        """The typed settings (hyperparameters may hold them as dicts: utils.as_settings), metrics,
        no model yet."""
        self.config = as_settings(self.settings_class, config)
        self.settings: DistillationSettings = as_settings(DistillationSettings, training)
        self.model: nn.Module | None = None
        self.user_table: nn.Embedding | None = None
        self.user_ids: list[str] = []
        k = self.settings.eval_k
        self.ndcg, self.recall = RankingNDCG(k), RankingRecall(k)
        self.first_stage_ndcg, self.first_stage_recall = RankingNDCG(k), RankingRecall(k)
        self._first_stage_logged = False


    # ---- model construction (needs the user table's width, so it happens in setup or from a
    # checkpoint) -----

    def _build_model(self, user_dim: int) -> nn.Module:
        return self.model_class.from_config(
            self.config_class(**asdict(self.config), user_dim=user_dim)
        )

    def _model_from_config(self, config: dict) -> nn.Module:
        values = {key: tuple(v) if isinstance(v, list) else v for key, v in config.items()}
        return self.model_class.from_config(self.config_class(**values))

    @property
    def train_user_embeddings(self) -> bool:
        """Whether the user table is fine-tuned (and exported); only a retriever setting may say
        so."""
        return False

    def _set_user_table(
        self, num_users: int, dim: int, weights: torch.Tensor | None = None
    ) -> None:
        self.user_table = nn.Embedding(num_users, dim)
        if weights is not None:
            with torch.no_grad():
                self.user_table.weight.copy_(weights)
        self.user_table.weight.requires_grad_(self.train_user_embeddings)

    def attach_datamodule(self, datamodule: Any) -> None:
        """Build the model and the user table from the data (skipped for what a checkpoint already
        restored).

        Args:
            datamodule: the data that exposes `user_embeddings` (and `user_ids` when the table is
                exported).
        """
        table = getattr(datamodule, "user_embeddings", None)
        if table is None:
            raise TypeError(
                f"{type(self).__name__} needs a datamodule exposing `user_embeddings` [U, du] "
                f"(rows = CandidateBatch.users); got {type(datamodule).__name__}"
            )
        table = torch.as_tensor(table).detach().float().cpu()
        if table.dim() != 2:
            raise ValueError(
                f"datamodule.user_embeddings must be [U, du], got {tuple(table.shape)}"
            )
        if self.model is None:
            # seeded from the run's seed, not from the RNG state prepare_data left (which depends on
            # whether the feedback labels were cached), so a run starts from the same weights either
            # way
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(torch.initial_seed())
                self.model = self._build_model(table.shape[1])
            # from_pretrained leaves encoders in eval mode and Lightning keeps submodule modes:
            # without this the encoders' dropout would be off while fine-tuning (the official code,
            # under HF Trainer, trains with it)
            self.model.train(self.training)
        if self.user_table is None:
            self._set_user_table(*table.shape, weights=table)
        elif tuple(self.user_table.weight.shape) != tuple(table.shape):
            raise ValueError(
                f"the checkpoint's user table is {tuple(self.user_table.weight.shape)}, the "
                f"datamodule's {tuple(table.shape)}: they must describe the same users"
            )
        ids = getattr(datamodule, "user_ids", None)
        if ids is not None and not self.user_ids:
            self.user_ids = list(ids)

    def setup(self, stage: str) -> None:
        self.attach_datamodule(self.trainer.datamodule)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[f"{self.bundle_name}_config"] = asdict(self.model.config)
        checkpoint["user_table_shape"] = list(self.user_table.weight.shape)
        checkpoint["user_ids"] = self.user_ids

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Rebuild model and user table from the checkpoint, so load_from_checkpoint needs no
        datamodule (the table's values, like the weights, come from the state dict right after).

        Args:
            checkpoint: the loaded checkpoint dict, holding the model's config beside its state
                dict.
        """
        if self.model is None:
            self.model = self._model_from_config(checkpoint[f"{self.bundle_name}_config"])
        if self.user_table is None:
            self._set_user_table(*checkpoint["user_table_shape"])
        if not self.user_ids:
            self.user_ids = list(checkpoint.get("user_ids", []))

    # ---- training --------------------------------------------------------------------------------

    def forward(self, batch: CandidateBatch) -> torch.Tensor:
        """[B, C] scores of the batch's candidates for its query users (padding arbitrary, masked
        downstream).

        Args:
            batch: candidate lists with their query users.
        """
        return self.model(batch, self.user_table(batch.users.to(self.user_table.weight.device)))

    def loss(self, scores: torch.Tensor, batch: CandidateBatch) -> torch.Tensor:
        return kl_to_llm_feedback(scores, batch.labels, batch.mask, self.settings.student_temperature,
                                  self.settings.teacher_temperature)

    def training_step(self, batch: CandidateBatch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self(batch), batch)
        self.log("train/kl", loss, prog_bar=True, batch_size=len(batch))
        return loss

    def _evaluation_step(self, batch: CandidateBatch, prefix: str) -> None:
        scores = self(batch)
        self.log(f"{prefix}/kl", self.loss(scores, batch), sync_dist=True, batch_size=len(batch))
        self.ndcg.update(scores, batch.labels, batch.mask)
        self.recall.update(scores, batch.labels, batch.mask)
        # the ranking the candidates came with, once per run (and on every test): the baseline to
        # beat
        if prefix == "test" or not (self._first_stage_logged or self.trainer.sanity_checking):
            self.first_stage_ndcg.update(batch.first_stage, batch.labels, batch.mask)
            self.first_stage_recall.update(batch.first_stage, batch.labels, batch.mask)

    def _evaluation_epoch_end(self, prefix: str) -> None:
        k = self.settings.eval_k
        values = {f"{prefix}/ndcg@{k}": self.ndcg.compute(), f"{prefix}/recall@{k}": self.recall.compute()}
        if self.first_stage_ndcg.update_called:
            values[f"{prefix}/ndcg@{k}_first_stage"] = self.first_stage_ndcg.compute()
            values[f"{prefix}/recall@{k}_first_stage"] = self.first_stage_recall.compute()
            if not self.trainer.sanity_checking:
                self._first_stage_logged = True
        for name, value in values.items():  # compute() already summed over DDP ranks
            self.log(name, value.float(), prog_bar=name.startswith(f"{prefix}/ndcg"), sync_dist=False,
                     rank_zero_only=False)
        for metric in (self.ndcg, self.recall, self.first_stage_ndcg, self.first_stage_recall):
            metric.reset()

    def validation_step(self, batch: CandidateBatch, batch_idx: int) -> None:
        self._evaluation_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._evaluation_epoch_end("val")

    def test_step(self, batch: CandidateBatch, batch_idx: int) -> None:
        self._evaluation_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._evaluation_epoch_end("test")

    def predict_step(self, batch: CandidateBatch, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self):
        """AdamW over trainable parameters (no decay on biases, norms and the user table); optional
        linear warmup and linear decay, stepped per optimizer step."""
        return adamw(self.named_parameters(), self.settings, self.trainer.estimated_stepping_batches,
                     no_decay=lambda name, p: p.ndim < 2 or name.startswith("user_table."))

    # ---- export ----------------------------------------------------------------------------------

    def export(self, path: str | Path, datamodule: Any = None) -> Path:
        """Write the serving bundle (models/ reloads it without Lightning); the CLI calls this on
        rank 0 after fit.

        Args:
            path: the bundle's folder.
            datamodule: the data whose `user_ids` go with an exported user table when the module
                holds none of its own.
        """
        if not self.train_user_embeddings:
            return self.model.save_pretrained(path)
        ids = self.user_ids or list(getattr(datamodule, "user_ids", None) or [])
        if len(ids) != self.user_table.num_embeddings:
            raise ValueError(
                f"train_user_embeddings=True exports the user table with its ids: the datamodule must "
                f"expose `user_ids` ({self.user_table.num_embeddings} of them), got {len(ids)}"
            )
        return self.model.save_pretrained(
            path, user_embeddings=self.user_table.weight.detach(), user_ids=ids
        )

