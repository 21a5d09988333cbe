"""The pipeline's LLM behind the service's model lock, for the memory extraction that runs outside
the chat's locked section (moved out of serving/service.py, which `ChatService.open` uses it in)."""

from __future__ import annotations

from persrag_lightning.llm.base import LLM
from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline
from persrag_lightning.serving.model_lock import ModelLock

__all__ = ["LockedLLM"]


class LockedLLM(LLM):
    """The pipeline's LLM (loaded on first use) behind the service's model lock, for the memory
    extraction that runs outside the chat's locked section: one model, one caller at a time.

    Args:
        pipeline: the pipeline whose LLM is wrapped.
        lock: the service's model lock.
    """

    def __init__(self, pipeline: CFRAGPipeline, lock: ModelLock) -> None:
        super().__init__(batch_size=pipeline.llm_config.batch_size)
        self.pipeline, self.lock = pipeline, lock
        self.backend = pipeline.llm_config.backend

    @property
    def name(self) -> str:
        return self.pipeline.llm_config.model

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        with self.lock:
            return self.pipeline.llm.generate(prompts, max_new_tokens)

    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        with self.lock:
            return self.pipeline.llm.score(prompts, targets)

    def count_tokens(self, text: str) -> int:
        with self.lock:
            return self.pipeline.llm.count_tokens(text)
