"""Stage 2 of CFRAG (§4.2.2): fine-tune the personalized retriever on LLM feedback (training logic
shared with stage 3 in modules/distillation.py)."""

from __future__ import annotations

import torch

from persrag_lightning.models.retriever import PersonalizedRetriever, RetrieverConfig, RetrieverSettings
from persrag_lightning.modules.distillation import FeedbackDistillationModule
from persrag_lightning.modules.optim import DistillationSettings

__all__ = ["RetrieverModule"]

# a checkpoint's hyperparameters hold these settings objects: torch.load (weights_only) must know
# them
torch.serialization.add_safe_globals([RetrieverSettings, DistillationSettings])


class RetrieverModule(FeedbackDistillationModule):
    """Stage 2: the bi-encoder + user map of Eq. 5, trained with KL(p_LLM ‖ p_retriever) (Eq. 6–8).

    The defaults are the official code's: α = 0.1, a shared encoder, T = T_t = 1, lr 6e-5 (it uses
    Adam without weight decay, hence 0.0; it trains 1 epoch at batch 1 with 4 accumulated steps,
    which is trainer and data configuration).

    Args:
        config: the retriever (exported as its config.json, with the user table's width added from
            the data).
        training: the KL distillation and its optimiser.
    """

    bundle_name = "retriever"
    model_class = PersonalizedRetriever
    config_class = RetrieverConfig
    settings_class = RetrieverSettings

    def __init__(self, config: RetrieverSettings = RetrieverSettings(),
                 training: DistillationSettings = DistillationSettings()) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._init_state(config, training)

    @property
    def train_user_embeddings(self) -> bool:
        return self.config.train_user_embeddings
