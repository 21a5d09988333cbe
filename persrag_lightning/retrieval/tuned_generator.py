"""A "strategy + tuned generator" row of the evaluation: the docs another strategy of the config
retrieves, answered by the generator stage's export instead of the evaluation's LLM, so the table
shows what retrieval adds once the generator has learned to use it."""

from __future__ import annotations

from persrag_lightning.retrieval.base import DocStore, Query, RetrievedDoc, Strategy
from persrag_lightning.stages import bundle_address
from persrag_lightning.utils import ConfigError

__all__ = ["TunedGenerator"]


class TunedGenerator(Strategy):
    """`retrieval` names a strategy of the same config (bound by the evaluation); `generator` is an
    exported generator folder (the run's `generator` bundle), loaded through the evaluation's LLM settings
    with it as the model."""

    def __init__(
        self, retrieval: str, generator: str = bundle_address("generator"), name: str | None = None
    ) -> None:
        """Args are names and paths; the evaluation binds the strategy and loads the generator.

        Args:
            retrieval: the name of the strategy of the same config whose docs fill the prompts.
            generator: the generator stage's export; the default's run folder (`stages.RUN_DIR`) is
                checkpoints/<run_name>.
            name: the row name in the evaluation's table; None = `<retrieval> + tuned generator`.
        """
        self.retrieval_name = retrieval
        self.generator = generator
        self.name = name or f"{retrieval} + tuned generator"
        self.retrieval: Strategy | None = None

    @property
    def wrapped_name(self) -> str:
        return self.retrieval_name

    @property
    def wrapped(self) -> Strategy | None:
        return self.retrieval

    @property
    def answering_model(self) -> str:
        return self.generator

    def bind(self, by_name: dict[str, Strategy]) -> None:
        if self.retrieval is None:
            if self.retrieval_name not in by_name:
                raise ConfigError(
                    f"{self.name}: no strategy named {self.retrieval_name!r} in the config "
                    f"(have {sorted(by_name)})"
                )
            self.retrieval = by_name[self.retrieval_name]

    def _wrapped(self) -> Strategy:
        if self.retrieval is None:
            raise RuntimeError(
                f"{self.name}: bind() the strategies of the config before retrieving"
            )
        return self.retrieval

    def prepare(self, store: DocStore) -> None:
        super().prepare(store)
        self._wrapped().prepare(store)

    def retrieve(self, queries: list[Query], k: int) -> list[list[RetrievedDoc]]:
        return self._wrapped().retrieve(queries, k)
