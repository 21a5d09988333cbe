"""The trained reader's question tower: the text encoder's top layers, fine-tuned on the question's
text, over the frozen lower layers' token states.

A reader that only probes frozen sentence vectors reads what the encoder's pooling kept of the text;
fine-tuning lets the question's words that carry the label (a review's "disappointed", "great
value") move its vector. The lower layers stay frozen, so their token states are computed once per
text (the reader's DataModule caches them) and a training step runs only the tuned layers: with one
tuned layer of MiniLM's six, a step costs about a sixth of a full fine-tune's. The tower starts as a
copy of the frozen encoder's layers, so an untrained tower gives exactly the frozen design's vector.

Only the question is tuned: a doc is read by many questions, so its vector stays the frozen
encoder's, computed once (tuning both would re-embed every doc at every step).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from persrag_lightning.models.text_encoder import TextEncoder, pool
from persrag_lightning.utils import ConfigError

__all__ = ["QuestionTower", "lower_states"]


def _layers(encoder: TextEncoder) -> nn.ModuleList:
    layers = getattr(getattr(encoder.model, "encoder", None), "layer", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise ConfigError(f"{type(encoder.model).__name__}: tune_layers needs a BERT-style encoder "
                     "(`model.encoder.layer`); keep tune_layers: 0 for this encoder")


def _attention_mask(config, states: torch.Tensor, mask: torch.Tensor):
    """The 2-D padding mask in the form the encoder's attention implementation reads."""
    try:
        from transformers.masking_utils import create_bidirectional_mask
    except ImportError:  # an older transformers: BERT's layers read an additive [B, 1, 1, T] mask
        return (1.0 - mask[:, None, None, :].to(states.dtype)) * torch.finfo(states.dtype).min
    return create_bidirectional_mask(config=config, inputs_embeds=states, attention_mask=mask)


def _run(layers: Sequence[nn.Module], config, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    attention = _attention_mask(config, states, mask)
    for layer in layers:
        out = layer(states, attention)
        states = out[0] if isinstance(out, tuple) else out  # older transformers return a tuple
    return states


def check_tune_layers(encoder: TextEncoder, n: int) -> int:
    """The number of the encoder's lower (frozen) layers below `n` tuned ones; refuses an `n` the
    encoder does not have."""
    total = len(_layers(encoder))
    if not 0 < n <= total:
        raise ConfigError(f"tune_layers: {n} of an encoder with {total} layers; use 1…{total} (0: frozen)")
    return total - n


@torch.inference_mode()
def lower_states(encoder: TextEncoder, texts: Sequence[str], n: int, batch_size: int = 64) -> list[torch.Tensor]:
    """Each text's token states under the encoder's frozen embeddings and lower layers (all but the
    top `n`), [tokens, width], padding dropped: what the tower reads. They are rounded to bfloat16,
    as the reader's DataModule stores them for training, so a served question reads the states its
    tower trained on."""
    lower = check_tune_layers(encoder, n)
    model, layers = encoder.model, _layers(encoder)
    model.eval()
    out: list[torch.Tensor] = [torch.empty(0)] * len(texts)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        tokens = encoder.tokenize([texts[i] for i in idx])
        states = model.embeddings(input_ids=tokens["input_ids"])
        states = _run(layers[:lower], model.config, states, tokens["attention_mask"])
        for row, i in enumerate(idx):
            out[i] = states[row, : int(tokens["attention_mask"][row].sum())].to(torch.bfloat16).float()
    return out


def pad_states(states: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token states of several texts as one padded batch [B, T, width] and its mask [B, T]."""
    longest = max((len(s) for s in states), default=1)
    width = states[0].shape[-1] if states else 1
    batch, mask = torch.zeros(len(states), longest, width), torch.zeros(len(states), longest, dtype=torch.long)
    for i, s in enumerate(states):
        batch[i, : len(s)], mask[i, : len(s)] = s, 1
    return batch, mask


class QuestionTower(nn.Module):
    """The encoder's top `n` layers (a trainable copy), its pooling and normalisation: lower token
    states → the question's vector."""

    def __init__(self, encoder: TextEncoder, n: int) -> None:
        super().__init__()
        check_tune_layers(encoder, n)
        self.layers = copy.deepcopy(_layers(encoder)[-n:]).train()  # fine-tuned with the encoder's dropout
        for p in self.layers.parameters():
            p.requires_grad_(True)
        self.config = encoder.model.config
        self.pooling, self.normalize = encoder.pooling, encoder.normalize

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T, width] lower states and their [B, T] mask → [B, width] question vectors."""
        hidden = _run(self.layers, self.config, states, mask)
        vector = pool(hidden, mask, self.pooling)
        return F.normalize(vector, dim=-1) if self.normalize else vector
