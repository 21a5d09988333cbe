"""Progress lines with an ETA for a stage's training and validation, where no progress bar is drawn.

The pipeline and Slurm jobs run with Lightning's bar off (a redrawn bar garbles logs); without this
a stage's training and validation showed nothing until they ended: `[fit generator] epoch 1/1: 3/4
batches (75 %) (ETA x.x min)`.
"""

from __future__ import annotations

import lightning as L

from persrag_lightning.progress import Progress

__all__ = ["ProgressLines"]


class ProgressLines(L.Callback):
    """A line every `every` seconds (and the last) for the whole fit and for each validation pass,
    rank 0 only."""

    def __init__(self, stage: str, every: float = 10.0) -> None:
        self.stage, self.every = stage, every
        # "train" and "val": a validation inside an epoch keeps both
        self.bars: dict[str, Progress | None] = {}

    def _start(
        self, trainer: L.Trainer, key: str, phase: str, total: float, final: str = "always"
    ) -> None:
        total = int(total) if total not in (None, float("inf")) else 0
        self.bars[key] = Progress(f"{phase} {self.stage}", total, "batches", self.every, final) \
            if trainer.is_global_zero and total > 0 else None

    def _advance(self, key: str) -> None:
        bar = self.bars.get(key)
        if bar is not None:
            bar.advance()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """One count over every epoch of the fit, so the ETA is the stage's (resumed fits count what
        is left)."""
        per_epoch = trainer.num_training_batches
        if per_epoch in (None, float("inf")):
            return
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1
        total = per_epoch * max(epochs - trainer.current_epoch, 1)
        if trainer.max_steps and trainer.max_steps > 0:
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            total = min(total, max(left, 1))
        self._start(trainer, "train", "fit", total)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._advance("train")

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            self.bars["val"] = None
            return
        # inside a fit: lines only for a pass long enough to print one (the generator's answers, not
        # stage 1's 20 quick passes); a validate run of its own always ends with its line
        final = "if_long" if trainer.state.fn == "fit" else "always"
        self._start(trainer, "val", "validate", sum(trainer.num_val_batches), final)

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self._advance("val")
