"""Dense retrieval over the whole corpus with cached doc vectors: the untuned encoder (Eq. 3) or a trained
personalized retriever export (Eq. 5). Used to propose feedback candidates and by the CFRAG strategy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.embeddings import build_corpus_embeddings, load_corpus_embeddings
from persrag_lightning.models.retriever import PersonalizedRetriever, doc_encoder_path
from persrag_lightning.models.text_encoder import TextEncoder, model_identity
from persrag_lightning.utils import bundle_digest


class CorpusRetriever:
    """Proposes top-k docs from a user's history: the untuned encoder (Eq. 3) for the retriever stage, or a
    trained retriever export (Eq. 5, with the query user's e_u) for the reranker stage."""

    def __init__(self, spec: str, corpus: Corpus, cache_dir: str | Path, max_length: int = 256,
                 pooling: str = "mean") -> None:
        self.spec = spec
        self.corpus = corpus
        self.cache_dir = cache_dir
        self.trained = (Path(spec) / "user_heads.safetensors").exists()
        self.max_length, self.pooling = max_length, pooling
        self.model = None
        if self.trained:
            self.doc_encoder = str(doc_encoder_path(spec))
            config = json.loads((Path(spec) / "config.json").read_text())
            self.max_length, self.pooling = config.get("max_length", max_length), config.get("pooling", pooling)
        else:
            self.doc_encoder = spec
        self.doc_vectors: torch.Tensor | None = None

    def identity(self) -> dict:
        if self.trained:
            return {"retriever": bundle_digest(self.spec)}
        return {"encoder": model_identity(self.spec), "max_length": self.max_length, "pooling": self.pooling}

    def _embedding_args(self) -> dict:
        return {"encoder": self.doc_encoder, "max_length": self.max_length, "pooling": self.pooling}

    def prepare(self) -> None:
        """Embed the corpus with the doc encoder (cached, shared with stage 1 when it is the same encoder)."""
        build_corpus_embeddings(self.corpus, self.cache_dir, **self._embedding_args())

    def load(self) -> None:
        if self.doc_vectors is not None:
            return
        self.doc_vectors = load_corpus_embeddings(self.cache_dir, self.corpus, **self._embedding_args())
        if self.trained:
            self.model = PersonalizedRetriever.from_pretrained(self.spec).eval()
        else:
            self.model = TextEncoder.from_pretrained(self.spec, pooling=self.pooling, max_length=self.max_length)

    @torch.no_grad()
    def query_vectors(self, queries: list[str]) -> torch.Tensor:
        if self.trained:
            return self.model.encode_queries(queries)
        return self.model.encode(queries)

    @torch.no_grad()
    def score(self, query: torch.Tensor, rows: np.ndarray, e_u: torch.Tensor | None) -> torch.Tensor:
        """Scores of corpus `rows` for one query vector: Eq. 3 (untuned) or Eq. 5 (trained, with e_u)."""
        docs = self.doc_vectors[torch.as_tensor(rows)]
        if not self.trained:
            return docs @ query  # Eq. 3: cosine of L2-normalised vectors
        u = None if e_u is None else self.model.user_vectors(e_u.unsqueeze(0))
        return self.model.score(query.unsqueeze(0), docs.unsqueeze(0), u)[0]

    @torch.no_grad()
    def add_docs(self, texts: list[str]) -> None:
        """Embed new docs (a user added at serving time) and append them as the next corpus rows."""
        self.load()
        vectors = self.model.encode_docs(texts) if self.trained else self.model.encode(texts)
        self.doc_vectors = torch.cat([self.doc_vectors, vectors.to(self.doc_vectors)])
