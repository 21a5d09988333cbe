"""vLLM backend for GPU nodes: `import vllm` happens only here, so CPU installs never need it."""

from __future__ import annotations

import gc
import os
from typing import Any

from persrag_lightning.llm.base import LLM, LLMBackendError, resolve_model

__all__ = ["VLLMLLM"]


class VLLMLLM(LLM):
    """Offline vLLM engine: greedy chat generation and prompt-logprob scoring, batches scheduled by
    vLLM."""

    backend = "vllm"

    def __init__(self, model: str = "smollm2", batch_size: int = 64, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.85, max_model_len: int | None = 4096,
                 cache_dir: str | os.PathLike | None = None, seed: int = 0, **engine_kwargs: Any) -> None:
        super().__init__(batch_size)
        try:
            import vllm
        except ImportError as err:
            raise LLMBackendError(
                "the vllm backend needs vLLM on a CUDA machine: `pip install vllm`"
            ) from err
        from persrag_lightning.llm.gguf import local_model_path

        self.source = resolve_model(model)
        # GGUF sources go through the safetensors copy
        path = local_model_path(self.source, cache_dir)
        self.dtype = dtype
        self._vllm = vllm
        try:
            self.engine = vllm.LLM(model=path, tokenizer=path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   max_num_seqs=batch_size, **engine_kwargs)
        except Exception as err:  # vLLM raises many types (CUDA, config, OOM)
            raise LLMBackendError(f"vLLM could not load {model!r} from {path}: {err}") from err
        self.tokenizer = self.engine.get_tokenizer()

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def settings(self) -> dict[str, object]:
        return {"dtype": self.dtype}

    def _digest(self) -> str:
        return self.source.digest

    def close(self) -> None:
        """Stop the engine (its core process and KV cache), so another engine or model gets the
        GPU's memory."""
        engine = self.__dict__.pop("engine", None)
        if engine is None:
            return
        for owner in (engine, getattr(engine, "llm_engine", None)):
            stop = getattr(owner, "shutdown", None)
            if callable(stop):
                stop()
                break
        del engine
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_ids(self, prompt: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        inputs = [{"prompt_token_ids": self._chat_ids(p)} for p in prompts]
        try:
            outs = self.engine.generate(inputs, params, use_tqdm=False)
        except Exception as err:
            raise LLMBackendError(f"vLLM generate failed on {self.name}: {err}") from err
        return [o.outputs[0].text.strip() for o in outs]

    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        self._check_pairs(prompts, targets)
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        rows, n_target = [], []
        for p, t in zip(prompts, targets):
            tgt = list(self.tokenizer(t, add_special_tokens=False)["input_ids"])
            rows.append({"prompt_token_ids": self._chat_ids(p) + tgt})
            n_target.append(len(tgt))
        try:
            outs = self.engine.generate(rows, params, use_tqdm=False)
        except Exception as err:
            raise LLMBackendError(f"vLLM scoring failed on {self.name}: {err}") from err
        scores = []
        for out, row, n in zip(outs, rows, n_target):
            ids = row["prompt_token_ids"]
            total = 0.0
            for pos in range(len(ids) - n, len(ids)):
                total += out.prompt_logprobs[pos][ids[pos]].logprob
            scores.append(total)
        return scores
