"""A trained reader's vectors of a store's docs, made before any question needs them.

The trained reader embeds each doc text it reads with its frozen encoder, once per loaded reader
(models/reader.py keeps the last texts in an LRU). A served question whose docs the reader has not
read yet pays for embedding them: with new questions, a fresh server's first batches embedded
about twenty doc texts each, which is what held its latency tail up (docs/serving/chat-service.md).
`pin_doc_vectors` embeds every doc text of a store at load instead and keeps the vectors beyond the
LRU. They are cached on disk under the cache folder, keyed by the encoder, the runtime it runs in
(and whether that runtime computes in bfloat16 here) and the texts themselves; the file holds
vectors only, no text. Deleting a user removes the folder (serving/purge.py), since its vectors
were made from the deleted docs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from persrag_lightning.hardware import native_runtime
from persrag_lightning.models.reader import LabelReader
from persrag_lightning.progress import Progress
from persrag_lightning.utils import atomic_save_tensors, fingerprint

__all__ = ["READER_DOCS", "doc_vectors_path", "pin_doc_vectors"]

READER_DOCS = "reader-docs"  # the folder under the cache folder
BLOCK = 256  # texts per encode call, between progress lines


def doc_vectors_path(cache_dir: str | Path, model: LabelReader, texts: Sequence[str]) -> Path:
    """Where the vectors of `texts` (unique, in order) by `model`'s frozen encoder in its current
    runtime are cached."""
    digest = hashlib.sha256("\0".join(texts).encode("utf-8")).hexdigest()
    # OpenVINO computes in bfloat16 where the CPU does natively, in float32 elsewhere
    precision = native_runtime("bf16_if_native") if model.text_runtime == "openvino" else "fp32"
    key = fingerprint("reader-docs/v1", model.text_key(), model.text_runtime, precision, digest)
    return Path(cache_dir) / READER_DOCS / f"{key}.safetensors"


def pin_doc_vectors(model: LabelReader, texts: Sequence[str], cache_dir: str | Path | None = None) -> int:
    """Embed the unique non-empty `texts` by `model`'s frozen encoder (or load them from the cache
    under `cache_dir`; None: no cache) and pin them in `model` (`LabelReader.pin`); returns how many
    texts are pinned."""
    unique = list(dict.fromkeys(t for t in texts if t))
    if not unique:
        return 0
    path = doc_vectors_path(cache_dir, model, unique) if cache_dir is not None else None
    vectors = load_file(str(path))["vectors"] if path is not None and path.is_file() else None
    if vectors is None or len(vectors) != len(unique):
        vectors = _embed(model, unique)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_save_tensors({"vectors": vectors}, path)
    model.pin(unique, vectors)
    return len(unique)


@torch.inference_mode()
def _embed(model: LabelReader, texts: list[str]) -> torch.Tensor:
    bar = Progress(f"reader doc vectors ({model.text_runtime})", len(texts), "docs")
    blocks = []
    for start in range(0, len(texts), BLOCK):
        blocks.append(model.encode_texts(texts[start:start + BLOCK]).float())
        bar.advance(len(blocks[-1]))
    return torch.cat(blocks).contiguous()
