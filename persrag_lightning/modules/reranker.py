"""Stage 3 of CFRAG (§4.3.2): fine-tune the personalized reranker on LLM feedback over the trained
retriever's m·k candidates; the training logic is stage 2's (FeedbackDistillationModule)."""

from __future__ import annotations

from dataclasses import replace

import torch

from persrag_lightning.models.reranker import (
    PersonalizedReranker,
    RerankerConfig,
    RerankerSettings,
    keep_layers,
)
from persrag_lightning.modules.distillation import FeedbackDistillationModule
from persrag_lightning.modules.optim import DistillationSettings

__all__ = ["RerankerModule"]

# a checkpoint's hyperparameters hold these settings objects: torch.load (weights_only) must know
# them
torch.serialization.add_safe_globals([RerankerSettings, DistillationSettings])


class RerankerModule(FeedbackDistillationModule):
    """Stage 3: cross-encoder [CLS] state + MLP2(e_u) → MLP3 (Eq. 9–10), trained with KL(p_LLM ‖
    p_reranker) (Eq. 6, 11–12).

    T = T_t = 0.1 as the official code. REFERENCE.md gives no reranker learning rate, so lr is the
    retriever's official 6e-5 (the paper tunes it in {1e-3, 1e-4, 1e-5}).

    A distilled reranker (configs/cfrag_reranker_distilled.yaml): `config.num_layers` keeps the
    encoder's first N layers; `init_from` (a reranker export, usually the teacher) starts from its
    weights — encoder, MLP2 and MLP3 — and its pair lengths, so the student reads the pairs its
    teacher read.

    Args:
        config: the reranker (exported as its config.json, with the user table's width added from
            the data).
        training: the KL distillation (T = T_t = 0.1, the official code's) and its optimiser.
        init_from: a reranker export to start from (the teacher of a distilled reranker); None
            starts from `config.encoder` with a fresh head.
    """

    bundle_name = "reranker"
    model_class = PersonalizedReranker
    config_class = RerankerConfig
    settings_class = RerankerSettings

    def __init__(self, config: RerankerSettings = RerankerSettings(),
                 training: DistillationSettings = DistillationSettings(student_temperature=0.1,
                                                                       teacher_temperature=0.1),
                 init_from: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._init_state(config, training)

    def _build_model(self, user_dim: int) -> PersonalizedReranker:
        if self.hparams.init_from:
            return self._student_of(self.hparams.init_from, user_dim)
        return super()._build_model(user_dim)

    def _student_of(self, path: str, user_dim: int) -> PersonalizedReranker:
        """The export at `path` cut to `num_layers` and split at `split_layer`, after checking it fits
        this stage (users, pair lengths)."""
        s = self.config
        model = PersonalizedReranker.from_pretrained(path)
        c = model.config
        if s.lora_r > 0:
            raise ValueError("init_from fine-tunes the whole (smaller) student: set lora_r: 0")
        if (c.user_dim, c.use_user) != (user_dim, s.use_user):
            raise ValueError(f"init_from {path}: a reranker for {c.user_dim}-d users with use_user={c.use_user}, "
                             f"this stage has {user_dim}-d users and use_user={s.use_user}")
        lengths = (c.max_length, c.max_query_length, c.max_doc_length)
        if lengths != (s.max_length, s.max_query_length, s.max_doc_length):
            raise ValueError(f"init_from {path}: its pairs are cut to (max_length, max_query_length, max_doc_length) "
                             f"= {lengths}, this stage's settings say {(s.max_length, s.max_query_length, s.max_doc_length)}")
        keep_layers(model.encoder, s.num_layers)
        config = replace(c, num_layers=s.num_layers if s.num_layers is not None else c.num_layers,
                         split_layer=s.split_layer)
        # the student reads as its own settings say (split below `split_layer` or not), with the teacher's MLPs
        student = PersonalizedReranker(config, model.encoder, model.tokenizer)
        student.head, student.user_map = model.head, model.user_map
        return student
