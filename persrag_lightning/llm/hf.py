"""transformers backend: left-padded, length-sorted greedy batches (GGUF sources through
llm/gguf.py)."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from persrag_lightning.hardware import Precision, uses_bf16
from persrag_lightning.llm.base import LLM, LLMBackendError, ModelSource, resolve_model
from persrag_lightning.llm.gguf import dtype_kw, local_model_path
from persrag_lightning.runtime import use_fastest_gemm


def resolve_device_dtype(device: str, dtype: str | torch.dtype) -> tuple[torch.device, torch.dtype]:
    """`auto` picks CUDA with bfloat16 when present, else CPU with float32. `bf16_if_native` is
    bfloat16 wherever the hardware computes it natively (CUDA, or a CPU with AVX512-BF16/AMX whose
    bfloat16 matmul measures faster than float32's: `hardware.cpu_has_native_bf16`) and float32
    elsewhere: on our 2-core CPU SmolLM2 scores `choose` answers several times faster in it, nearly
    always with the float32 answer (docs/fidelity.md); greedy *generation* drifts more in bfloat16
    on CPU, so `auto` stays float32 there."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if isinstance(dtype, torch.dtype):
        return dev, dtype
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype == "bf16_if_native":
        return dev, torch.bfloat16 if uses_bf16(Precision.NATIVE, dev.type) else torch.float32
    named = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in named:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, bf16_if_native, {', '.join(named)}")
    return dev, named[dtype]


def _check_beams(num_beams: int) -> int:
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    return num_beams


_TOKENIZER_DATA: dict[tuple[int, tuple[int, ...]], Any] = {}


def _enforcer_tokenizer_data(tokenizer: Any, eos_ids: list[int]) -> Any:
    """lm-format-enforcer's token table of a tokenizer (what its transformers integration builds;
    that module imports names transformers 5 no longer has, so the table is built here with the
    library's own classes): every non-special token's text, decoded after a digit so a word-initial
    space is kept."""
    from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData

    vocab_size = len(tokenizer)
    specials = set(tokenizer.all_special_ids)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular = []
    for i in range(vocab_size):
        if i in specials:
            continue
        after_zero = tokenizer.decode([zero, i])[1:]
        regular.append((i, after_zero, len(after_zero) > len(tokenizer.decode([i]))))

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens).rstrip("\ufffd")

    return TokenEnforcerTokenizerData(regular, decode, list(eos_ids), False, vocab_size)


def _json_prefix_function(tokenizer: Any, schema: dict, eos_ids: list[int]) -> Any:
    """transformers' `prefix_allowed_tokens_fn` that lets through only tokens that continue JSON
    valid under `schema` (lm-format-enforcer's JsonSchemaParser and TokenEnforcer); the token table
    is built once per tokenizer."""
    try:
        from lmformatenforcer import JsonSchemaParser, TokenEnforcer
    except ImportError as err:
        raise LLMBackendError("constrained JSON decoding with the hf backend needs lm-format-enforcer: "
                              "`pip install lm-format-enforcer`") from err
    key = (id(tokenizer), tuple(eos_ids))
    if key not in _TOKENIZER_DATA:
        _TOKENIZER_DATA[key] = _enforcer_tokenizer_data(tokenizer, eos_ids)
    enforcer = TokenEnforcer(_TOKENIZER_DATA[key], JsonSchemaParser(schema))

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        return enforcer.get_allowed_tokens(sent.tolist()).allowed_tokens

    return allowed


class _FollowsModelDevice:
    """`device` is where the model's weights are now, not where they were when the backend was
    built: the generator stage wraps the model it trains (`from_model`) before Lightning moves it to
    the GPU, and its validation answers must feed their tensors to wherever the weights went. Before
    a model is loaded (or after `close`), the device the backend was asked for."""

    _device: torch.device
    model: Any

    @property
    def device(self) -> torch.device:
        model = getattr(self, "model", None)
        param = next(model.parameters(), None) if model is not None else None
        return param.device if param is not None else self._device

    @device.setter
    def device(self, value: torch.device) -> None:
        self._device = value


