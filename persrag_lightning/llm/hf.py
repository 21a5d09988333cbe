"""transformers causal-LM backend: left-padded, length-sorted greedy batches (GGUF sources through
llm/gguf.py; the encoder-decoder family in llm/hf_seq2seq.py)."""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from persrag_lightning.llm.base import LLM, LLMBackendError, ModelSource, resolve_model
from persrag_lightning.llm.gguf import dtype_kw, local_model_path
from persrag_lightning.llm.hf_device import FollowsModelDevice, check_beams, resolve_device_dtype
from persrag_lightning.llm.json_decoding import json_prefix_function
from persrag_lightning.llm.option_scoring import option_scores, pack_option_tree, tree_length
from persrag_lightning.runtime import use_fastest_gemm

__all__ = ["HFLLM"]


class HFLLM(FollowsModelDevice, LLM):
    """transformers causal LM behind the LLM interface (default backend, also the training-time
    scorer)."""

    backend = "hf"

    @property
    def supports_json_schema(self) -> bool:
        """Constrained JSON decoding needs lm-format-enforcer (the `constrained` extra)."""
        import importlib.util

        return importlib.util.find_spec("lmformatenforcer") is not None

    def __init__(self, model: str = "smollm2", batch_size: int = 8, device: str = "auto",
                 dtype: str | torch.dtype = "auto", cache_dir: str | os.PathLike | None = None,
                 use_chat_template: bool = True, num_threads: int | None = None, num_beams: int = 1) -> None:
        """`num_threads` sets torch's (process-wide) CPU threads: 1 is much faster when other jobs
        share the cores. `num_beams`: 1 is greedy decoding (CFRAG's and the default); ClusterRAG's
        paper generates with beam search, 4 beams, which `num_beams=4` reproduces (in the
        fingerprint: answers change)."""
        super().__init__(batch_size)
        self.num_beams = check_beams(num_beams)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.source = resolve_model(model)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.use_chat_template = use_chat_template
        path = local_model_path(self.source, cache_dir)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **dtype_kw(self.dtype))
        except OSError as err:
            raise LLMBackendError(
                f"cannot load model {model!r} from local files ({path}); nothing is downloaded at run time, "
                f"so fetch it beforehand or pass a local folder / GGUF file: {err}"
            ) from err
        self.model.to(self._device).eval()
        # the reader's float32 Linear layers on this CPU's fastest GEMM path (runtime.py); torch's
        # elsewhere
        self.gemm = use_fastest_gemm(self.model, "reader") if self.dtype == torch.float32 and \
            self._device.type == "cpu" else "torch"
        self._attach(model)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, batch_size: int = 8, use_chat_template: bool = True,
                   name: str = "in-training") -> HFLLM:
        """The backend around a model already in memory (the generator stage validates the model it
        trains with the same prompt encoding and answer path as evaluation); a peft-wrapped model
        works too."""
        self = cls.__new__(cls)
        LLM.__init__(self, batch_size)
        self.num_beams = 1
        self.source = ModelSource(name, "", "memory", "")
        self.model, self.tokenizer, self.use_chat_template = model, tokenizer, use_chat_template
        self.gemm = "torch"  # a model in training keeps torch's layers
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._attach(name)
        return self

    def _attach(self, model: str) -> None:
        if self.use_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise LLMBackendError(f"model {model!r} has no chat template; pass use_chat_template=False")
        self._eos_ids = self._collect_eos_ids()
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else self._eos_ids[0]
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        params = inspect.signature(base.forward).parameters
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    def _collect_eos_ids(self) -> list[int]:
        """End-of-turn ids: the tokenizer's EOS plus the generation config's (chat models often list
        several)."""
        ids: list[int] = []
        for value in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            for i in value if isinstance(value, (list, tuple)) else [value]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        if not ids:
            raise LLMBackendError(f"model {self.source.path!r} defines no EOS token; greedy decoding cannot stop")
        return ids

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def settings(self) -> dict[str, object]:
        # greedy keeps its old fingerprint
        beams = {"num_beams": self.num_beams} if self.num_beams != 1 else {}
        return {"dtype": str(self.dtype), "chat_template": self.use_chat_template, **beams}

    def _digest(self) -> str:
        return self.source.digest

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat_text(self, prompt: str) -> str:
        """The prompt as one user turn followed by the assistant header (or raw when chat templates
        are off)."""
        if not self.use_chat_template:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    def _encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        texts = [self.chat_text(p) for p in prompts]
        # the template already writes BOS where the model wants one
        add_special = not self.use_chat_template
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=add_special)["input_ids"]]

    def encode_pairs(self, prompts: list[str], targets: list[str]) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, target ids) of training pairs, encoded exactly as `score` and `generate` see
        them: the chat-formatted prompt, then the target as the assistant turn followed by the
        end-of-turn token (so a tuned model also learns to stop)."""
        self._check_pairs(prompts, targets)
        prompt_ids = self._encode_prompts(prompts)
        target_ids = self.tokenizer(list(targets), add_special_tokens=False)["input_ids"]
        return [(p, [*t, self._eos_ids[0]]) for p, t in zip(prompt_ids, target_ids)]

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
                mask[i, width - len(r):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices sorted longest first (memory errors show up at once) and cut into batches of
        similar length."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        return [order[s:s + self.batch_size] for s in range(0, len(order), self.batch_size)]

    @torch.inference_mode()
    def generate(self, prompts: list[str], max_new_tokens: int, json_schema: dict | None = None) -> list[str]:
        """Greedy (or `num_beams`-beam) answers; with `json_schema`, decoding is constrained to JSON
        that matches it by lm-format-enforcer's prefix function (`pip install
        lm-format-enforcer`)."""
        from transformers import GenerationConfig

        if not prompts:
            return []
        encoded = self._encode_prompts(prompts)
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=self.num_beams,
                                  eos_token_id=self._eos_ids, pad_token_id=self._pad_id)
        constrain = {} if json_schema is None else {
            "prefix_allowed_tokens_fn": json_prefix_function(self.tokenizer, json_schema, self._eos_ids)}
        outputs = [""] * len(prompts)
        for idx in self._batches([len(e) for e in encoded]):
            ids, mask = self._left_pad([encoded[i] for i in idx])
            try:
                gen = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                          **constrain)
            except RuntimeError as err:
                raise LLMBackendError(f"hf generate failed on {self.name} (batch of {len(idx)}): {err}") from err
            for row, i in zip(gen[:, ids.shape[1]:].tolist(), idx):
                outputs[i] = self.reply_text(row)
        return outputs

    def reply_text(self, tokens: list[int]) -> str:
        """A generated row's answer: its tokens up to the first end-of-turn token, decoded,
        stripped (`generate`'s and continuous batching's, llm/hf_stepping.py)."""
        cut = next((j for j, t in enumerate(tokens) if t in self._eos_ids), len(tokens))
        return self.tokenizer.decode(tokens[:cut], skip_special_tokens=True).strip()

    @torch.inference_mode()
    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        self._check_pairs(prompts, targets)
        if not prompts:
            return []
        prompt_ids = self._encode_prompts(prompts)
        target_ids = [list(t) for t in self.tokenizer(list(targets), add_special_tokens=False)["input_ids"]]
        rows = [p + t for p, t in zip(prompt_ids, target_ids)]
        scores = [0.0] * len(prompts)
        for idx in self._batches([len(r) for r in rows]):
            ids, mask = self._left_pad([rows[i] for i in idx])
            # Left padding puts every target at the end; explicit positions keep padded rows exact.
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            keep = max(len(target_ids[i]) for i in idx) + 1
            kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
            if self._keep_kw is not None:
                kwargs[self._keep_kw] = keep
            logits = self.model(input_ids=ids, **kwargs).logits[:, -keep:, :]
            logp = logits.float().log_softmax(-1)
            for b, i in enumerate(idx):
                n = len(target_ids[i])
                if n == 0:
                    continue
                tgt = torch.tensor(target_ids[i], device=logp.device)
                rows_logp = logp[b, keep - n - 1: keep - 1]
                scores[i] = float(rows_logp.gather(-1, tgt[:, None]).sum())
        return scores

    @torch.inference_mode()
    def score_options(self, prompts: list[str], options: list[str]) -> list[list[float]]:
        """`score` of every option for every prompt in ONE forward per batch of prompts.

        Each row packs the chat-formatted prompt and, after it, every option's tokens but the last (tree
        attention): a 4D mask lets option k's tokens see the prompt and their own earlier tokens only, and their
        positions restart after the prompt, so each option is scored exactly as `score` scores it alone, while
        the prompt is encoded once and no KV cache is copied per option. The prompt's last logits score every
        option's first token; option k's j-th fed token scores its (j+1)-th token.
        """
        self._check_options(options)
        if not prompts:
            return []
        prompt_ids = self._encode_prompts(prompts)
        option_ids = [list(t) for t in self.tokenizer(list(options), add_special_tokens=False)["input_ids"]]
        keep = tree_length(option_ids) + 1  # the prompt's last position and the options' tokens: the only logits needed
        scores = [[0.0] * len(options) for _ in prompts]
        for idx in self._batches([len(e) for e in prompt_ids]):
            ids, positions, mask = pack_option_tree([prompt_ids[i] for i in idx], option_ids, self._pad_id,
                                                    self.model.dtype)
            kwargs: dict[str, Any] = {"attention_mask": mask.to(self.device),
                                      "position_ids": positions.to(self.device), "use_cache": False}
            if self._keep_kw is not None:
                kwargs[self._keep_kw] = keep
            logits = self.model(input_ids=ids.to(self.device), **kwargs).logits[:, -keep:]
            logp = logits.float().log_softmax(-1)
            for b, i in enumerate(idx):
                scores[i] = option_scores(logp[b], option_ids)
        return scores

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
