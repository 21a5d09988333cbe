"""Stage 2 of CFRAG (§4.2.2): fine-tune the personalized retriever on LLM feedback (training logic shared with
stage 3 in modules/distillation.py)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal

from persrag_lightning.models.retriever import PersonalizedRetriever, RetrieverConfig
from persrag_lightning.modules.distillation import FeedbackDistillationModule, LrSchedule


class RetrieverModule(FeedbackDistillationModule):
    """Stage 2: the bi-encoder + user map of Eq. 5, trained with KL(p_LLM ‖ p_retriever) (Eq. 6–8)."""

    bundle_name = "retriever"

    def __init__(self, alpha: float = 0.1, shared_encoder: bool = True, encoder: str = "minilm",
                 doc_encoder: str | None = None, pooling: Literal["mean", "cls"] = "mean", max_length: int = 256,
                 user_map_layers: int = 1, train_user_embeddings: bool = False, lora_r: int = 0,
                 lora_alpha: int = 16, lora_dropout: float = 0.0,
                 lora_target_modules: tuple[str, ...] = ("query", "value"), student_temperature: float = 1.0,
                 teacher_temperature: float = 1.0, lr: float = 6e-5, weight_decay: float = 0.0,
                 warmup_ratio: float = 0.0, lr_schedule: LrSchedule = "constant", eval_k: int = 5) -> None:
        """Defaults of the official code: α = 0.1, shared encoder, T = T_t = 1, lr 6e-5 (it uses Adam without
        weight decay, hence 0.0; it trains 1 epoch at batch 1 with 4 accumulated steps, which is trainer
        configuration)."""
        super().__init__()
        self.save_hyperparameters()
        self._init_state()

    def _config_kwargs(self) -> dict:
        h = self.hparams
        return {"alpha": h.alpha, "shared_encoder": h.shared_encoder, "doc_encoder": h.doc_encoder,
                "pooling": h.pooling, "max_length": h.max_length, "user_map_layers": h.user_map_layers,
                "train_user_embeddings": h.train_user_embeddings, "lora_r": h.lora_r, "lora_alpha": h.lora_alpha,
                "lora_dropout": h.lora_dropout, "lora_target_modules": tuple(h.lora_target_modules)}

    def _build_model(self, user_dim: int) -> PersonalizedRetriever:
        return PersonalizedRetriever.from_encoder(self.hparams.encoder, user_dim, **self._config_kwargs())

    def _model_from_config(self, config: dict) -> PersonalizedRetriever:
        cfg = RetrieverConfig(**{**config, "lora_target_modules": tuple(config["lora_target_modules"])})
        kwargs = asdict(cfg)
        return PersonalizedRetriever.from_encoder(kwargs.pop("encoder"), kwargs.pop("user_dim"), **kwargs)
