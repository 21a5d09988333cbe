"""Dense first-stage retrieval over the whole corpus with cached doc vectors, in two named kinds:
`EncoderRetriever` (an untuned sentence encoder, Eq. 3) and `TrainedRetriever` (a stage-2 export,
Eq. 5). `open_corpus_retriever(spec)` picks the kind from what `spec` names. Used to propose
feedback candidates, by the CFRAG strategy and by the dense baseline."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.models import exported
from persrag_lightning.models.corpus_embeddings import (
    build_corpus_embeddings,
    embedding_precision,
    load_corpus_embeddings,
    precision_autocast,
)
from persrag_lightning.models.exported import EXPORTED_RUNTIMES
from persrag_lightning.models.retriever import USER_HEADS, PersonalizedRetriever, doc_encoder_path
from persrag_lightning.models.text_encoder import EMBEDDED_MODELS, TextEncoder, model_identity
from persrag_lightning.utils import bundle_digest, fingerprint

__all__ = ["QUERY_RUNTIMES", "CorpusRetriever", "EncoderRetriever", "open_corpus_retriever"]

# How the query encoder runs at serving (retrieval/cfrag.py's `query_runtime`; docs are embedded as
# models/corpus_embeddings.py's `embedding_precision` says: bf16 on a CPU that computes it natively,
# else fp32): torch fp32 as trained, torch's bf16 autocast, or its ONNX export in ONNX Runtime or
# OpenVINO (models/exported.py).
QUERY_RUNTIMES = ("fp32", "bf16", *EXPORTED_RUNTIMES)


class CorpusRetriever(ABC):
    """Scores a user's corpus rows for a query vector; doc vectors come from the shared
    corpus-embedding cache."""

    def __init__(self, spec: str, corpus: Corpus, cache_dir: str | Path, doc_encoder: str, max_length: int,
                 pooling: str) -> None:
        self.spec, self.corpus, self.cache_dir = spec, corpus, cache_dir
        self.doc_encoder, self.max_length, self.pooling = doc_encoder, max_length, pooling
        self.model = None
        self.doc_vectors: torch.Tensor | None = None
        self.query_runtime = "fp32"
        self._query_session: exported.Session | None = None

    @abstractmethod
    def identity(self) -> dict:
        """What changes the scores (for cache fingerprints)."""

    @abstractmethod
    def _load_model(self):
        """The query encoder (and user head, for a trained retriever)."""

    @abstractmethod
    def query_encoder(self) -> TextEncoder:
        """The loaded model's query encoder."""

    @abstractmethod
    def scorer(self, query: torch.Tensor, e_u: torch.Tensor | None) -> Callable[[np.ndarray], torch.Tensor]:
        """corpus rows → their scores for one query vector (e_u: the query user's embedding, if
        used), the query's side computed once for the several users' rows it scores."""

    def score(self, query: torch.Tensor, rows: np.ndarray, e_u: torch.Tensor | None) -> torch.Tensor:
        """Scores of corpus `rows` for one query vector (`scorer`'s)."""
        return self.scorer(query, e_u)(rows)

    @abstractmethod
    def encode_docs(self, texts: list[str]) -> torch.Tensor:
        """Doc vectors of new texts, as the cache holds them."""

    def use_query_runtime(self, runtime: str, cache_dir: str | Path | None = None) -> None:
        """Embed queries in `runtime` (QUERY_RUNTIMES) from now on; an exported runtime reads the
        query encoder's ONNX export under `cache_dir` (made once per encoder content; a temp file
        without one)."""
        if runtime not in QUERY_RUNTIMES:
            raise ValueError(
                f"query runtime must be one of {', '.join(QUERY_RUNTIMES)}, got {runtime!r}"
            )
        self.load()
        self._query_session = None
        if runtime in EXPORTED_RUNTIMES:
            self._query_session = self.query_encoder().exported_session(
                runtime, cache_dir, "query", fingerprint(self.identity()))
        self.query_runtime = runtime

    def warm_query_shapes(self) -> int:
        """Compile the query encoder's static shapes of one query at every width up to its
        max_length and its model for batches of queries now (OpenVINO: models/exported.py's
        StaticShapes), so that a served query never waits for a compile; returns how many models
        (0 in another runtime)."""
        session, encoder = self._query_session, self.query_encoder()
        if not isinstance(session, exported.StaticShapes):
            return 0
        widest = -(-encoder.max_length // session.width_step) * session.width_step
        # never wider than the model's positions (a model shorter than its truncation length)
        positions = getattr(getattr(encoder.model, "config", None), "max_position_embeddings", None) or widest
        return session.warm(min(widest, positions // session.width_step * session.width_step))

    @torch.no_grad()
    def query_vectors(self, queries: list[str]) -> torch.Tensor:
        """[n, d] query vectors (float32) in the query runtime."""
        self.load()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.query_runtime == "bf16"):
            return self.query_encoder().encode(queries, session=self._query_session)

    def tuned_user_embedding(self, user_id: str, e_u: torch.Tensor) -> torch.Tensor:
        """e_u for this retriever's user term: the stage-1 embedding, unless the retriever tuned its
        own."""
        return e_u

    def _embedding_args(self) -> dict:
        return {"encoder": self.doc_encoder, "max_length": self.max_length, "pooling": self.pooling}

    def prepare(self) -> None:
        """Embed the corpus with the doc encoder (cached, shared with stage 1 when it is the same
        encoder)."""
        build_corpus_embeddings(self.corpus, self.cache_dir, **self._embedding_args())

    def load(self) -> None:
        if self.doc_vectors is not None:
            return
        self.doc_vectors = load_corpus_embeddings(
            self.cache_dir, self.corpus, **self._embedding_args()
        )
        self.model = self._load_model()

    @torch.no_grad()
    def add_docs(self, texts: list[str]) -> None:
        """Embed new docs (a user added at serving time) and append them as the next corpus rows, in
        the precision this machine embeds the corpus in (`embedding_precision`)."""
        self.load()
        with precision_autocast(embedding_precision()):
            vectors = self.encode_docs(texts)
        self.doc_vectors = torch.cat([self.doc_vectors, vectors.float().to(self.doc_vectors)])


class EncoderRetriever(CorpusRetriever):
    """The untuned encoder, cos(E(q), E(d)) (Eq. 3): the retriever stage's candidate proposer and
    the dense baseline. `spec` is an embedded alias, a model folder or a Hugging Face name."""

    def __init__(self, spec: str, corpus: Corpus, cache_dir: str | Path, max_length: int = 256,
                 pooling: str = "mean") -> None:
        super().__init__(spec, corpus, cache_dir, spec, max_length, pooling)

    def identity(self) -> dict:
        return {"encoder": model_identity(self.spec), "max_length": self.max_length, "pooling": self.pooling}

    def _load_model(self) -> TextEncoder:
        return TextEncoder.from_pretrained(
            self.spec, pooling=self.pooling, max_length=self.max_length
        )

    def query_encoder(self) -> TextEncoder:
        return self.model

    def scorer(self, query: torch.Tensor, e_u: torch.Tensor | None) -> Callable[[np.ndarray], torch.Tensor]:
        # Eq. 3: cosine of L2-normalised vectors
        return torch.no_grad()(lambda rows: self.doc_vectors[torch.as_tensor(rows)] @ query)

    @torch.no_grad()
    def encode_docs(self, texts: list[str]) -> torch.Tensor:
        return self.model.encode(texts)


class TrainedRetriever(CorpusRetriever):
    """A stage-2 export (`checkpoints/<run>/retriever`): the tuned encoder and user map, Eq. 5 with
    e_u."""

    def __init__(self, spec: str, corpus: Corpus, cache_dir: str | Path) -> None:
        config = json.loads((Path(spec) / "config.json").read_text())
        super().__init__(spec, corpus, cache_dir, str(doc_encoder_path(spec)), config.get("max_length", 256),
                         config.get("pooling", "mean"))

    def identity(self) -> dict:
        return {"retriever": bundle_digest(self.spec)}

    def _load_model(self) -> PersonalizedRetriever:
        model = PersonalizedRetriever.from_pretrained(self.spec).eval()
        self._tuned_row = {u: i for i, u in enumerate(model.user_ids)}
        return model

    def tuned_user_embedding(self, user_id: str, e_u: torch.Tensor) -> torch.Tensor:
        """A retriever trained with `train_user_embeddings: true` exports its fine-tuned user table:
        its row is the e_u this retriever was trained with (users it never saw keep the stage-1
        embedding)."""
        self.load()
        row = self._tuned_row.get(user_id)
        return e_u if row is None else self.model.user_embeddings[row].to(e_u)

    def query_encoder(self) -> TextEncoder:
        return self.model.query_encoder

    @torch.no_grad()
    def scorer(self, query: torch.Tensor, e_u: torch.Tensor | None) -> Callable[[np.ndarray], torch.Tensor]:
        u = None if e_u is None else self.model.user_vectors(e_u.unsqueeze(0))
        score = self.model.query_scorer(query, u)  # Eq. 5
        return torch.no_grad()(lambda rows: score(self.doc_vectors[torch.as_tensor(rows)]))

    @torch.no_grad()
    def encode_docs(self, texts: list[str]) -> torch.Tensor:
        return self.model.encode_docs(texts)


def _is_retriever_export(spec: str | Path) -> bool:
    return (Path(spec) / USER_HEADS).is_file() and (Path(spec) / "config.json").is_file()


def open_corpus_retriever(spec: str, corpus: Corpus, cache_dir: str | Path, max_length: int = 256,
                          pooling: str = "mean") -> CorpusRetriever:
    """A retriever export → TrainedRetriever; an embedded alias, model folder or `owner/name`
    Hugging Face name → EncoderRetriever. A path that is neither (e.g. the export of a stage not
    trained yet) is a clear error."""
    if _is_retriever_export(spec):
        return TrainedRetriever(spec, corpus, cache_dir)
    path = Path(spec).expanduser()
    hub_name = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if spec in EMBEDDED_MODELS or path.is_dir() or (hub_name and not path.parent.is_dir()):
        return EncoderRetriever(spec, corpus, cache_dir, max_length, pooling)
    raise FileNotFoundError(
        f"no retriever export or encoder at {spec}; a retriever export is made by "
        "`python train.py fit --config cfrag_retriever.yaml` (same --run_name)"
    )
