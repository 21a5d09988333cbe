"""Corpus-embedding cache: every history doc embedded once by the frozen encoder, stored under a
fingerprint.

Precision follows the machine (`embedding_precision`): on a CPU that computes bfloat16 natively
(AVX512-BF16 or AMX) the encoder runs under bfloat16 autocast, elsewhere (an AVX2-only CPU, a GPU)
in float32. On 2 cores of an AMX Xeon, bfloat16 embedded SynthLaMP docs with MiniLM clearly faster
than float32, its vectors and top-5 neighbours nearly float32's (docs/fidelity.md;
benchmarks/bench_inference_precision.py, raw output in benchmarks/results/cpu-2026-11-27b-mainjob/).
The precision is part of the cache's key and of its meta.json.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.hardware import native_runtime
from persrag_lightning.models.text_encoder import Pooling, TextEncoder, model_identity
from persrag_lightning.progress import Progress
from persrag_lightning.utils import atomic_save_tensors, atomic_write_json, fingerprint

__all__ = ["EMBEDDINGS_FILE", "build_corpus_embeddings", "corpus_embedding_dir",
           "corpus_embedding_key", "embedding_precision", "load_corpus_embeddings",
           "precision_autocast"]

log = logging.getLogger(__name__)

EMBEDDINGS_FILE = "embeddings.safetensors"
SHARD_TEXTS = 8192  # unique texts per resumable shard
PROGRESS_TEXTS = 1024  # texts per encode call inside a shard, between progress lines
PRECISIONS = ("auto", "fp32", "bf16")


def _resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def embedding_precision(precision: str = "auto", device: str = "auto") -> str:
    """fp32 or bf16. `auto`: bf16 where the encoder runs on a CPU that computes bfloat16 natively,
    fp32 elsewhere (on a GPU the corpus takes seconds in float32; an AVX2-only CPU would emulate
    bfloat16)."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"corpus embedding precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    if precision != "auto":
        return precision
    return native_runtime("bf16_if_native") if _resolve_device(device) == "cpu" else "fp32"


def precision_autocast(precision: str, device: str = "cpu") -> torch.autocast:
    """The context an encoder embeds in at `precision` (fp32 or bf16, as `embedding_precision`
    resolves it)."""
    return torch.autocast(_resolve_device(device), dtype=torch.bfloat16, enabled=precision == "bf16")


def corpus_embedding_key(corpus: Corpus, encoder: str, max_length: int, pooling: Pooling,
                         precision: str = "auto") -> str:
    """Fingerprint of (data content, model, max length, pooling, precision): a new value of any of
    them is a new cache. `auto` is this machine's precision; float32 keys are those of caches made
    before precision was one."""
    parts = ["corpus-embeddings/v1", corpus.digest(), model_identity(encoder), max_length, pooling]
    if embedding_precision(precision) == "bf16":
        parts.append("bf16")
    return fingerprint(*parts)


def corpus_embedding_dir(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / "embeddings" / key


def build_corpus_embeddings(corpus: Corpus, cache_dir: str | Path, encoder: str = "minilm", max_length: int = 256,
                            pooling: Pooling = "mean", batch_size: int = 64, device: str = "auto",
                            precision: str = "auto") -> Path:
    """Embed the corpus unless its cache exists; identical texts are embedded once; a killed run
    resumes per shard. `precision`: fp32, bf16 (autocast) or auto (`embedding_precision`: by what
    this machine computes natively)."""
    precision = embedding_precision(precision, device)
    key = corpus_embedding_key(corpus, encoder, max_length, pooling, precision)
    out = corpus_embedding_dir(cache_dir, key)
    if (out / EMBEDDINGS_FILE).exists():
        log.info("corpus embeddings cached at %s", out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    # concurrent builders (Slurm array tasks) wait for the first one
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / EMBEDDINGS_FILE).exists():
            _embed_corpus(corpus, out, encoder, max_length, pooling, batch_size, device, precision)
    return out


def _embed_corpus(corpus: Corpus, out: Path, encoder: str, max_length: int, pooling: Pooling, batch_size: int,
                  device: str, precision: str) -> None:
    unique: dict[str, int] = {}
    inverse = torch.tensor(
        [unique.setdefault(t, len(unique)) for t in corpus.texts], dtype=torch.long
    )
    texts = list(unique)
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    model: TextEncoder | None = None
    shards = []
    # a line every 10 s with the ETA (how long a corpus takes per CPU class: docs/performance/)
    bar = Progress(f"embed corpus ({encoder}, {precision})", len(texts), "unique texts")
    for n, start in enumerate(range(0, len(texts), SHARD_TEXTS)):
        shard = parts / f"part-{n:05d}.safetensors"
        if not shard.exists():
            if model is None:
                model = TextEncoder.from_pretrained(encoder, pooling=pooling, max_length=max_length)
                model.to(_resolve_device(device))
            part, blocks = texts[start:start + SHARD_TEXTS], []
            for i in range(0, len(part), PROGRESS_TEXTS):
                with precision_autocast(precision, device):
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
        "encoder": encoder, "max_length": max_length, "pooling": pooling, "precision": precision, "rows": len(corpus),
        "unique_texts": len(texts), "dim": int(table.shape[1]),
    })
    atomic_save_tensors({"embeddings": table}, out / EMBEDDINGS_FILE)
    shutil.rmtree(parts, ignore_errors=True)


def load_corpus_embeddings(cache_dir: str | Path, corpus: Corpus, encoder: str = "minilm", max_length: int = 256,
                           pooling: Pooling = "mean", precision: str = "auto") -> torch.Tensor:
    """The [rows, dim] table for this corpus; a missing cache names the step that builds it. `auto`
    reads the table of this machine's precision, else the other one (a table built by a
    `build_corpus_embeddings` on another device: the same vectors to within bfloat16's rounding)."""
    tried = [embedding_precision(precision)]
    if precision == "auto":
        tried.append("fp32" if tried[0] == "bf16" else "bf16")
    dirs = [corpus_embedding_dir(cache_dir, corpus_embedding_key(corpus, encoder, max_length, pooling, p))
            for p in tried]
    out = next((d for d in dirs if (d / EMBEDDINGS_FILE).exists()), dirs[0])
    path = out / EMBEDDINGS_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"no corpus embeddings at {path}; they are built by the DataModule's prepare_data "
            "(run `fit`, or build_corpus_embeddings)"
        )
    table = load_file(str(path))["embeddings"]
    if table.shape[0] != len(corpus):
        meta = json.loads((out / "meta.json").read_text())
        raise ValueError(
            f"{path}: {table.shape[0]} rows but the corpus has {len(corpus)} docs (meta {meta})"
        )
    return table
