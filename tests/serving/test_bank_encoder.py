"""The memory bank's encoder as serving runs it (serving/bank_encoder.py): OpenVINO in float32 gives torch's vectors,
so a bank written under one runtime recalls the same memories under the other."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from persrag_lightning.memory.bank import MemoryBank
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.serving.bank_encoder import ExportedTextEncoder, bank_encoder

TEXTS = ["I water the fern on Sundays", "my sister lives in Lyon", "a short one", "jazz records, mostly 1950s"]


def test_openvino_in_float32_gives_torchs_vectors_and_a_bank_written_by_torch_recalls_alike(tiny_bert, tmp_path):
    pytest.importorskip("openvino")
    torch_encoder = bank_encoder(tiny_bert, tmp_path / "cache", "fp32")
    served = bank_encoder(tiny_bert, tmp_path / "cache", "openvino")
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


def test_the_exported_encoder_serves_concurrent_threads(tiny_bert, tmp_path):
    """Chats embed from their worker threads at once; an OpenVINO infer request alone refused a second call."""
    pytest.importorskip("openvino")
    served = bank_encoder(tiny_bert, tmp_path / "cache", "openvino")
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
