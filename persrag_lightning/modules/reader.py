"""The reader stage: a `LabelReader` (models/reader.py) trained on the task's train questions to
give the label distribution that the evaluation, the feedback labels and serving read answers from.

The loss is the negative log-likelihood of the gold label under the reader's distribution:
cross-entropy under the softmax head, the cumulative-link likelihood under the ordinal head (ordered
labels). Validation reads the train users the DataModule holds out (`holdout`; dev only under
`holdout.fold: null`), answers them as the evaluation does (the decision rule of the task's metric:
arg max for accuracy, median for MAE) and scores them with the task's LaMP metric; the best epoch is
exported (configs/reader.yaml stops when validation stops improving), carrying the decision fitted
on the held-out users: the quantile level for ordered labels, the label prior's power for the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F

from persrag_lightning.datamodules.reader import ReaderTrainBatch
from persrag_lightning.metrics import lamp_metric, primary_metric
from persrag_lightning.models.reader import LabelReader, ReaderConfig, ReaderSettings, encoder_digest
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.modules.optim import OptimizerSettings, adamw
from persrag_lightning.reading.decision import (
    decide,
    fit_prior_power,
    fit_quantile,
    prior_corrected,
    quantile_decision,
    resolve_decision,
)
from persrag_lightning.utils import as_settings

__all__ = ["ReaderModule"]

# a checkpoint's hyperparameters hold these settings objects: torch.load (weights_only) must know
# them
torch.serialization.add_safe_globals([ReaderSettings, OptimizerSettings])


class ReaderModule(L.LightningModule):
    """Trains the fusion and head of a `LabelReader` over the frozen encoder's vectors (the
    DataModule's), and with `config.tune_layers` the question tower over the questions' cached
    lower-layer states.

    Args:
        config: the reader's model settings (encoder, docs read, fusion width and depth, head).
        training: AdamW over the fusion and the head (its lr 1e-3: a small network trained from
            scratch).
        cpu_threads: torch's threads while fitting on a CPU (restored after); None keeps the
            process's. The fusion network's ops are too small to share out: on busy cores one thread
            steps many times faster than two (docs/methods/reader.md).
        fit_decision: fit the decision on the held-out train users' examples at export (False, or
            no holdout: the export reads with the task metric's rule).
        tune_lr: AdamW's learning rate of the question tower's pretrained layers (`config.tune_layers`),
            beside `training.lr` for the network trained from scratch.
        select_on: what `val/select` (the checkpoint's and the early stop's monitor in
            configs/reader.yaml) reads on the held-out users: `metric`, the task's LaMP metric (as
            `val/metric`), or `loss`, their negative log-likelihood of the gold, negated: smoother than a
            few hundred answers' metric, whose best epoch can be a barely trained one by chance.
    """

    bundle_name = "reader"

    def __init__(self, config: ReaderSettings = ReaderSettings(),
                 training: OptimizerSettings = OptimizerSettings(lr=1e-3, weight_decay=0.01),
                 cpu_threads: int | None = 1, fit_decision: bool = True, tune_lr: float = 5e-5,
                 select_on: Literal["metric", "loss"] = "metric") -> None:
        super().__init__()
        self.save_hyperparameters()
        self._threads_before: int | None = None
        self.settings = as_settings(ReaderSettings, config)
        self.training_settings = as_settings(OptimizerSettings, training)
        self.model: LabelReader | None = None
        self.task: str | None = None
        self.metric = None
        self._held_nll = [0.0, 0]  # the validation epoch's summed NLL and its examples (select_on: loss)

    def setup(self, stage: str) -> None:
        """The model takes the task's labels and the encoder's width from the data.

        Args:
            stage: Lightning's stage; the model is built once, whatever the stage.
        """
        data = self.trainer.datamodule
        self.task = data.task
        if self.model is None:
            width = data.vectors.shape[1] if getattr(data, "vectors", None) is not None else 384
            config = ReaderConfig(**vars(self.settings), task=data.task, labels=tuple(data.labels),
                                  embedding_dim=width, encoder_digest=encoder_digest(self.settings.encoder))
            tower_encoder = None
            if config.tune_layers:  # the tower starts as a copy of the encoder's top layers
                tower_encoder = TextEncoder.from_pretrained(config.encoder, max_length=config.max_length)
            # seeded by the run, not by what data preparation drew
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(torch.initial_seed())
                self.model = LabelReader(config, tower_encoder=tower_encoder)
        self.metric = lamp_metric(self.task)

    def on_fit_start(self) -> None:
        # dropout draws from the run's seed, not from what data preparation drew before it (a run that
        # finds its data cached would otherwise train another reader than the run that built it)
        torch.manual_seed(torch.initial_seed())
        if self.device.type == "cpu" and self.hparams.cpu_threads:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(self.hparams.cpu_threads)

    def on_fit_end(self) -> None:
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def loss(self, batch: ReaderTrainBatch) -> torch.Tensor:
        return F.nll_loss(self.model(batch.batch), batch.targets)

    def training_step(self, batch: ReaderTrainBatch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        return loss

    def validation_step(self, batch: ReaderTrainBatch, batch_idx: int) -> None:
        log_probs = self.model(batch.batch)
        loss = F.nll_loss(log_probs, batch.targets)
        self.log("val/loss", loss, sync_dist=True, batch_size=len(batch))
        self._held_nll = [self._held_nll[0] + float(loss) * len(batch), self._held_nll[1] + len(batch)]
        labels, rule = self.model.config.labels, resolve_decision(self.task, "auto")
        answers = [decide(labels, row, rule) for row in log_probs.exp().tolist()]
        self.metric.update(answers, [labels[i] for i in batch.targets.tolist()])

    def on_validation_epoch_end(self) -> None:
        values = {f"val/{k}": v.float() for k, v in self.metric.compute().items()}
        primary = primary_metric(self.task)  # val/metric and val/select: larger is better
        values["val/metric"] = primary.ascending(values[f"val/{primary.name}"])
        total, n = self._held_nll
        values["val/select"] = (values["val/metric"] if self.hparams.select_on == "metric"
                                else torch.tensor(-total / max(n, 1), dtype=torch.float32))
        self._held_nll = [0.0, 0]
        for name, value in values.items():
            self.log(
                name, value, prog_bar=name == "val/metric", sync_dist=False, rank_zero_only=False
            )
        self.metric.reset()

    def configure_optimizers(self):
        return adamw(self.model.named_parameters(), self.training_settings, self.trainer.estimated_stepping_batches,
                     lr_of=lambda name: self.hparams.tune_lr if name.startswith("tower.") else None)

    def export(self, path: str | Path, datamodule: Any = None):
        """The reader as models/reader.py loads it (config.json + weights; the encoder named and
        checked).

        Args:
            path: the folder to write the reader to.
            datamodule: unused; the export signature every stage module shares.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            held = getattr(datamodule, "held_examples", [])
            if self.hparams.fit_decision and held:
                self.fit_decision(datamodule, held)
            return self.model.save_pretrained(path)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def fit_decision(self, datamodule: Any, held: list) -> None:
        """Fit the decision on the held-out train users' examples (no dev or test gold) and write it
        into the model's config: the quantile level for ordered labels, the label prior's power
        for the others; print the metric's rule's and the fitted decision's scores on them."""
        config, rows, golds = self.model.config, [], []
        for start in range(0, len(held), 256):
            batch = self.transfer_batch_to_device(datamodule.collate(held[start:start + 256]), self.device, 0)
            rows += self.model(batch.batch).float().exp().tolist()
            golds += [config.labels[i] for i in batch.targets.tolist()]
        rule = resolve_decision(self.task, "auto")
        config.label_prior = tuple(datamodule.label_prior())
        if rule == "median":
            config.decision, config.prior_power = quantile_decision(fit_quantile(config.labels, rows, golds)), 0.0
        else:
            config.decision = "argmax"
            config.prior_power = fit_prior_power(config.labels, rows, golds, config.label_prior)
        fitted = config.decision + (f" over prior^{config.prior_power:g}" if config.prior_power else "")
        for name, decision, power in ((rule, rule, 0.0), (f"{fitted} (fitted)", config.decision, config.prior_power)):
            metric = lamp_metric(self.task)  # a fresh one: validation's states are inference tensors
            metric.update([decide(config.labels, prior_corrected(r, config.label_prior, power), decision) for r in rows],
                          golds)
            print(f"[reader] {len(held)} examples of held-out train users, decision {name}: "
                  + ", ".join(f"{k} {float(v):.3f}" for k, v in metric.compute().items()), flush=True)
