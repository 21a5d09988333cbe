"""Model helpers the retriever and the reranker share (LoRA, config files, bundle file names), so neither model
module imports the other."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, fields
from pathlib import Path

from torch import nn

USER_HEADS = "user_heads.safetensors"


@dataclass
class LoraSettings:
    """LoRA on an encoder's attention projections; r = 0 turns it off (full fine-tuning)."""

    r: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("query", "value")


@dataclass
class LoraFields:
    """The LoRA part of a model config (flat fields, so YAML and config.json stay flat)."""

    lora_r: int = 0                       # 0 = full fine-tuning
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("query", "value")

    @property
    def lora(self) -> LoraSettings:
        return LoraSettings(self.lora_r, self.lora_alpha, self.lora_dropout, tuple(self.lora_target_modules))


def apply_lora(model: nn.Module, lora: LoraSettings) -> nn.Module:
    """Wrap a transformers model with peft adapters (base weights frozen); imported lazily, peft is slow to load."""
    if lora.r <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=list(lora.target_modules)))


def freeze_pooler(model: nn.Module) -> None:
    """BERT-style models compute a pooler output we never use; its weights get no gradient, which DDP rejects
    unless they are frozen (they are still saved, so the export stays a complete HF model)."""
    pooler = getattr(model, "pooler", None)
    if isinstance(pooler, nn.Module):
        pooler.requires_grad_(False)


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain transformers model to export: LoRA merged into a copy, so training can go on and serving needs no peft."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def config_from_json(cls: type, path: Path) -> object:
    """Read a config dataclass from config.json, ignoring unknown keys and turning JSON lists back into tuples."""
    if not path.exists():
        raise FileNotFoundError(f"{path.parent}: not an export of {cls.__name__.removesuffix('Config')} "
                                f"(no config.json)")
    raw = json.loads(path.read_text())
    known = {f.name for f in fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known}
    return cls(**values)
