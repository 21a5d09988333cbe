"""transformers backend: left-padded, length-sorted greedy batches; GGUF sources de-quantised once to safetensors."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from persrag_lightning.llm.base import LLM, LLMBackendError, ModelSource, cache_root, resolve_model

_DONE_MARKER = "persrag_source.json"


def _dtype_kw(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers >= 4.56 spells it `dtype`, older releases `torch_dtype`."""
    import transformers
    from packaging.version import Version

    return {"dtype": dtype} if Version(transformers.__version__) >= Version("4.56") else {"torch_dtype": dtype}


def converted_dir(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the safetensors copy of a GGUF source lives: <cache>/llm/<name>-<digest>."""
    return cache_root(cache_dir) / "llm" / f"{source.name}-{source.digest}"


def gguf_to_safetensors(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> Path:
    """De-quantise a GGUF once and save model + tokenizer as safetensors, atomically, so later loads are instant."""
    target = converted_dir(source, cache_dir)
    if (target / _DONE_MARKER).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        gguf = Path(source.path)
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     **_dtype_kw(torch.float32))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The de-quantised weights are plain float tensors; drop the GGUF quantizer so they can be serialised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {"source": source.path, "digest": source.digest, "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / _DONE_MARKER).write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():  # not a concurrent winner: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, LLMBackendError):
            raise
        raise LLMBackendError(f"could not convert GGUF {source.path} to safetensors in {target}: {err}") from err
    return target


def local_model_path(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> str:
    """A path (or cached Hub name) that `from_pretrained` can load without network."""
    return str(gguf_to_safetensors(source, cache_dir)) if source.is_gguf else source.path


def load_tokenizer(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> Any:
    """The source's tokenizer (chat template included), from the converted copy when there is one."""
    from transformers import AutoTokenizer

    try:
        if source.is_gguf:
            done = converted_dir(source, cache_dir)
            if (done / _DONE_MARKER).is_file():
                return AutoTokenizer.from_pretrained(str(done))
            gguf = Path(source.path)
            return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    except OSError as err:
        raise LLMBackendError(f"cannot load the tokenizer of {source.path!r} from local files: {err}") from err


def resolve_device_dtype(device: str, dtype: str | torch.dtype) -> tuple[torch.device, torch.dtype]:
    """`auto` picks CUDA with bfloat16 when present, else CPU with float32."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if isinstance(dtype, torch.dtype):
        return dev, dtype
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    named = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in named:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(named)}")
    return dev, named[dtype]


class HFLLM(LLM):
    """transformers causal LM behind the LLM interface (default backend, also the training-time scorer)."""

    backend = "hf"

    def __init__(self, model: str = "smollm2", batch_size: int = 8, device: str = "auto",
                 dtype: str | torch.dtype = "auto", cache_dir: str | os.PathLike | None = None,
                 use_chat_template: bool = True, num_threads: int | None = None) -> None:
        """`num_threads` sets torch's (process-wide) CPU threads: 1 is much faster when other jobs share the cores."""
        super().__init__(batch_size)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.source = resolve_model(model)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.use_chat_template = use_chat_template
        path = local_model_path(self.source, cache_dir)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **_dtype_kw(self.dtype))
        except OSError as err:
            raise LLMBackendError(
                f"cannot load model {model!r} from local files ({path}); nothing is downloaded at run time, "
                f"so fetch it beforehand or pass a local folder / GGUF file: {err}"
            ) from err
        self.model.to(self.device).eval()
        if use_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise LLMBackendError(f"model {model!r} has no chat template; pass use_chat_template=False")
        self._eos_ids = self._collect_eos_ids()
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else self._eos_ids[0]
        params = inspect.signature(self.model.forward).parameters
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    def _collect_eos_ids(self) -> list[int]:
        """End-of-turn ids: the tokenizer's EOS plus the generation config's (chat models often list several)."""
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
        return {"dtype": str(self.dtype), "chat_template": self.use_chat_template}

    def _digest(self) -> str:
        return self.source.digest

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat_text(self, prompt: str) -> str:
        """The prompt as one user turn followed by the assistant header (or raw when chat templates are off)."""
        if not self.use_chat_template:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    def _encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        texts = [self.chat_text(p) for p in prompts]
        add_special = not self.use_chat_template  # the template already writes BOS where the model wants one
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=add_special)["input_ids"]]

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
        """Indices sorted longest first (memory errors show up at once) and cut into batches of similar length."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        return [order[s:s + self.batch_size] for s in range(0, len(order), self.batch_size)]

    @torch.inference_mode()
    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        from transformers import GenerationConfig

        if not prompts:
            return []
        encoded = self._encode_prompts(prompts)
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                  eos_token_id=self._eos_ids, pad_token_id=self._pad_id)
        outputs = [""] * len(prompts)
        for idx in self._batches([len(e) for e in encoded]):
            ids, mask = self._left_pad([encoded[i] for i in idx])
            try:
                gen = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            except RuntimeError as err:
                raise LLMBackendError(f"hf generate failed on {self.name} (batch of {len(idx)}): {err}") from err
            for row, i in zip(gen[:, ids.shape[1]:].tolist(), idx):
                cut = next((j for j, t in enumerate(row) if t in self._eos_ids), len(row))
                outputs[i] = self.tokenizer.decode(row[:cut], skip_special_tokens=True).strip()
        return outputs

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

    # Most option rows (examples x multi-token options) sent through one cached forward: bounds the memory of the
    # expanded KV cache (rows x prompt length) when prompts are long and label lists are large.
    option_rows: int = 64

    @torch.inference_mode()
    def score_options(self, prompts: list[str], options: list[str]) -> list[list[float]]:
        """`score` of every option for every prompt, encoding each prompt once rather than once per option.

        Prompts go through one left-padded forward (batched as in `score`) that keeps the KV cache; its last
        logits already score every option's first token. Options of two or more tokens then run as right-padded
        continuations over that cache, repeated once per option, with the positions `score` would give them.
        Options are tokenised on their own and appended to the chat-formatted prompt ids, exactly as `score`
        does, so both give the same numbers.
        """
        self._check_options(options)
        if not prompts:
            return []
        prompt_ids = self._encode_prompts(prompts)
        option_ids = [list(t) for t in self.tokenizer(list(options), add_special_tokens=False)["input_ids"]]
        multi = [k for k, o in enumerate(option_ids) if len(o) >= 2]  # options that need the cached pass
        width = max((len(option_ids[k]) - 1 for k in multi), default=0)
        cont = torch.full((len(multi), max(width, 1)), self._pad_id, dtype=torch.long)
        cont_mask = torch.zeros_like(cont)
        for r, k in enumerate(multi):  # every token but the last is fed; the last is only predicted
            cont[r, :len(option_ids[k]) - 1] = torch.tensor(option_ids[k][:-1], dtype=torch.long)
            cont_mask[r, :len(option_ids[k]) - 1] = 1
        cont, cont_mask = cont.to(self.device), cont_mask.to(self.device)
        first = torch.tensor([o[0] if o else 0 for o in option_ids], device=self.device)
        has_first = torch.tensor([bool(o) for o in option_ids], device=self.device)
        scores = [[0.0] * len(options) for _ in prompts]
        for idx in self._batches([len(e) for e in prompt_ids]):
            ids, mask = self._left_pad([prompt_ids[i] for i in idx])
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": positions, "use_cache": True}
            if self._keep_kw is not None:
                kwargs[self._keep_kw] = 1
            out = self.model(input_ids=ids, **kwargs)
            head = out.logits[:, -1, :].float().log_softmax(-1)  # [B, V]: next-token log-probs after each prompt
            total = torch.where(has_first, head[:, first], torch.zeros((), device=head.device))  # [B, K]
            if multi:
                total[:, multi] += self._continuation_logp(out.past_key_values, mask, cont, cont_mask,
                                                           [option_ids[k] for k in multi])
            for b, i in enumerate(idx):
                scores[i] = [float(v) for v in total[b]]
        return scores

    def _continuation_logp(self, cache: Any, mask: torch.Tensor, cont: torch.Tensor, cont_mask: torch.Tensor,
                           option_ids: list[list[int]]) -> torch.Tensor:
        """Log-probability of options' tokens after the first, over the prompts' cache: [B, len(option_ids)].

        The cache (B prompts) is repeated per option; when B x options exceeds `option_rows`, examples go in
        chunks, each on its own copy of the cache (a forward appends to the cache it is given).
        """
        import copy

        if isinstance(cache, (tuple, list)):  # transformers < 4.47 hands back the legacy tuple format
            from transformers import DynamicCache

            cache = DynamicCache.from_legacy_cache(cache)
        n_prompts, n_opts = mask.shape[0], cont.shape[0]
        prompt_lengths = mask.sum(-1)
        targets = torch.zeros_like(cont)
        for r, o in enumerate(option_ids):
            targets[r, :len(o) - 1] = torch.tensor(o[1:], dtype=torch.long)
        per_chunk = max(1, self.option_rows // n_opts)
        result = torch.zeros((n_prompts, n_opts), dtype=torch.float32, device=mask.device)
        for start in range(0, n_prompts, per_chunk):
            rows = torch.arange(start, min(start + per_chunk, n_prompts), device=mask.device)
            if len(rows) == n_prompts:
                chunk_cache = cache  # the only chunk: expand the cache in place, no copy
            else:
                chunk_cache = copy.deepcopy(cache)
                chunk_cache.batch_select_indices(rows)
            chunk_cache.batch_repeat_interleave(n_opts)
            n = len(rows)
            ids = cont.repeat(n, 1)  # row = example * n_opts + option, matching repeat_interleave
            full_mask = torch.cat([mask[rows].repeat_interleave(n_opts, 0), cont_mask.repeat(n, 1)], dim=1)
            offsets = torch.arange(cont.shape[1], device=mask.device)
            positions = prompt_lengths[rows].repeat_interleave(n_opts)[:, None] + offsets[None, :]
            logits = self.model(input_ids=ids, attention_mask=full_mask, position_ids=positions,
                                past_key_values=chunk_cache, use_cache=True).logits
            logp = logits.float().log_softmax(-1).gather(-1, targets.repeat(n, 1)[..., None])[..., 0]
            logp = (logp * cont_mask.repeat(n, 1)).sum(-1)
            result[rows] = logp.view(n, n_opts)
        return result

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
