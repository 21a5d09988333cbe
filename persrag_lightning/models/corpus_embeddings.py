"""Corpus-embedding cache: every history doc embedded once by the frozen encoder, stored under a fingerprint."""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.models.text_encoder import Pooling, TextEncoder, model_identity
from persrag_lightning.progress import Progress
from persrag_lightning.utils import atomic_save_tensors, atomic_write_json, fingerprint

log = logging.getLogger(__name__)

EMBEDDINGS_FILE = "embeddings.safetensors"
SHARD_TEXTS = 8192  # unique texts per resumable shard
PROGRESS_TEXTS = 1024  # texts per encode call inside a shard, between progress lines


def corpus_embedding_key(corpus: Corpus, encoder: str, max_length: int, pooling: Pooling) -> str:
    """Fingerprint of (data content, model, max length, pooling): a new value of any of them is a new cache."""
    return fingerprint("corpus-embeddings/v1", corpus.digest(), model_identity(encoder), max_length, pooling)


def corpus_embedding_dir(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / "embeddings" / key


def resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def build_corpus_embeddings(corpus: Corpus, cache_dir: str | Path, encoder: str = "minilm", max_length: int = 256,
                            pooling: Pooling = "mean", batch_size: int = 64, device: str = "auto") -> Path:
    """Embed the corpus unless its cache exists; identical texts are embedded once; a killed run resumes per shard."""
    key = corpus_embedding_key(corpus, encoder, max_length, pooling)
    out = corpus_embedding_dir(cache_dir, key)
    if (out / EMBEDDINGS_FILE).exists():
        log.info("corpus embeddings cached at %s", out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:  # concurrent builders (Slurm array tasks) wait for the first one
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / EMBEDDINGS_FILE).exists():
            _embed_corpus(corpus, out, encoder, max_length, pooling, batch_size, device)
    return out


def _embed_corpus(corpus: Corpus, out: Path, encoder: str, max_length: int, pooling: Pooling, batch_size: int,
                  device: str) -> None:
    unique: dict[str, int] = {}
    inverse = torch.tensor([unique.setdefault(t, len(unique)) for t in corpus.texts], dtype=torch.long)
    texts = list(unique)
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    model: TextEncoder | None = None
    shards = []
    # a line every 10 s with the ETA (12k SynthLaMP docs: a minute on 2 cores, more without AVX-512)
    bar = Progress(f"embed corpus ({encoder})", len(texts), "unique texts")
    for n, start in enumerate(range(0, len(texts), SHARD_TEXTS)):
        shard = parts / f"part-{n:05d}.safetensors"
        if not shard.exists():
            if model is None:
                model = TextEncoder.from_pretrained(encoder, pooling=pooling, max_length=max_length)
                model.to(resolve_device(device))
            part, blocks = texts[start:start + SHARD_TEXTS], []
            for i in range(0, len(part), PROGRESS_TEXTS):
                blocks.append(model.encode(part[i:i + PROGRESS_TEXTS], batch_size=batch_size))
                bar.advance(len(blocks[-1]))
            atomic_save_tensors({"embeddings": torch.cat(blocks)}, shard)
        else:  # a shard kept from a killed run counts at once
            bar.advance(min(SHARD_TEXTS, len(texts) - start))
        shards.append(shard)
    if not texts:
        raise ValueError("the corpus has no documents to embed")
    table = torch.cat([load_file(str(s))["embeddings"] for s in shards])[inverse].contiguous()
    atomic_write_json(out / "meta.json", {
        "encoder": encoder, "max_length": max_length, "pooling": pooling, "rows": len(corpus),
        "unique_texts": len(texts), "dim": int(table.shape[1]),
    })
    atomic_save_tensors({"embeddings": table}, out / EMBEDDINGS_FILE)
    shutil.rmtree(parts, ignore_errors=True)


def load_corpus_embeddings(cache_dir: str | Path, corpus: Corpus, encoder: str = "minilm", max_length: int = 256,
                           pooling: Pooling = "mean") -> torch.Tensor:
    """The [rows, dim] table for this corpus; a missing cache names the step that builds it."""
    out = corpus_embedding_dir(cache_dir, corpus_embedding_key(corpus, encoder, max_length, pooling))
    path = out / EMBEDDINGS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no corpus embeddings at {path}; they are built by the DataModule's prepare_data "
                                "(run `fit`, or build_corpus_embeddings)")
    table = load_file(str(path))["embeddings"]
    if table.shape[0] != len(corpus):
        meta = json.loads((out / "meta.json").read_text())
        raise ValueError(f"{path}: {table.shape[0]} rows but the corpus has {len(corpus)} docs (meta {meta})")
    return table
