"""The memory bank's text encoder as the chat service runs it.

Every chat embeds its message with the bank's encoder once, in one call: the recall's query and the
memory it stores are the same text (two texts in that one call where they differ).
`--bank_runtime openvino` runs it in OpenVINO, as the served query and reranker encoders run, in
float32 whatever the CPU: a bank keeps the vectors it stored under earlier servers, written by torch
in float32, and the queries that search them must come from the same function. OpenVINO's
bfloat16, its default on CPUs that compute it natively, would move every vector by about a percent;
float32 matches torch's to about 1e-6 (the test holds it), so a bank written by either runtime is
searched by the other alike.

Torch stays the default: one chat alone spent less in OpenVINO, but sixteen clients at once were
served fewer chats per second, with a longer tail, than with torch, although the encoder alone
embedded faster in OpenVINO under as many threads; `--bank_runtime onnx` embeds a text about five
times as fast as torch and runs concurrent calls without a lock, and the chat route still served no
more chats: a chat's time in the bank is LanceDB's (docs/serving/chat-service.md).

Concurrent chats' texts can be embedded together (`BatchedEncoder`, `persrag serve --bank_max_batch`):
sixteen threads each embedding one text per call get a fraction of what the same calls get batched
(benchmarks/probe_bank_encoder_threads.py), but chats rarely reach the encoder at the same moment,
and the chat route measured no clear gain, so it is off by default.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import torch

from persrag_lightning.memory.recall import Encoder, encode_numpy
from persrag_lightning.models.exported import EXPORTED_RUNTIMES, Session
from persrag_lightning.models.text_encoder import TextEncoder, model_identity
from persrag_lightning.serving.batcher import Batching, MicroBatcher
from persrag_lightning.utils import fingerprint

__all__ = ["BANK_BATCHING", "BANK_RUNTIMES", "BatchedEncoder", "ExportedTextEncoder", "bank_encoder"]

BANK_RUNTIMES = ("fp32", *EXPORTED_RUNTIMES)
BANK_PRECISION = "f32"  # OpenVINO's: the stored vectors' (module docstring)
# off by default: sixteen clients' chats were served about as fast as with each chat's texts alone, a little faster
# or slower by run (docs/serving/chat-service.md#many-users-at-once); `--bank_max_batch 16` turns it on
BANK_BATCHING = Batching(max_batch=1, max_wait_ms=0.0)


class ExportedTextEncoder:
    """A TextEncoder whose forward pass runs in an exported `session`: `encode` and `dim`, what
    MemoryBank takes of an encoder. The bank embeds from every chat's worker thread, outside the
    service's model lock. An OpenVINO infer request runs one call at a time (a second one raises
    "Infer Request is busy"), so its calls take this encoder's own lock; an ONNX Runtime session
    runs concurrent calls itself (its `run` is thread-safe), so they take none."""

    def __init__(self, encoder: TextEncoder, session: Session, runtime: str) -> None:
        self.encoder, self.session, self.runtime = encoder, session, runtime
        self._lock = threading.Lock() if runtime == "openvino" else contextlib.nullcontext()

    @property
    def dim(self) -> int:
        return self.encoder.dim

    def encode(self, texts: list[str]) -> torch.Tensor:
        with self._lock:
            return self.encoder.encode(texts, session=self.session)


class BatchedEncoder:
    """`encoder` behind a micro-batcher: the texts of concurrent `encode` calls are embedded in one
    call of the encoder, each caller getting its own rows, equal up to float rounding to what it
    would get alone (padding is masked). What MemoryBank takes of an encoder: `encode` and `dim`.

    Args:
        encoder: the bank's encoder.
        batching: the most calls one encoder call takes, and how long the first waits for more.
    """

    def __init__(self, encoder: Encoder, batching: Batching) -> None:
        self.encoder = encoder
        self.batcher: MicroBatcher[list[str], torch.Tensor] = MicroBatcher(self._encode_many, batching,
                                                                           name="persrag-bank-encoder")

    @property
    def dim(self) -> int | None:
        """The encoder's (None where it names none: MemoryBank then probes it through `encode`)."""
        return getattr(self.encoder, "dim", None)

    def encode(self, texts: list[str]) -> torch.Tensor:
        return self.batcher(list(texts))

    def _encode_many(self, calls: list[list[str]]) -> list[torch.Tensor]:
        texts = [t for call in calls for t in call]
        if not texts:
            return [torch.empty(0) for _ in calls]
        rows = torch.as_tensor(encode_numpy(self.encoder, texts))
        return list(rows.split([len(call) for call in calls]))

    def close(self) -> None:
        """Stop the worker once the calls queued are embedded."""
        self.batcher.close()


def bank_encoder(encoder: str | Encoder, cache_dir: str | Path | None, runtime: str = "fp32",
                 batching: Batching | None = None) -> Encoder:
    """The bank's encoder in `runtime`: `fp32` (torch), `onnx` or `openvino` (in float32),
    concurrent calls embedded together as `batching` says (None or max_batch 1: each call alone).
    An encoder given as an object is used as it is (batched too); a name (`minilm`, a folder) is
    loaded, its ONNX export kept under `cache_dir` (a temp file without one).

    Args:
        encoder: a model name or folder, or an object with `encode(texts)`.
        cache_dir: the folder of exported encoders (`<cache_dir>/onnx/`).
        runtime: one of BANK_RUNTIMES.
        batching: how concurrent calls are batched (`BatchedEncoder`).
    """
    if runtime not in BANK_RUNTIMES:
        raise ValueError(f"the bank's runtime must be one of {', '.join(BANK_RUNTIMES)}, got {runtime!r}")
    loaded = _load(encoder, cache_dir, runtime)
    return BatchedEncoder(loaded, batching) if batching is not None and batching.max_batch > 1 else loaded


def _load(encoder: str | Encoder, cache_dir: str | Path | None, runtime: str) -> Encoder:
    """The encoder named, in `runtime` (an object: as it is)."""
    if not isinstance(encoder, str):
        return encoder
    name, model = encoder, TextEncoder.from_pretrained(encoder)
    if runtime == "fp32":
        return model
    key = fingerprint(model_identity(name), model.pooling, model.normalize, model.max_length)
    precision = BANK_PRECISION if runtime == "openvino" else None
    session = model.exported_session(runtime, cache_dir, "bank-text", key, width_step=None, precision=precision)
    return ExportedTextEncoder(model, session, runtime)
