"""Model helpers the retriever and the reranker share (LoRA, config files, bundle file names), so
neither model module imports the other."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

__all__ = ["ROWS_PER_FORWARD_BY_DEVICE", "USER_HEADS", "LoraFields", "LoraSettings", "apply_lora",
           "config_from_json", "encode_by_length", "freeze_pooler", "merged_copy"]

USER_HEADS = "user_heads.safetensors"

# Texts (retriever) or (query, doc) pairs (reranker) per encoder forward, taken in order of token
# length. On a CPU, chunks by length measured faster than one forward of every pair and than chunks in
# candidate order: large activations cost more than the extra calls, and less padding does the rest.
# On a GPU the opposite holds: a small chunk leaves it waiting on kernel launches, so CUDA takes
# larger chunks (the measurements: docs/performance/training.md). A device type missing here takes
# the CPU's.
ROWS_PER_FORWARD = 32
ROWS_PER_FORWARD_BY_DEVICE: dict[str, int] = {"cpu": ROWS_PER_FORWARD, "cuda": 256}


def rows_per_forward(device: torch.device | str) -> int:
    """Rows per encoder forward in `encode_by_length` on `device` (ROWS_PER_FORWARD_BY_DEVICE)."""
    return ROWS_PER_FORWARD_BY_DEVICE.get(torch.device(device).type, ROWS_PER_FORWARD)


def encode_by_length(inputs: dict[str, torch.Tensor], encode: Callable[[torch.Tensor, dict], torch.Tensor],
                     device: torch.device, step: int | None = None) -> torch.Tensor:
    """`encode(rows, chunk)` over chunks of `step` (default `rows_per_forward(device)`) right-padded
    rows of `inputs` in order of length, each chunk cut to its longest row; the results concatenated
    back in input order. Differentiable."""
    lengths = inputs["attention_mask"].sum(1)
    order = torch.argsort(lengths, stable=True)
    step = step or rows_per_forward(device)
    out = []
    for start in range(0, len(order), step):
        rows = order[start:start + step]
        width = int(lengths[rows].max())
        out.append(
            encode(rows, {k: v[rows, :width].contiguous().to(device) for k, v in inputs.items()})
        )
    return torch.cat(out)[torch.argsort(order).to(out[0].device)]


@dataclass
class LoraSettings:
    """LoRA on an encoder's attention projections; r = 0 turns it off (full fine-tuning)."""

    r: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("query", "value")


@dataclass
class LoraFields:
    """The LoRA part of a model config (flat fields, so YAML and config.json stay flat).

    Args:
        lora_r: LoRA rank (peft); 0 = full fine-tuning.
        lora_alpha: LoRA scaling α.
        lora_dropout: dropout on the LoRA path.
        lora_target_modules: the encoder's modules LoRA adapts (BERT's attention query and value).
    """

    lora_r: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("query", "value")

    @property
    def lora(self) -> LoraSettings:
        return LoraSettings(
            self.lora_r, self.lora_alpha, self.lora_dropout, tuple(self.lora_target_modules)
        )


def apply_lora(model: nn.Module, lora: LoraSettings) -> nn.Module:
    """Wrap a transformers model with peft adapters (base weights frozen); imported lazily, peft is
    slow to load."""
    if lora.r <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=list(lora.target_modules)))


def freeze_pooler(model: nn.Module) -> None:
    """BERT-style models compute a pooler output we never use; its weights get no gradient, which
    DDP rejects unless they are frozen (they are still saved, so the export stays a complete HF
    model)."""
    pooler = getattr(model, "pooler", None)
    if isinstance(pooler, nn.Module):
        pooler.requires_grad_(False)


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain transformers model to export: LoRA merged into a copy, so training can go on and
    serving needs no peft."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def config_from_json(cls: type, path: Path) -> object:
    """Read a config dataclass from config.json, ignoring unknown keys and turning JSON lists back
    into tuples."""
    if not path.exists():
        raise FileNotFoundError(
            f"{path.parent}: not an export of {cls.__name__.removesuffix('Config')} "
            f"(no config.json)"
        )
    raw = json.loads(path.read_text())
    known = {f.name for f in fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known}
    return cls(**values)
