"""A cross-encoder whose first layers read the query and the doc apart, so that a doc's states up to
that layer are computed once per doc and reused by every query it meets (PreTTR: MacAvaney et al.,
"Efficient Document Re-Ranking for Transformers by Precomputing Term Representations", SIGIR 2020).
Not in CFRAG: an inference-cost option of the reranker (`split_layer`), trained like any reranker.

The pair is read in two parts. Below `split_layer` the query part `[CLS] q [SEP]` (token type 0) and
the doc part `d [SEP]` (token type 1) each attend to themselves only, each with positions from 0,
so a doc's states do not depend on the query. From `split_layer` up the two parts are concatenated
and read together as a cross-encoder reads a pair; the query part's [CLS] state is h_{q,d} of Eq. 9.
Training and inference run the same two passes: the doc-state cache (inference only) changes when a
doc's lower pass runs, never what it computes (tests/models/test_reranker_split.py).

BERT-style encoders only (`embeddings`, `encoder.layer`: BERT, MiniLM), as `keep_layers`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["DocStateCache", "SplitPairs", "check_split_layer", "last_layer_cls"]


def check_split_layer(encoder: nn.Module, split_layer: int | None) -> None:
    """Refuse a split the encoder cannot take: a BERT-style encoder with at least one layer above
    the split (the layers that read query and doc together)."""
    if split_layer is None:
        return
    layers = getattr(getattr(_base(encoder), "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"split_layer needs a BERT-style encoder (encoder.layer); {type(encoder).__name__} has none")
    if not 1 <= split_layer < len(layers):
        raise ValueError(f"split_layer must be in [1, {len(layers) - 1}] for this {len(layers)}-layer encoder "
                         f"(at least one layer reads query and doc together), got {split_layer}")


def last_layer_cls(layer: nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A BERT layer's output at [CLS] alone, [B, d]: the keys and values of every token, the query,
    the attention output and the feed-forward of the [CLS] token only, which is all the score reads
    of the last layer (the same numbers as the whole layer's row 0, for about a sixth of its work on
    the other tokens; tests/models/test_reranker_split.py).

    Args:
        layer: a BertLayer (`attention.self` with query/key/value, `attention.output`,
            `feed_forward_chunk`).
        hidden: its input, [B, W, d].
        mask: [B, W], 1 on the tokens to attend to.
    """
    attention = layer.attention.self
    size = attention.attention_head_size
    batch, width = hidden.shape[:2]
    cls = hidden[:, :1]
    query = attention.query(cls).view(batch, 1, -1, size).transpose(1, 2)
    key = attention.key(hidden).view(batch, width, -1, size).transpose(1, 2)
    value = attention.value(hidden).view(batch, width, -1, size).transpose(1, 2)
    context = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask[:, None, None, :].bool(), scale=attention.scaling,
        dropout_p=attention.dropout.p if attention.training else 0.0)
    out = layer.attention.output(context.transpose(1, 2).reshape(batch, 1, -1), cls)
    return layer.feed_forward_chunk(out)[:, 0]


def _base(encoder: nn.Module) -> nn.Module:
    """The transformers model under a LoRA wrapper (its layers carry the adapters in place)."""
    return encoder.get_base_model() if hasattr(encoder, "get_base_model") else encoder


class DocStateCache:
    """Doc text → its states at the split layer ([tokens, d], detached), least recently used first
    out once more than `max_tokens` doc tokens are held (at MiniLM's width, a million fp32 tokens
    take 1.5 GB). Inference only: a doc's states are those of the weights that computed them."""

    def __init__(self, max_tokens: int = 1_000_000) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0
        self._states: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def get(self, text: str) -> torch.Tensor | None:
        state = self._states.get(text)
        if state is not None:
            self._states.move_to_end(text)
        return state

    def discard(self, text: str) -> None:
        state = self._states.pop(text, None)
        if state is not None:
            self.tokens -= len(state)

    def put(self, text: str, state: torch.Tensor) -> None:
        if text in self._states:
            return
        self._states[text] = state
        self.tokens += len(state)
        while self.tokens > self.max_tokens and len(self._states) > 1:
            _, old = self._states.popitem(last=False)
            self.tokens -= len(old)


