"""The LLM reader: the Table 4 prompt of each question with its docs, read by the LLM of an
`LLMConfig`.

Label tasks under `answer_mode: choose`: every allowed label is scored by its log-probability,
calibrated against the label prior (llm/calibration.py's terms) and decided by the task metric's rule
(reading/decision.py).
Otherwise the LLM generates the answer (the paper's setting), post-processed as the official
evaluation or leniently. Every LLM output goes through a prompt store when one is given, so a prompt
read once (by any build, stage or run) is never sent again.
"""

from __future__ import annotations

from collections.abc import Sequence

from persrag_lightning.data.prompt_store import PromptStore, prompt_key
from persrag_lightning.llm.answer import allowed_labels, build_prompts, official_postprocess
from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.calibration import calibration_prompts, calibration_terms
from persrag_lightning.llm.postprocess import default_max_new_tokens, postprocess
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.progress import in_blocks
from persrag_lightning.reading.base import Docs, Reader
from persrag_lightning.reading.decision import CALIBRATIONS, check_reading, resolve_decision
from persrag_lightning.reading.label_reading import LabelReading

__all__ = ["LLMReader"]

# label scores of the calibration prompts by (model fingerprint, task, prompts), for readers without
# a prompt store (serving): a handful per task, the same for every request
_TERM_SCORES: dict[tuple, list[list[float]]] = {}


