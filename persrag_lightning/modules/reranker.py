"""Stage 3 of CFRAG (§4.3.2): fine-tune the personalized reranker on LLM feedback over the trained retriever's
m·k candidates; the training logic is stage 2's (FeedbackDistillationModule)."""

from __future__ import annotations

from dataclasses import asdict

from persrag_lightning.models.reranker import PersonalizedReranker, RerankerConfig
from persrag_lightning.modules.distillation import FeedbackDistillationModule, LrSchedule


class RerankerModule(FeedbackDistillationModule):
    """Stage 3: cross-encoder [CLS] state + MLP2(e_u) → MLP3 (Eq. 9–10), trained with KL(p_LLM ‖ p_reranker)
    (Eq. 6, 11–12)."""

    bundle_name = "reranker"

    def __init__(self, encoder: str = "minilm", use_user: bool = True, max_length: int = 512,
                 max_query_length: int = 256, max_doc_length: int = 256, lora_r: int = 0, lora_alpha: int = 16,
                 lora_dropout: float = 0.0, lora_target_modules: tuple[str, ...] = ("query", "value"),
                 student_temperature: float = 0.1, teacher_temperature: float = 0.1, lr: float = 6e-5,
                 weight_decay: float = 0.0, warmup_ratio: float = 0.0, lr_schedule: LrSchedule = "constant",
                 eval_k: int = 5) -> None:
        """T = T_t = 0.1 as the official code. REFERENCE.md gives no reranker learning rate, so lr is the
        retriever's official 6e-5 (the paper tunes it in {1e-3, 1e-4, 1e-5})."""
        super().__init__()
        self.save_hyperparameters()
        self._init_state()

    def _build_model(self, user_dim: int) -> PersonalizedReranker:
        h = self.hparams
        return PersonalizedReranker.from_encoder(
            h.encoder, user_dim, use_user=h.use_user, max_length=h.max_length, max_query_length=h.max_query_length,
            max_doc_length=h.max_doc_length, lora_r=h.lora_r, lora_alpha=h.lora_alpha, lora_dropout=h.lora_dropout,
            lora_target_modules=tuple(h.lora_target_modules))

    def _model_from_config(self, config: dict) -> PersonalizedReranker:
        cfg = RerankerConfig(**{**config, "lora_target_modules": tuple(config["lora_target_modules"])})
        kwargs = asdict(cfg)
        return PersonalizedReranker.from_encoder(kwargs.pop("encoder"), kwargs.pop("user_dim"), **kwargs)
