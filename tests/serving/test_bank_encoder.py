"""The memory bank's encoder as serving runs it (serving/bank_encoder.py): OpenVINO and ONNX Runtime in float32 give
torch's vectors, so a bank written under one runtime recalls the same memories under another; concurrent chats' texts
are embedded in one call, each chat getting the rows it would get alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from persrag_lightning.memory.bank import MemoryBank
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.serving.bank_encoder import (
    BANK_BATCHING,
    BatchedEncoder,
    ExportedTextEncoder,
    bank_encoder,
)
from persrag_lightning.serving.batcher import Batching

TEXTS = ["I water the fern on Sundays", "my sister lives in Lyon", "a short one", "jazz records, mostly 1950s"]


@pytest.mark.parametrize(("runtime", "package"), [("openvino", "openvino"), ("onnx", "onnxruntime")])
def test_an_export_in_float32_gives_torchs_vectors_and_a_bank_written_by_torch_recalls_alike(tiny_bert, tmp_path,
                                                                                             runtime, package):
    pytest.importorskip(package)
    torch_encoder = bank_encoder(tiny_bert, tmp_path / "cache", "fp32")
    served = bank_encoder(tiny_bert, tmp_path / "cache", runtime)
    assert isinstance(torch_encoder, TextEncoder) and isinstance(served, ExportedTextEncoder)
    assert served.dim == torch_encoder.dim
    assert list((tmp_path / "cache" / "onnx").glob("bank-text-*.onnx"))  # the export is kept for later starts
    for text in TEXTS:  # one text per call, as a chat embeds
        assert torch.allclose(served.encode([text]), torch_encoder.encode([text]), atol=1e-5)

    written = MemoryBank(tmp_path / "bank", torch_encoder)
    for text in TEXTS:
        written.remember("u", text, "s")
    before = [r.memory.id for r in written.recall("u", "where does my sister live?")]
    reopened = MemoryBank(tmp_path / "bank", served)
    assert [r.memory.id for r in reopened.recall("u", "where does my sister live?")] == before


@pytest.mark.parametrize(("runtime", "package"), [("openvino", "openvino"), ("onnx", "onnxruntime")])
def test_the_exported_encoder_serves_concurrent_threads(tiny_bert, tmp_path, runtime, package):
    """Chats embed from their worker threads at once: an OpenVINO infer request alone refused a second call (so it
    is locked); an ONNX Runtime session runs them side by side, unlocked."""
    pytest.importorskip(package)
    served = bank_encoder(tiny_bert, tmp_path / "cache", runtime)
    assert isinstance(served._lock, type(threading.Lock())) == (runtime == "openvino")
    alone = {text: served.encode([text]) for text in TEXTS}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda text: served.encode([text]), TEXTS * 8))
    for text, vector in zip(TEXTS * 8, together, strict=True):
        assert torch.equal(vector, alone[text])


def test_torch_is_the_default_and_an_encoder_object_is_kept(tiny_bert, tmp_path):
    assert isinstance(bank_encoder(tiny_bert, tmp_path), TextEncoder)
    given = TextEncoder.from_pretrained(tiny_bert)
    assert bank_encoder(given, tmp_path, "openvino") is given
    with pytest.raises(ValueError, match="bank's runtime must be one of"):
        bank_encoder(tiny_bert, tmp_path, "bf16")


def fake_vectors(texts: list[str]) -> torch.Tensor:
    """A text's fake vector: its length and its first letter's code."""
    return torch.tensor([[float(len(t)), float(ord(t[0]))] for t in texts])


class GatedEncoder:
    """A fake encoder recording each call's texts; its first call waits for `go`."""

    dim = 2

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.entered, self.go = threading.Event(), threading.Event()

    def encode(self, texts: list[str]) -> torch.Tensor:
        self.calls.append(list(texts))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.go.wait(30)
        return fake_vectors(texts)


def test_concurrent_calls_share_one_encoder_call_and_each_gets_its_own_rows():
    fake = GatedEncoder()
    batched = bank_encoder(fake, None, batching=Batching(max_batch=16, max_wait_ms=0))
    assert isinstance(batched, BatchedEncoder) and batched.dim == 2
    asks = [["a first chat"]] + [[f"{i} chat", f"{i} memory of it"] for i in range(5)]
    with ThreadPoolExecutor(len(asks)) as pool:
        first = pool.submit(batched.encode, asks[0])
        assert fake.entered.wait(30)  # the first call is in the encoder: the others queue behind it
        rest = [pool.submit(batched.encode, texts) for texts in asks[1:]]
        deadline = time.monotonic() + 30
        while batched.batcher._queue.qsize() < len(rest):  # every later call queued before the first one ends
            assert time.monotonic() < deadline
            time.sleep(0.01)
        fake.go.set()
        got = [f.result(30) for f in (first, *rest)]
    batched.close()
    assert fake.calls == [asks[0], [t for texts in asks[1:] for t in texts]]  # two encoder calls for six
    for texts, rows in zip(asks, got, strict=True):
        assert torch.equal(rows, fake_vectors(texts))
    assert batched.batcher.stats.calls == 2 and batched.batcher.stats.largest == 5


def test_a_batch_embeds_each_text_as_alone_and_one_call_at_a_time_is_not_wrapped(tiny_bert, tmp_path):
    model = TextEncoder.from_pretrained(tiny_bert)
    batched = BatchedEncoder(model, Batching(max_batch=16, max_wait_ms=0))
    assert BANK_BATCHING.max_batch == 1  # off by default: each chat embeds alone
    together = batched._encode_many([[t] for t in TEXTS])  # texts of different lengths: padding masked
    for text, rows in zip(TEXTS, together, strict=True):
        assert torch.allclose(rows, model.encode([text]), atol=1e-5)
    assert batched.encode([]).shape[0] == 0
    batched.close()
    assert bank_encoder(model, tmp_path, batching=Batching(max_batch=1)) is model
