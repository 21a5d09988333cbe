"""The generator stage's model side (plain torch + transformers, no Lightning): which LoRA targets
an LLM has, the loss mask of a (prompt, target) pair, and the export of a tuned LLM as a plain
Hugging Face folder (LoRA merged, tokenizer included) that every backend loads without peft."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from persrag_lightning.models.common import merged_copy
from persrag_lightning.utils import atomic_directory, file_digest

__all__ = ["causal_lm_batch", "default_lora_targets", "export_generator", "seq2seq_batch",
           "target_token_loss"]

# what was tuned, how, and the weights' digest (part of the folder digest)
GENERATOR_META = "persrag_generator.json"
IGNORE_INDEX = -100  # label of a token that carries no loss (prompt and padding)

# LoRA targets by the projection names a model family uses (attention query and value, as the LoRA
# paper)
LORA_TARGETS: tuple[tuple[str, ...], ...] = (("q_proj", "v_proj"), ("q", "v"), ("query", "value"), ("c_attn",))


def default_lora_targets(model: nn.Module) -> tuple[str, ...]:
    """The attention query/value projections of a causal or seq2seq LLM (llama-style, T5,
    BERT-style, GPT-2)."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for targets in LORA_TARGETS:
        if set(targets) <= names:
            return targets
    raise ValueError(
        f"{type(model).__name__}: no known attention projections for LoRA; set lora_target_modules"
    )


def causal_lm_batch(
    pairs: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Left-padded [prompt; target] rows whose labels are the target tokens only (prompt and padding
    are IGNORE_INDEX), so the causal-LM loss is -log p(target | prompt), as the feedback and
    `choose` score it.

    Left padding (with explicit positions, as the hf backend scores) puts every target at the end,
    so the model computes logits for the last `logits_to_keep` positions only: a 49k-word vocabulary
    over 500-token prompts would otherwise cost ~100 MB of logits per example."""
    width = max(len(p) + len(t) for p, t in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (p, t) in enumerate(pairs):
        row = torch.tensor([*p, *t], dtype=torch.long)
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
        labels[i, width - len(t):] = torch.tensor(t, dtype=torch.long)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # the last prompt token predicts the first target token
    keep = max(len(t) for _, t in pairs) + 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels,
            "logits_to_keep": torch.tensor(keep)}


def seq2seq_batch(
    pairs: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Encoder inputs and decoder labels (the model shifts labels right itself); padding is
    IGNORE_INDEX."""
    enc_w = max(len(p) for p, _ in pairs)
    dec_w = max(len(t) for _, t in pairs)
    ids = torch.full((len(pairs), enc_w), pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), enc_w), dtype=torch.long)
    labels = torch.full((len(pairs), dec_w), IGNORE_INDEX, dtype=torch.long)
    for i, (p, t) in enumerate(pairs):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        mask[i, :len(p)] = 1
        labels[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def target_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the target tokens of a causal batch: position i predicts token i + 1.
    `logits` may cover only the last positions (logits_to_keep); they are aligned with the end of
    `labels`."""
    labels = labels[:, labels.shape[1] - logits.shape[1]:]
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    return nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                                       ignore_index=IGNORE_INDEX)


def export_generator(model: nn.Module, tokenizer, path: str | Path, meta: dict) -> Path:
    """Write the tuned LLM as a plain transformers folder: LoRA merged into a copy (training can go
    on), weights as safetensors, tokenizer and generation config beside them, and
    `persrag_generator.json` with the weights' digest, so a retrained generator under the same path
    never reuses another's cached answers. Atomic: a failed export keeps the previous folder
    whole."""
    path = Path(path)
    plain = merged_copy(model)
    with atomic_directory(path) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # transformers writes the weights 0600; an export is read by other users' jobs
        for f in tmp.iterdir():
            f.chmod(0o644)
        weights = sorted(tmp.glob("*.safetensors"))
        digest = {w.name: file_digest(w) for w in weights}
        (tmp / GENERATOR_META).write_text(
            json.dumps({**meta, "weights_sha256": digest}, indent=2, default=str) + "\n"
        )
    return path