class SplitPairs:
    """The two passes of a split cross-encoder over (query, doc) pairs, on the modules of the
    encoder each call is given (the reranker's, whatever runtime replaced its layers): no parameters
    of its own.

    Args:
        tokenizer: its tokenizer (`cls_token_id`, `sep_token_id`).
        split_layer: layers below it read query and doc apart.
        max_query_length: query tokens kept; cut further so that a pair never exceeds `max_length`
            whatever its doc (a doc is never cut by its query: its states are the same for every
            query).
        max_doc_length: doc tokens kept.
        max_length: token limit of a pair, special tokens included.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, split_layer: int, max_query_length: int,
                 max_doc_length: int, max_length: int) -> None:
        self.tokenizer, self.split_layer = tokenizer, split_layer
        self.max_doc_length = max_doc_length
        self.max_query_length = min(max_query_length, max_length - max_doc_length - 3)
        if self.max_query_length < 1:
            raise ValueError(f"max_length {max_length} leaves no query token beside {max_doc_length} doc tokens")
        self.cache: DocStateCache | None = None

    def _ids(self, texts: Sequence[str], limit: int) -> list[list[int]]:
        return self.tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=limit)["input_ids"]

    def _lower(self, encoder: nn.Module, rows: list[list[int]], token_type: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings and the layers below the split over one part alone: ([B, W, d], mask [B, W])."""
        from transformers.masking_utils import create_bidirectional_mask

        model = _base(encoder)
        device = next(model.parameters()).device
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
        hidden = model.embeddings(input_ids=ids, token_type_ids=torch.full_like(ids, token_type),
                                  position_ids=torch.arange(width, device=device).expand_as(ids))
        attention = create_bidirectional_mask(config=model.config, inputs_embeds=hidden, attention_mask=mask)
        for layer in model.encoder.layer[:self.split_layer]:
            hidden = layer(hidden, attention)
        return hidden, mask

    def doc_states(self, encoder: nn.Module, docs: Sequence[str], batch_size: int) -> list[torch.Tensor]:
        """Each doc's `d [SEP]` states at the split layer, [tokens, d] (from the cache where held;
        the others `batch_size` at a time in order of length)."""
        held = {t: s for t in dict.fromkeys(docs) if self.cache is not None and (s := self.cache.get(t)) is not None}
        new = [t for t in dict.fromkeys(docs) if t not in held]
        sep = self.tokenizer.sep_token_id
        rows = sorted(zip(new, (r + [sep] for r in self._ids(new, self.max_doc_length))) if new else [],
                      key=lambda row: len(row[1]))
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            hidden, mask = self._lower(encoder, [ids for _, ids in chunk], 1)
            for (text, _), h, n in zip(chunk, hidden, mask.sum(1).tolist()):
                held[text] = h[:n]
                if self.cache is not None:
                    self.cache.put(text, h[:n].detach())
        return [held[t] for t in docs]

    def query_states(self, encoder: nn.Module, queries: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The `[CLS] q [SEP]` states at the split layer of each query: ([Q, W, d], mask [Q, W])."""
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        return self._lower(encoder, [[cls, *r, sep] for r in self._ids(queries, self.max_query_length)], 0)

    def cls(self, encoder: nn.Module, queries: Sequence[str], docs: Sequence[str], batch_size: int) -> torch.Tensor:
        """h_{q,d} (the query part's [CLS] state after the last layer) for P pairs, [P, d] in the
        input order: each distinct query's and doc's lower pass once, then the joint layers over
        chunks of `batch_size` pairs in order of doc length, the last at [CLS] alone."""
        from transformers.masking_utils import create_bidirectional_mask

        model = _base(encoder)
        unique = {q: i for i, q in enumerate(dict.fromkeys(queries))}
        q_hidden, q_mask = self.query_states(encoder, list(unique))
        q_row = torch.tensor([unique[q] for q in queries], device=q_hidden.device)
        d_states = self.doc_states(encoder, docs, batch_size)
        order = sorted(range(len(docs)), key=lambda i: len(d_states[i]))
        out = []
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            d_hidden = nn.utils.rnn.pad_sequence([d_states[i] for i in rows], batch_first=True)
            d_mask = torch.zeros(d_hidden.shape[:2], dtype=q_mask.dtype, device=q_mask.device)
            for j, i in enumerate(rows):
                d_mask[j, :len(d_states[i])] = 1
            index = q_row[rows]
            hidden = torch.cat([q_hidden[index], d_hidden.to(q_hidden.dtype)], dim=1)
            mask = torch.cat([q_mask[index], d_mask], dim=1)
            attention = create_bidirectional_mask(config=model.config, inputs_embeds=hidden, attention_mask=mask)
            *joint, last = model.encoder.layer[self.split_layer:]
            for layer in joint:
                hidden = layer(hidden, attention)
            out.append(last_layer_cls(last, hidden, mask))
        h = torch.cat(out)
        return h[torch.argsort(torch.tensor(order, device=h.device))]
