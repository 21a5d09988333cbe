"""Which reader a setting names: `llm` (the `LLMConfig`'s LLM) or a trained reader's export
folder. The one way to build a reader: the evaluation, the feedback labels, the generator's
validation and serving open theirs here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from persrag_lightning.data.prompt_store import PromptStore
from persrag_lightning.reading.base import Reader

if TYPE_CHECKING:
    from persrag_lightning.llm.base import LLM
    from persrag_lightning.llm.registry import LLMConfig

__all__ = ["LLM_READER", "open_reader"]

LLM_READER = "llm"


def open_reader(reader: str, config: LLMConfig | None = None, store: PromptStore | None = None, *,
                llm: LLM | None = None, remember_terms: bool = True) -> Reader:
    """The reader `reader` names: `llm`, the LLM of `config` (an `LLMReader`, which also reads
    prompts built by its caller), or the path of a trained reader's export (its decision is
    `config`'s, so both answer by the same rule).

    Args:
        reader: `llm` or a trained reader's export folder.
        config: the LLM's settings (prompt budget, answer mode, calibration, decision); None =
            `LLMConfig()`.
        store: the prompt store every LLM output goes through; None reads every prompt (serving).
        llm: the LLM reader's loaded LLM (a generator under training, serving's LLM shared with
            chat); None = `config.load()` on first use. A trained reader reads without one.
        remember_terms: the LLM reader without a store remembers the calibration prompts' scores
            per model; False for an LLM whose weights change between calls (a generator under
            training).
    """
    # imported here: llm/registry.py imports reading.decision, which runs this package's __init__
    from persrag_lightning.llm.registry import LLMConfig

    config = config or LLMConfig()
    if reader == LLM_READER:
        from persrag_lightning.reading.llm import LLMReader

        return LLMReader(config, llm=llm, store=store, remember_terms=remember_terms)
    if llm is not None:
        raise ValueError(f"a trained reader ({reader}) reads without an LLM; pass llm only with reader 'llm'")
    from persrag_lightning.reading.trained import TrainedReader

    return TrainedReader(reader, decision=config.decision)
