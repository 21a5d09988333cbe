"""CFRAG user encoder (§4.1.1, Eq. 1) as a plain torch module that saves and loads itself without
Lightning."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from persrag_lightning.data.histories import FIRST_DOC_ID, MASK_ID, PAD_ID
from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import get_task
from persrag_lightning.index import IndexKind, build_index, load_index, save_index, search
from persrag_lightning.utils import atomic_save_tensors, atomic_write_json

__all__ = ["Judgments", "UserEncoder", "UserEncoderConfig", "UserEncoderSettings",
           "judgment_labels", "judgments_train"]

Judgments = Literal["none", "label", "paired", "profile"]


@dataclass
class UserEncoderSettings:
    """What a stage config sets of the user encoder (`model.init_args.config`): the official code's
    shapes, 1 layer, 2 heads, feed-forward = d, dropout 0.1.

    Args:
        num_layers: transformer layers over a user's history (1, as the official code).
        num_heads: attention heads per layer (2, as the official code).
        ffn_dim: feed-forward width; None = d, as the official code.
        dropout: dropout inside the transformer.
        judgments: beyond the paper: `label` adds a learned embedding of each history doc's judgment
            (the task's label field: LaMP-2 tag, LaMP-3 score) to its doc vector (a sum:
            docs/methods/judgments.md says why); `paired` adds as well a label-specific linear map
            of the doc vector, so *which* doc got *which* judgment survives mean pooling; `profile`
            keeps only that pairing and trains nothing: the user is the mean of A_l d over their
            docs (per label, the mean doc of that label in its own random subspace), read by no
            transformer; `none` is the paper's text-only encoder.
    """

    num_layers: int = 1
    num_heads: int = 2
    ffn_dim: int | None = None
    dropout: float = 0.1
    judgments: Judgments = "none"


@dataclass(kw_only=True)
class UserEncoderConfig(UserEncoderSettings):
    """A user encoder's whole configuration, as its export's config.json holds it: the settings and
    what the data decides (the doc table, the history length, the frozen text encoder, the task).

    Args:
        dim: width d of the doc vectors and of the user embedding (the text encoder's).
        num_docs: rows of the doc-embedding table (the corpus).
        max_history: positions: a user's most recent docs the encoder reads (100, the official
            code's).
        text_encoder: the frozen text encoder that embedded the docs (serving embeds new docs with
            it).
        text_max_length: its token limit per doc.
        text_pooling: how its token states became a doc vector (`mean` or `cls`).
        task: the task whose label field and labels `judgments: label|paired` embeds.
    """

    dim: int
    num_docs: int
    max_history: int = 100
    text_encoder: str = "minilm"
    text_max_length: int = 256
    text_pooling: str = "mean"
    task: str | None = None


def judgments_train(judgments: str) -> bool:
    """Whether a stage 1 of these judgments trains: every kind but `profile`, a fixed function of
    the judged docs."""
    return judgments != "profile"


def judgment_labels(task: str | None) -> tuple[str, ...]:
    """The labels a `judgments: label` encoder embeds for `task`; a ValueError naming the task where
    its history docs carry no judgment (LaMP-1's profile holds the user's papers, not their citation
    choices; LaMP-4/5/7)."""
    if task is None:
        raise ValueError(
            "judgments: label needs the task whose labels it embeds (UserEncoderConfig.task)"
        )
    spec = get_task(task)
    if spec.label_field is None or spec.labels is None:
        raise ValueError(
            f"judgments: label needs a task whose history docs carry the user's judgment (LaMP-2's "
            f"tag, LaMP-3's score); {spec.name}'s profile items have no label field"
        )
    return spec.labels


class UserEncoder(nn.Module):
    """e_u = MEAN(Trm(E_u + P)) over a user's most recent docs; rows 0/1 of the doc table are
    [pad]/[mask]."""

    def __init__(self, config: UserEncoderConfig, doc_embeddings: torch.Tensor | None = None,
                 mask_embedding: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        self.doc_table = nn.Embedding(config.num_docs + FIRST_DOC_ID, d, padding_idx=PAD_ID)
        self.positions = nn.Parameter(torch.empty(config.max_history, d))
        nn.init.xavier_normal_(self.positions)
        layer = nn.TransformerEncoderLayer(d, config.num_heads, config.ffn_dim or d, config.dropout,
                                           batch_first=True)
        self.transformer = nn.TransformerEncoder(
            layer, config.num_layers, enable_nested_tensor=False
        )
        self._add_judgment_tables(config)
        if doc_embeddings is not None:
            self.load_doc_embeddings(doc_embeddings, mask_embedding)
        # serving state, filled by `index_users` or `from_pretrained`
        self.user_ids: list[str] = []
        self.user_embeddings: torch.Tensor | None = None
        self._index = None

    def _add_judgment_tables(self, config: UserEncoderConfig) -> None:
        """The tables by which a doc's judgment (LaMP-2's tag, LaMP-3's score) enters its vector:
        `label` adds a label row, `paired` also a d × d map per label; `profile` reads only those
        maps (its label rows go unused: one table layout for every judged encoder); none for
        `none`."""
        d = config.dim
        if config.judgments in ("label", "paired", "profile"):
            # Judgments enter by a *sum*, label vector + doc vector, not concat + projection: the
            # transformer keeps width d and the doc table keeps the frozen encoder's space (a
            # projection in front would re-mix the MiniLM rows with the labels, so the paper's
            # encoder would no longer be the special case of zero label rows); the [mask] and [pad]
            # ids carry label 0, a fixed zero row, so a masked doc hides its judgment as well as its
            # text and crop/mask/reorder stay unchanged. Rows start at the doc rows' scale (N(0,
            # 1/d), norm ≈ 1), not at zero: instance discrimination can be solved from the
            # fine-tuned doc rows alone, so zero label rows would get little reason to grow.
            labels = judgment_labels(config.task)
            self.label_table = nn.Embedding(len(labels) + 1, d, padding_idx=0)
            nn.init.normal_(self.label_table.weight, std=d ** -0.5)
            with torch.no_grad():
                self.label_table.weight[0].zero_()
            # doc-table id -> label id (0 = none); saved with the weights, so an export embeds the
            # same judgments
            self.register_buffer(
                "doc_labels", torch.zeros(config.num_docs + FIRST_DOC_ID, dtype=torch.long)
            )
        if config.judgments in ("paired", "profile"):
            # `paired`: x = d + g_l + A_l d, a d × d map per label (row 0 unused: label 0 — none,
            # [mask], [pad] — keeps d; `profile` averages A_l d alone, the maps as drawn here). A
            # sum alone, averaged by MEAN pooling, keeps the mean text and the label histogram but
            # not which doc got which label: users rating categories (a, b) as (5, 1) and (1, 5) get
            # the same sum. A_l d puts each label's docs in their own
            # random subspace (N(0, 1/d) entries: norm-preserving, near-orthogonal across labels),
            # so the pooled vector holds a mean doc vector per label, the pairing the untrained
            # diagnostic (doc vector ⊗ label one-hot) showed to expose the communities. Not concat +
            # projection: that is linear in (doc, label) and loses the pairing in the mean as the
            # sum does.
            self.label_maps = nn.Parameter(torch.randn(len(labels) + 1, d, d) * d ** -0.5)
        elif config.judgments not in ("none", "label"):
            raise ValueError(
                f"judgments must be 'none', 'label', 'paired' or 'profile', got {config.judgments!r}"
            )

    @torch.no_grad()
    def load_doc_embeddings(
        self, doc_embeddings: torch.Tensor, mask_embedding: torch.Tensor | None = None
    ) -> None:
        """Initialise the doc table from the frozen encoder's vectors; pad row zero; the [mask] row
        is the normalised embedding of the text "<mask>" as in the official code (given by the
        caller, who has the text encoder), else it keeps nn.Embedding's N(0, 1) init — norm ≈ √d,
        far from the doc rows' 1."""
        if doc_embeddings.shape != (self.config.num_docs, self.config.dim):
            raise ValueError(f"doc embeddings {tuple(doc_embeddings.shape)} do not match "
                             f"({self.config.num_docs}, {self.config.dim})")
        self.doc_table.weight[PAD_ID].zero_()
        self.doc_table.weight[FIRST_DOC_ID:] = doc_embeddings.to(self.doc_table.weight)
        if mask_embedding is not None:
            self.doc_table.weight[MASK_ID] = F.normalize(
                mask_embedding.reshape(-1).float(), dim=0
            ).to(self.doc_table.weight)

    @property
    def uses_judgments(self) -> bool:
        return self.config.judgments != "none"

    @property
    def trains(self) -> bool:
        """False for `judgments: profile`, whose user is a fixed function of their judged docs."""
        return judgments_train(self.config.judgments)

    def doc_label_ids(self, docs: Sequence[HistoryDoc]) -> torch.Tensor:
        """Label ids (0 = none) of history docs as this encoder embeds them; a ValueError on a
        text-only encoder."""
        if not self.uses_judgments:
            raise ValueError(
                "this user encoder was trained with judgments: none; it embeds no labels"
            )
        spec = get_task(self.config.task or "")
        return torch.tensor([spec.doc_label(d) for d in docs], dtype=torch.long)

    @torch.no_grad()
    def set_doc_labels(self, label_ids: torch.Tensor) -> None:
        """The judgment of every corpus row (label ids, 0 = none), in corpus order."""
        if not self.uses_judgments:
            raise ValueError(
                "this user encoder was trained with judgments: none; it embeds no labels"
            )
        if label_ids.shape != (self.config.num_docs,):
            raise ValueError(
                f"doc labels {tuple(label_ids.shape)} do not match ({self.config.num_docs},)"
            )
        self.doc_labels.zero_()
        self.doc_labels[FIRST_DOC_ID:] = label_ids.to(self.doc_labels)

    def encode_embeddings(self, doc_vectors: torch.Tensor, pad_mask: torch.Tensor,
                          labels: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 1 on given doc vectors [B, L, d] with pad_mask True at padding: masked mean of Trm(E
        + P). `labels` [B, L] (label ids, 0 = none): the docs' judgments, required by and only by a
        `judgments: label` or `paired` encoder (serving's new users, whose docs are not in the doc
        table)."""
        if self.uses_judgments and labels is None:
            raise ValueError(
                f"this user encoder was trained with judgments: {self.config.judgments}; pass the "
                "docs' label ids (doc_label_ids)"
            )
        if not self.uses_judgments and labels is not None:
            raise ValueError(
                "this user encoder was trained with judgments: none; it embeds no labels"
            )
        keep = (~pad_mask).unsqueeze(-1).to(doc_vectors.dtype)
        if not self.trains:
            # `profile`: the mean of A_l d alone, over the non-pad docs (a [mask] or unlabelled doc
            # adds zero and still counts, as a doc the user has)
            return (self.label_mapped(doc_vectors, labels) * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        if labels is not None:
            doc_vectors = self.judged_inputs(doc_vectors, labels)
        length = doc_vectors.shape[1]
        if length > self.config.max_history:
            raise ValueError(
                f"history length {length} exceeds max_history {self.config.max_history}"
            )
        hidden = self.transformer(
            doc_vectors + self.positions[:length], src_key_padding_mask=pad_mask
        )
        # Eq. 1: MEAN over non-pad positions
        return (hidden * keep.to(hidden.dtype)).sum(1) / keep.sum(1).clamp(min=1.0)

    def judged_inputs(self, doc_vectors: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The transformer's input per doc: d + g_l (`label`), d + g_l + A_l d (`paired`); label 0
        (none, [mask], [pad]) leaves d unchanged. A_l d is one matmul per label present, not a [B,
        L, d, d] gather."""
        labels = labels.to(doc_vectors.device)
        judged = doc_vectors + self.label_table(labels)
        if self.config.judgments == "paired":
            judged = judged + self.label_mapped(doc_vectors, labels)
        return judged

    def label_mapped(self, doc_vectors: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A_l d per doc (zero for label 0: none, [mask], [pad]): one matmul per label present."""
        labels = labels.to(doc_vectors.device)
        mapped = torch.zeros_like(doc_vectors)
        for label in labels.unique().tolist():
            if label:
                rows = labels == label
                # under autocast the matmul computes in bf16; the sum stays in the input's dtype
                mapped[rows] = (doc_vectors[rows] @ self.label_maps[label].to(doc_vectors.dtype)).to(mapped.dtype)
        return mapped

    def forward(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """Users from doc-table ids [B, L] (0 = pad, 1 = mask, r + 2 = corpus row r), oldest
        first."""
        labels = self.doc_labels[doc_ids] if self.uses_judgments else None
        return self.encode_embeddings(self.doc_table(doc_ids), doc_ids == PAD_ID, labels)

    # ---- serving ---------------------------------------------------------------------------------

    def index_users(
        self, user_ids: list[str], embeddings: torch.Tensor, kind: IndexKind = "auto"
    ) -> None:
        """Attach the user table and a cosine index so `similar_users` works; saved as users.faiss,
        which serving and evaluation load instead of rebuilding ("auto": exact up to
        index.AUTO_EXACT_MAX_USERS, HNSW above)."""
        self.user_ids = list(user_ids)
        self.user_embeddings = embeddings.detach().float().cpu()
        self._row = {u: i for i, u in enumerate(self.user_ids)}
        self._index = build_index(self.user_embeddings.numpy(), kind)

    def similar_users(self, user_id: str, m: int) -> list[tuple[str, float]]:
        """Top-m users by cosine to `user_id`'s embedding; the user itself is kept, as the official
        code does."""
        if self._index is None or self.user_embeddings is None:
            raise RuntimeError(
                "no user table attached: export with user embeddings or call index_users"
            )
        if user_id not in self._row:
            raise KeyError(f"unknown user {user_id!r}")
        scores, ids = search(self._index, self.user_embeddings[self._row[user_id]].numpy(), m)
        return [(self.user_ids[i], float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def save_pretrained(self, path: str | Path) -> Path:
        """config.json, model.safetensors, and (if attached) user_ids.json,
        user_embeddings.safetensors, index."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        atomic_save_tensors(
            {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()},
            path / "model.safetensors",
        )
        if self.user_embeddings is not None:
            atomic_save_tensors({"embeddings": self.user_embeddings.contiguous()}, path / "user_embeddings.safetensors")
            atomic_write_json(path / "user_ids.json", self.user_ids)
            save_index(self._index, path / "users.faiss")
        atomic_write_json(path / "config.json", asdict(self.config))
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, map_location: str = "cpu") -> UserEncoder:
        path = Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path}: not a user-encoder export (no config.json); "
                "train one with `python train.py fit --config cfrag_user_encoder.yaml`"
            )
        model = cls(UserEncoderConfig(**json.loads((path / "config.json").read_text())))
        model.load_state_dict(load_file(str(path / "model.safetensors"), device=map_location))
        model.eval()
        if (path / "user_embeddings.safetensors").exists():
            model.user_ids = json.loads((path / "user_ids.json").read_text())
            model.user_embeddings = load_file(str(path / "user_embeddings.safetensors"))[
                "embeddings"
            ]
            model._row = {u: i for i, u in enumerate(model.user_ids)}
            model._index = load_index(path / "users.faiss")
        return model
