"""transformers encoder-decoder backend (FlanT5 family): the prompt is the encoder's input as
written, the answer the decoder's output."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from persrag_lightning.llm.base import LLM, LLMBackendError, ModelSource, resolve_model
from persrag_lightning.llm.gguf import dtype_kw
from persrag_lightning.llm.hf_device import FollowsModelDevice, check_beams, resolve_device_dtype

__all__ = ["HFSeq2SeqLLM", "is_seq2seq_folder"]


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


class HFSeq2SeqLLM(FollowsModelDevice, LLM):
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
        self.num_beams = check_beams(num_beams)
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
