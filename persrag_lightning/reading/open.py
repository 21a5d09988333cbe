"""Which reader a setting names: `llm` (the `LLMConfig`'s LLM) or a trained reader's export
folder."""

from __future__ import annotations

from typing import TYPE_CHECKING

from persrag_lightning.data.prompt_store import PromptStore
from persrag_lightning.reading.base import Reader

if TYPE_CHECKING:
    from persrag_lightning.llm.registry import LLMConfig

__all__ = ["LLM_READER", "open_reader"]

LLM_READER = "llm"


def open_reader(
    reader: str, llm: LLMConfig | None = None, store: PromptStore | None = None
) -> Reader:
    """`reader`: `llm` (the LLM of `llm`, read through `store`) or the path of a trained reader's
    export (its decision is the LLM config's, so both answer by the same rule)."""
    # imported here: llm/registry.py imports reading.decision, which runs this package's __init__
    from persrag_lightning.llm.registry import LLMConfig

    if reader == LLM_READER:
        from persrag_lightning.reading.llm import LLMReader

        return LLMReader(llm or LLMConfig(), store=store)
    from persrag_lightning.reading.trained import TrainedReader

    return TrainedReader(reader, decision=(llm or LLMConfig()).decision)
