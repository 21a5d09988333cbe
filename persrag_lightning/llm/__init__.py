"""LLM layer: one interface (generate / score), backends behind it, Table 4 prompts, answer
post-processing."""

from persrag_lightning.llm.base import LLM, LLMBackendError, ModelSource, resolve_model
from persrag_lightning.llm.postprocess import default_max_new_tokens, postprocess
from persrag_lightning.llm.prompts import DEFAULT_MAX_PROMPT_TOKENS, PROMPT_VERSION, build_prompt
from persrag_lightning.llm.registry import BACKENDS, LLMConfig, load_llm

__all__ = [
    "BACKENDS",
    "DEFAULT_MAX_PROMPT_TOKENS",
    "LLM",
    "PROMPT_VERSION",
    "LLMBackendError",
    "LLMConfig",
    "ModelSource",
    "build_prompt",
    "default_max_new_tokens",
    "load_llm",
    "postprocess",
    "resolve_model",
]