class HFLLM(_FollowsModelDevice, LLM):
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
        self.num_beams = _check_beams(num_beams)
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
            "prefix_allowed_tokens_fn": _json_prefix_function(self.tokenizer, json_schema, self._eos_ids)}
        outputs = [""] * len(prompts)
        for idx in self._batches([len(e) for e in encoded]):
            ids, mask = self._left_pad([encoded[i] for i in idx])
            try:
                gen = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                          **constrain)
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
        fed = [o[:-1] for o in option_ids]  # tokens fed after the prompt; the last one is only predicted
        tail = [t for f in fed for t in f]
        starts = np.cumsum([0] + [len(f) for f in fed])[:-1].tolist()  # where option k's fed tokens begin
        scores = [[0.0] * len(options) for _ in prompts]
        dtype = self.model.dtype
        for idx in self._batches([len(e) for e in prompt_ids]):
            width = max(len(prompt_ids[i]) for i in idx) + len(tail)
            ids = torch.full((len(idx), width), self._pad_id, dtype=torch.long)
            positions = torch.zeros((len(idx), width), dtype=torch.long)
            allowed = torch.zeros((len(idx), width, width), dtype=torch.bool)
            lengths = []
            for b, i in enumerate(idx):
                n = len(prompt_ids[i])
                pad = width - n - len(tail)  # left padding
                lengths.append(n)
                ids[b, pad:pad + n] = torch.tensor(prompt_ids[i], dtype=torch.long)
                ids[b, pad + n:] = torch.tensor(tail, dtype=torch.long)
                positions[b, pad:pad + n] = torch.arange(n)
                allowed[b, pad:pad + n, pad:pad + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
                for f, start in zip(fed, starts):
                    a = pad + n + start
                    positions[b, a:a + len(f)] = n + torch.arange(len(f))
                    allowed[b, a:a + len(f), pad:pad + n] = True
                    allowed[b, a:a + len(f), a:a + len(f)] = torch.tril(torch.ones(len(f), len(f), dtype=torch.bool))
                allowed[b, :pad, :pad] = torch.eye(pad, dtype=torch.bool)  # padding rows see themselves only
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            kwargs: dict[str, Any] = {"attention_mask": mask[:, None].to(self.device),
                                      "position_ids": positions.to(self.device), "use_cache": False}
            keep = len(tail) + 1  # the prompt's last position and the options' tokens: the only logits needed
            if self._keep_kw is not None:
                kwargs[self._keep_kw] = keep
            logits = self.model(input_ids=ids.to(self.device), **kwargs).logits[:, -keep:]
            logp = logits.float().log_softmax(-1)
            for b, i in enumerate(idx):
                last_prompt = 0  # index into the kept logits
                row = []
                for o, start in zip(option_ids, starts):
                    if not o:
                        row.append(0.0)
                        continue
                    total = logp[b, last_prompt, o[0]]
                    for j, token in enumerate(o[1:]):
                        total = total + logp[b, last_prompt + 1 + start + j, token]
                    row.append(float(total))
                scores[i] = row
        return scores

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def is_seq2seq_folder(path: str | os.PathLike) -> bool:
    """Whether a local model folder holds an encoder-decoder (FlanT5 family): read from its
    config.json."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("is_encoder_decoder", False))
    except (OSError, json.JSONDecodeError):
        return False


class HFSeq2SeqLLM(_FollowsModelDevice, LLM):
    """transformers encoder-decoder (FlanT5 family) behind the LLM interface: the prompt is the
    encoder input as written (no chat template), the answer the decoder's output; `score` sums the
    target tokens' log-probs."""

    backend = "hf"

    def __init__(self, model: str, batch_size: int = 8, device: str = "auto", dtype: str | torch.dtype = "auto",
                 cache_dir: str | os.PathLike | None = None, num_threads: int | None = None,
                 use_chat_template: bool = False, num_beams: int = 1) -> None:
        """`num_beams`: 1 = greedy (default); the ClusterRAG paper's FlanT5 generates with 4
        beams."""
        super().__init__(batch_size)
        self.num_beams = _check_beams(num_beams)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        self.source = resolve_model(model)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.source.path, local_files_only=True)
            self.model = AutoModelForSeq2SeqLM.from_pretrained(self.source.path, local_files_only=True,
                                                               **dtype_kw(self.dtype))
        except OSError as err:
            raise LLMBackendError(
                f"cannot load seq2seq model {model!r} from local files: {err}"
            ) from err
        self.model.to(self._device).eval()

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, batch_size: int = 8, name: str = "in-training",
                   **_: object) -> HFSeq2SeqLLM:
        self = cls.__new__(cls)
        LLM.__init__(self, batch_size)
        self.num_beams = 1
        self.source = ModelSource(name, "", "memory", "")
        self.model, self.tokenizer = model, tokenizer
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        return self

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def settings(self) -> dict[str, object]:
        beams = {"num_beams": self.num_beams} if self.num_beams != 1 else {}
        return {"dtype": str(self.dtype), "seq2seq": True, **beams}

    def _digest(self) -> str:
        return self.source.digest

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_pairs(
        self, prompts: list[str], targets: list[str]
    ) -> list[tuple[list[int], list[int]]]:
        """(encoder ids, decoder labels): the tokenizer's own special tokens on both (T5 ends each
        with </s>)."""
        self._check_pairs(prompts, targets)
        enc = self.tokenizer(list(prompts))["input_ids"]
        dec = self.tokenizer(list(targets))["input_ids"]
        return [(list(p), list(t)) for p, t in zip(enc, dec)]

    def _pad(self, rows: list[list[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), value, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        out = [""] * len(prompts)
        enc = [list(r) for r in self.tokenizer(list(prompts))["input_ids"]]
        pad = self.tokenizer.pad_token_id or 0
        for start in range(0, len(prompts), self.batch_size):
            idx = list(range(start, min(len(prompts), start + self.batch_size)))
            ids, mask = self._pad([enc[i] for i in idx], pad)
            gen = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      do_sample=False, num_beams=self.num_beams)
            for row, i in zip(gen, idx):
                out[i] = self.tokenizer.decode(row, skip_special_tokens=True).strip()
        return out

    @torch.inference_mode()
    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        self._check_pairs(prompts, targets)
        enc = [list(r) for r in self.tokenizer(list(prompts))["input_ids"]]
        dec = [
            list(r) for r in self.tokenizer(list(targets), add_special_tokens=False)["input_ids"]
        ]
        pad = self.tokenizer.pad_token_id or 0
        scores = [0.0] * len(prompts)
        for start in range(0, len(prompts), self.batch_size):
            idx = list(range(start, min(len(prompts), start + self.batch_size)))
            ids, mask = self._pad([enc[i] for i in idx], pad)
            labels, label_mask = self._pad([dec[i] for i in idx], pad)
            labels = labels.masked_fill(label_mask == 0, -100)
            logits = self.model(input_ids=ids, attention_mask=mask, labels=labels).logits
            logp = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
            for b, i in enumerate(idx):
                scores[i] = float((logp[b] * label_mask[b]).sum())
        return scores

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
