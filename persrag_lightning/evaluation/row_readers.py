"""Who reads each row of a LaMP evaluation: the evaluation's reader (the LLM or a trained reader), and for a
"+ tuned generator" row its generator's export, read as the LLM with the same settings and the tuned rows'
calibration. Each is opened once, through reading's one door."""

from __future__ import annotations

from dataclasses import replace

from persrag_lightning.data.prompt_store import PromptStore
from persrag_lightning.data.tasks import get_task
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading import LLM_READER, Reader, open_reader
from persrag_lightning.reading.decision import Calibration, check_reading
from persrag_lightning.retrieval.base import Strategy
from persrag_lightning.utils import ConfigError

__all__ = ["RowReaders"]


class RowReaders:
    """The readers of an evaluation's rows, opened on first use; a setting that cannot read fails when built."""

    def __init__(self, task: str, reader: str, llm: LLMConfig, store: PromptStore,
                 generator_calibration: Calibration | None = None) -> None:
        """Args:
            task: the evaluation's task.
            reader: `llm` or a trained reader's export (label tasks only).
            llm: the LLM's settings: the `llm` reader's and the tuned generators'.
            store: the prompt store every LLM output goes through.
            generator_calibration: the tuned generators' calibration (None: `llm.calibration`).
        """
        check_reading(generator_calibration or "none", "auto")  # a misspelt one fails before any row runs
        if reader != LLM_READER and get_task(task).labels is None:
            raise ConfigError(f"evaluation.reader: a trained reader reads label tasks; {task} is a generation "
                              "task, read by the LLM (reader: llm)")
        self.spec, self.llm_config, self.store = reader, llm, store
        self.generator_calibration = generator_calibration
        self._main: Reader | None = None
        self._generators: dict[str, Reader] = {}  # tuned generators' readers by export path

    @property
    def main(self) -> Reader:
        """The reader of every row but the tuned generators'."""
        if self._main is None:
            self._main = open_reader(self.spec, self.llm_config, self.store)
        return self._main

    def for_row(self, strategy: Strategy) -> Reader:
        """The main reader, or for a `TunedGenerator` row its generator's export read as the LLM.

        Args:
            strategy: the row whose prompts are read.
        """
        generator = strategy.answering_model
        if generator is None:
            return self.main
        from persrag_lightning.bundles import require_bundle

        # not trained yet: the row is skipped with the command that makes it
        require_bundle(generator)
        if generator not in self._generators:
            config = replace(self.llm_config, model=generator, calibration=self.generator_calibration
                             or self.llm_config.calibration)
            self._generators[generator] = open_reader(LLM_READER, config, self.store)
        return self._generators[generator]