class LLMReader(Reader):
    """An `LLMConfig`'s LLM reading Table 4 prompts; `llm` is loaded from the config when not
    given."""

    kind = "llm"

    def __init__(self, config: LLMConfig, llm: LLM | None = None, store: PromptStore | None = None,
                 remember_terms: bool = True) -> None:
        """Args:
            config: which LLM reads, with its prompt budget, answer mode, calibration and decision.
            llm: the loaded LLM (e.g. a generator module's model under training); None =
                `config.load()` on first use.
            store: the prompt store every output goes through; None reads every prompt (serving).
            remember_terms: without a store, remember the calibration prompts' scores per model
                fingerprint and task (serving: the same few prompts for every request); False scores
                them anew each time, for an LLM whose weights change between calls (a generator
                under training).
        """
        self.config, self.store, self._llm, self.remember_terms = config, store, llm, remember_terms

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = self.config.load()
        return self._llm

    def identity(self) -> dict:
        return self.config.identity()

    def reading(self, task: str) -> dict:
        return self.config.reading(task)

    @property
    def reads_labels(self) -> bool:
        return self.config.answer_mode == "choose"

    def describe(self, task: str) -> str:
        reading = self.config.reading(task)
        if not reading:
            return self.config.answer_mode
        return f"choose (calibration {reading['calibration']}, decision {reading['decision']})"

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()

    # ---- questions → prompts ---------------------------------------------------------------------

    def prompts(self, task: str, inputs: Sequence[str], docs: Docs, *,
                prompt_gamma: float | None = None) -> list[str]:
        """Table 4 prompts fitted to the config's budget with the LLM's tokenizer (`prompt_gamma`:
        ClusterRAG's Eq. 3 split of the budget; None: CFRAG's even split)."""
        return build_prompts(task, self.llm, list(inputs), [list(ds) for ds in docs], self.config.max_prompt_tokens,
                             prompt_gamma)

    def read(self, task: str, inputs: Sequence[str], docs: Docs, *, prompt_gamma: float | None = None,
             phase: str | None = None, every_calibration: bool = False) -> LabelReading:
        return self.read_prompts(task, self.prompts(task, inputs, docs, prompt_gamma=prompt_gamma), phase=phase,
                                 every_calibration=every_calibration)

    def answer(self, task: str, inputs: Sequence[str], docs: Docs, *, prompt_gamma: float | None = None,
               phase: str | None = None) -> list[str]:
        return self.answer_prompts(
            task, self.prompts(task, inputs, docs, prompt_gamma=prompt_gamma), phase=phase
        )

    def score_targets(self, task: str, inputs: Sequence[str], docs: Docs, targets: Sequence[str], *,
                      phase: str | None = None) -> list[float]:
        return self.score_prompts(self.prompts(task, inputs, docs), list(targets), phase=phase)

    # ---- prompts → scores and answers (callers that built their prompts: the generator stage) ----

    def read_prompts(self, task: str, prompts: Sequence[str], *, phase: str | None = None,
                     every_calibration: bool = False) -> LabelReading:
        """Every allowed label's log p for every prompt (through the store: a calibration or
        decision changed later costs no LLM call), the calibration's terms (every calibration's with
        `every_calibration`) and the answers under the config's calibration and decision. Without a
        store the terms' few prompts are remembered per model and task."""
        config = self.config
        check_reading(config.calibration, config.decision)
        decision = resolve_decision(task, config.decision)
        labels = list(allowed_labels(task))
        rows = self._label_scores(task, labels, list(prompts), phase)
        terms_by: dict[str, list[float] | None] = {}
        for method in CALIBRATIONS if every_calibration else (config.calibration,):
            extra = calibration_prompts(task, method)
            terms_by[method] = (
                calibration_terms(method, self._term_scores(task, labels, extra)) if extra else None
            )
        return LabelReading(task, tuple(labels), rows, config.calibration, decision, terms_by)

    def answer_prompts(
        self, task: str, prompts: Sequence[str], *, phase: str | None = None
    ) -> list[str]:
        """The answers to built prompts: the decided label under `choose`, else greedy text
        post-processed (the task's token budget unless `max_new_tokens` is set)."""
        if self.reads_labels:
            return self.read_prompts(task, prompts, phase=phase).answers
        config, prompts = self.config, list(prompts)
        budget = config.max_new_tokens if config.max_new_tokens is not None else default_max_new_tokens(task)
        clean = official_postprocess if config.postprocessing == "official" else postprocess

        def compute(todo: list[int]) -> list[str]:
            return self._blocks(todo, lambda part: [clean(task, out) for out in
                                                    self.llm.generate([prompts[i] for i in part], budget)], phase)

        return self._cached(f"answer:{task}", prompts, compute)

    def score_prompts(self, prompts: Sequence[str], targets: Sequence[str], *,
                      phase: str | None = None) -> list[float]:
        """log p(target | prompt) per pair, through the store."""
        prompts, targets = list(prompts), list(targets)

        def compute(todo: list[int]) -> list[float]:
            return self._blocks(todo, lambda part: self.llm.score([prompts[i] for i in part],
                                                                  [targets[i] for i in part]), phase)

        return self._cached("loglik", prompts, compute, targets)

    # ---- the store -------------------------------------------------------------------------------

    def _label_scores(
        self, task: str, labels: list[str], prompts: list[str], phase: str | None
    ) -> list[list[float]]:
        def compute(todo: list[int]) -> list[list[float]]:
            return self._blocks(
                todo, lambda part: self.llm.score_options([prompts[i] for i in part], labels), phase
            )

        return self._cached(f"label_scores:{task}", prompts, compute)

    def _term_scores(self, task: str, labels: list[str], prompts: list[str]) -> list[list[float]]:
        if self.store is not None or not self.remember_terms:
            return self._label_scores(task, labels, prompts, None)
        key = (self.llm.fingerprint, task, tuple(prompts))
        if key not in _TERM_SCORES:
            _TERM_SCORES[key] = self._label_scores(task, labels, prompts, None)
        return _TERM_SCORES[key]

    def _blocks(self, todo: list[int], compute, phase: str | None) -> list:
        return in_blocks(todo, compute, phase, self.config.progress_every)

    def _cached(
        self, kind: str, prompts: list[str], compute, targets: list[str] | None = None
    ) -> list:
        if not prompts:
            return []
        if self.store is None:
            return compute(list(range(len(prompts))))
        identity = self.identity()
        targets = targets if targets is not None else [""] * len(prompts)
        return self.store.cached(
            [prompt_key(identity, kind, p, t) for p, t in zip(prompts, targets)], compute
        )
