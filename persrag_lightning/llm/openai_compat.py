"""OpenAI-compatible HTTP backend (vLLM, llama.cpp server, TGI) over plain urllib, with a thread
pool."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from persrag_lightning.llm.base import LLM, LLMBackendError, resolve_model

__all__ = ["OpenAICompatLLM"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


class OpenAICompatLLM(LLM):
    """Sends each prompt as one chat request (temperature 0); `batch_size` requests are in flight at
    once."""

    backend = "openai"

    def __init__(self, model: str = "smollm2", base_url: str | None = None, batch_size: int = 8,
                 api_key: str | None = None, timeout: float = 600.0, served_model: str | None = None,
                 tokenizer: str | None = None, cache_dir: str | os.PathLike | None = None,
                 score_max_tokens: int = 1, seed: int | None = 0) -> None:
        """`model` names the weights (for the chat template used by `score` and the token budget);
        `served_model` is the name sent to the server (default: `model`, or the server's only model
        for aliases)."""
        super().__init__(batch_size)
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).rstrip(
            "/"
        )
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout = timeout
        self._served_model = served_model
        # the fingerprint uses what was asked for, not what was found
        self._served_model_arg = served_model
        self._tokenizer_name = tokenizer
        self._cache_dir = cache_dir
        self._tokenizer: Any = None
        # llama.cpp's server reads max_tokens=0 as "until n_ctx"
        self.score_max_tokens = score_max_tokens
        self.seed = seed

    # -- HTTP --------------------------------------------------------------------------------------
    def _request(self, path: str, payload: dict | None = None) -> dict:
        url = f"{self.base_url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            url, data=data, headers=headers, method="GET" if data is None else "POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as err:
            body = err.read().decode(errors="replace")[:500]
            raise LLMBackendError(f"{url} answered HTTP {err.code}: {body}") from err
        except urllib.error.URLError as err:
            raise LLMBackendError(
                f"cannot reach the OpenAI-compatible server at {url}: {err.reason}"
            ) from err
        except (TimeoutError, ConnectionError, OSError) as err:
            raise LLMBackendError(f"request to {url} failed: {err}") from err
        except json.JSONDecodeError as err:
            raise LLMBackendError(f"{url} answered with invalid JSON: {err}") from err

    def list_models(self) -> list[str]:
        """Model ids the server serves (`GET /models`)."""
        return [m["id"] for m in self._request("/models").get("data", [])]

    @property
    def served_model(self) -> str:
        """Name sent in requests: explicit, else the server's single model when `model` is a local
        alias/path."""
        if self._served_model is None:
            served = (
                self.list_models() if "/" not in self.model or os.path.exists(self.model) else []
            )
            self._served_model = served[0] if len(served) == 1 else self.model
        return self._served_model

    def _map(self, fn: Any, items: list[Any]) -> list[Any]:
        if len(items) <= 1 or self.batch_size == 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(max_workers=min(self.batch_size, len(items))) as pool:
            return list(pool.map(fn, items))

    # -- interface ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.model

    @property
    def settings(self) -> dict[str, object]:
        # The URL is where, not what: the same weights behind another host keep the same
        # fingerprint.
        return {"served_model": self._served_model_arg}

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        model = self.served_model

        def one(prompt: str) -> str:
            payload: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                                       "temperature": 0.0, "max_tokens": max_new_tokens}
            if self.seed is not None:
                payload["seed"] = self.seed
            out = self._request("/chat/completions", payload)
            try:
                return (out["choices"][0]["message"]["content"] or "").strip()
            except (KeyError, IndexError, TypeError) as err:
                raise LLMBackendError(
                    f"{self.base_url}/chat/completions: unexpected answer {str(out)[:300]}"
                ) from err

        return self._map(one, prompts)

    @property
    def tokenizer(self) -> Any:
        """Local tokenizer of `model` (or `tokenizer`): the chat template for `score`, exact counts
        for budgets."""
        if self._tokenizer is None:
            from persrag_lightning.llm.gguf import load_tokenizer

            self._tokenizer = load_tokenizer(
                resolve_model(self._tokenizer_name or self.model), self._cache_dir
            )
        return self._tokenizer

    def count_tokens(self, text: str) -> int:
        try:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except LLMBackendError:
            return super().count_tokens(text)

    def chat_text(self, prompt: str) -> str:
        """The chat-formatted prompt, as the server would build it for a chat request."""
        try:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        except LLMBackendError as err:
            raise NotImplementedError(
                f"openai backend: score() needs the chat template of {self.model!r} locally (pass tokenizer=...): "
                f"{err}") from err

    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        self._check_pairs(prompts, targets)
        model = self.served_model
        # Templates and token counts are computed here, once, not in the worker threads.
        texts = [self.chat_text(p) for p in prompts]
        n_target = [self._n_new_tokens(t, g) for t, g in zip(texts, targets)]

        def one(i: int) -> float:
            text, target = texts[i], targets[i]
            if not target:
                return 0.0
            payload = {"model": model, "prompt": text + target, "echo": True, "logprobs": 1,
                       "max_tokens": self.score_max_tokens, "temperature": 0.0}
            try:
                out = self._request("/completions", payload)
            except LLMBackendError as err:
                raise NotImplementedError(
                    f"{self.base_url}/completions does not support echo=True with logprobs, which score() "
                    f"needs: {err}") from err
            return _target_logprob(out, text, target, n_target[i], self.base_url)

        return self._map(one, list(range(len(prompts))))

    def _n_new_tokens(self, text: str, target: str) -> int:
        """How many tokens `target` adds after the chat-formatted prompt (local tokenizer)."""
        if not target:
            return 0
        count = self.tokenizer
        return (len(count(text + target, add_special_tokens=False)["input_ids"])
                - len(count(text, add_special_tokens=False)["input_ids"]))


def _target_logprob(out: dict, text: str, target: str, n_target: int, base_url: str) -> float:
    """Sum of the echoed logprobs of the target, located by character offsets when they index the
    prompt we sent (OpenAI, vLLM), else as the last `n_target` echoed prompt tokens (llama.cpp drops
    special tokens)."""
    try:
        choice = out["choices"][0]
        lp = choice["logprobs"]
        tokens, logprobs, offsets = lp["tokens"], lp["token_logprobs"], lp["text_offset"]
    except (KeyError, IndexError, TypeError) as err:
        raise NotImplementedError(
            f"{base_url}/completions returned no echoed logprobs, which score() needs"
        ) from err
    start, end = len(text), len(text) + len(target)
    picked: list[float | None]
    if offsets and "".join(tokens) == choice.get("text") and choice["text"].startswith(text + target):
        picked = []
        for i, (tok, off) in enumerate(zip(tokens, offsets)):
            tok_end = offsets[i + 1] if i + 1 < len(offsets) else off + len(tok)
            if off < end and tok_end > start:
                picked.append(logprobs[i])
    else:
        generated = int(out.get("usage", {}).get("completion_tokens", 0))
        echoed = logprobs[: len(logprobs) - generated]
        picked = echoed[len(echoed) - n_target:] if 0 < n_target <= len(echoed) else []
    if not picked or any(v is None for v in picked):
        raise NotImplementedError(
            f"{base_url}/completions gave no usable logprobs for the target tokens"
        )
    return float(sum(picked))  # type: ignore[arg-type]
