"""Feedback throughput: candidate evaluations per second per LLM backend versus the naive transformers loop.

One candidate = one prompt built by `build_prompt` from one history doc + the query (as in CFRAG's feedback),
~220 tokens, greedy. Baseline: transformers, one prompt at a time, max_new_tokens=64 (as the official code).
Rows "loglik labels" time the quick preset's feedback labels, log p(gold | prompt) in one forward per candidate.
Beside float32 transformers: bfloat16 weights (where native), int8 dynamic quantisation of the Linear layers (CPU),
vLLM (CUDA, when installed), llamacpp on the shipped Q4_1 GGUF and re-encoded copies (`--llamacpp-weights`). The
last column counts answers (or log-likelihoods within 0.1 nat, with the median distance) equal to float32
transformers' on the de-quantised weights (the exact model). Rows "choose" time the evaluation's `answer_mode:
choose` on a label task (the most likely of its labels); the llamacpp "before" rows are its `score` up to 2026-11-23
(`logits_all_score`) and before flash attention (later the same day), and its `choose` with one llama_decode call
per option (its first version; now all options of a prompt in one call). Prints a table; asserts nothing about time.

    python benchmarks/bench_llm.py --quick
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import get_task
from persrag_lightning.hardware import cpu_has_native_bf16
from persrag_lightning.llm import LLM, build_prompt, default_max_new_tokens, load_llm, resolve_model
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading.llm import LLMReader

BASELINE_MAX_NEW_TOKENS = 64
T = TypeVar("T")
WORDS_TEXT = (
    "the of and to in is was for that with as on by at from his her their this which be are an or it have has "
    "not were but they one all new more first after time two when been who years also other into people its "
    "would about only some most over such city made these many year can then used where later state under "
    "while world during part film team found known high school music before between well same three being "
    "since both however through system work until season game series music story love family war life man "
    "woman young book novel dark robot future science space planet network data model learning method "
    "results paper study approach performance graph user retrieval language sensor routing energy wireless"
)


@dataclass
class Row:
    """One measured configuration."""

    task: str
    backend: str
    batch: int
    max_new: int
    prompts: int
    prompt_tokens: float
    seconds: float
    agree: str = "-"  # llamacpp: answers (or log-likelihoods within 0.1 nat) equal to float32 transformers' ones

    @property
    def rate(self) -> float:
        return self.prompts / self.seconds


def synthetic_text(rng: random.Random, n_words: int) -> str:
    """Pseudo-English of a given length: prompt lengths and tokenisation close to real LaMP text."""
    vocab = WORDS_TEXT.split()
    out, sentence = [], []
    for _ in range(n_words):
        sentence.append(rng.choice(vocab))
        if len(sentence) >= rng.randint(8, 18):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def feedback_prompts(task: str, n: int, count_tokens: Callable[[str], int], max_prompt_tokens: int,
                     seed: int = 0) -> list[str]:
    """n feedback prompts (one candidate doc + query each), cut to `max_prompt_tokens` by the prompt builder."""
    rng = random.Random(seed)
    spec = get_task(task)
    prompts = []
    for i in range(n):
        if spec.name == "LaMP-2":
            raw = ("Which tag does this movie relate to among the following tags? Just answer with the tag name "
                   f"without further explanation. tags: [sci-fi, comedy] description: {synthetic_text(rng, 40)}")
            doc = HistoryDoc(f"d{i}", (2020, 1, 1), {"description": synthetic_text(rng, 300),
                                                      "tag": rng.choice(spec.labels or ("comedy",))})
        elif spec.name == "LaMP-5":
            raw = f"Generate a title for the following abstract of a paper: {synthetic_text(rng, 160)}"
            doc = HistoryDoc(f"d{i}", (2020, 1, 1), {"title": synthetic_text(rng, 10).rstrip("."),
                                                      "abstract": synthetic_text(rng, 300)})
        else:
            raise ValueError(f"bench covers LaMP-2 and LaMP-5, not {task}")
        prompts.append(build_prompt(spec.name, raw, [doc], count_tokens, max_prompt_tokens))
    return prompts


def choose(llm: LLM, task: str, prompts: list[str]) -> list[str]:
    """The evaluation's `answer_mode: choose` (the LLM reader, uncalibrated, no store): the most likely label."""
    return LLMReader(LLMConfig(answer_mode="choose"), llm=llm, remember_terms=False).answer_prompts(task, prompts)


def timed_call(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    """(result, wall-clock seconds) of one call."""
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


def timed(fn: Callable[..., object], *args: object) -> float:
    """Wall-clock seconds of one call."""
    return timed_call(fn, *args)[1]


def warm_up(llm: LLM, prompts: list[str], targets: list[str], max_new: int) -> None:
    """One untimed call of each timed kind before timing: on a CPU one short prompt is enough; on a GPU a full
    batch of each (generate, score), since the first call of a precision and shape picks and loads its kernels
    (the bf16 rows of 2026-11-22 were taken without it: one first call each)."""
    n = llm.batch_size if llm.device.type == "cuda" else 1  # type: ignore[attr-defined]
    llm.generate(prompts[:n], max_new if n > 1 else 2)
    if n > 1:
        llm.score(prompts[:n], targets[:n])


def same_answers(answers: list[str], exact: list[str]) -> str:
    """How many answers equal the exact model's."""
    return f"{sum(a == b for a, b in zip(answers, exact))}/{len(exact)}"


def same_scores(scores: list[float], exact: list[float]) -> str:
    """How many log-likelihoods lie within 0.1 nat of the exact model's, and the median distance."""
    gaps = [abs(a - b) for a, b in zip(scores, exact)]
    return f"{sum(g < 0.1 for g in gaps)}/{len(exact)}, median {statistics.median(gaps):.2f} nat"


def naive_baseline(hf: LLM, prompts: list[str]) -> float:
    """The official loop: transformers generate, one prompt at a time, 64 new tokens, chat template, greedy."""
    tok, model = hf.tokenizer, hf.model  # type: ignore[attr-defined]

    def run() -> None:
        with torch.no_grad():
            for p in prompts:
                ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True).to(model.device)
                model.generate(**ids, max_new_tokens=BASELINE_MAX_NEW_TOKENS, do_sample=False,
                               pad_token_id=tok.eos_token_id)

    return timed(run)


def logits_all_score(local: LLM, threads: int) -> Callable[[list[str], list[str]], list[float]]:
    """llamacpp's `score` before 2026-11-23, the baseline of the rows after it: a `logits_all` context, which
    projects every prompt position onto the vocabulary and copies those logits out; one eval per pair."""
    import llama_cpp
    import numpy as np

    from persrag_lightning.llm.llamacpp import _log_softmax

    ctx = llama_cpp.Llama(model_path=local.model_path, n_ctx=local.n_ctx, n_batch=local.n_batch,  # type: ignore[attr-defined]
                          logits_all=True, verbose=False, n_threads=threads, n_threads_batch=threads)

    def score(prompts: list[str], targets: list[str]) -> list[float]:
        out = []
        for prompt, target in zip(prompts, targets):
            head = ctx.tokenize(local.chat_text(prompt).encode(), add_bos=True, special=True)  # type: ignore[attr-defined]
            tail = ctx.tokenize(target.encode(), add_bos=False, special=False)
            ctx.reset()
            ctx.eval(head + tail)
            logp = _log_softmax(np.asarray(ctx.scores[len(head) - 1: len(head) + len(tail) - 1], dtype=np.float64))
            out.append(float(logp[np.arange(len(tail)), tail].sum()))
        return out

    return score


def start_llama_server(gguf: str, threads: int) -> tuple[subprocess.Popen, str] | None:
    """llama-cpp-python's OpenAI-compatible server on loopback, or None when it cannot start."""
    if any(importlib.util.find_spec(m) is None for m in ("llama_cpp", "fastapi", "uvicorn", "sse_starlette")):
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "2048", "--n_threads", str(threads),
                             "--n_threads_batch", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2) as resp:
                if json.loads(resp.read()).get("data"):
                    return proc, url
        except OSError:
            time.sleep(0.25)
    proc.terminate()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller grid and fewer prompts")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tasks", nargs="+", default=["LaMP-2", "LaMP-5"])
    ap.add_argument("--prompts", type=int, default=None, help="prompts per configuration")
    ap.add_argument("--baseline-prompts", type=int, default=None,
                    help="prompts through the naive loop (default: half of --prompts with --quick, else all)")
    ap.add_argument("--prompt-tokens", type=int, default=220, help="budget of the user message")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--backends", nargs="+", default=["hf", "llamacpp", "openai", "vllm"],
                    help="hf rows always run (the reference); vllm rows need a CUDA device and vLLM installed")
    ap.add_argument("--llamacpp-weights", nargs="+", default=["gguf", "f16", "bf16", "q4_0"],
                    help="llamacpp weight types: gguf = the shipped Q4_1 file; others re-encoded once (cached)")
    ap.add_argument("--score-seqs", type=int, nargs="*", default=[2, 4],
                    help="llamacpp loglik rows (default weights) with this many pairs per llama_decode call")
    ap.add_argument("--device", default="auto", help="hf rows' device: auto (CUDA when present), cpu or cuda; the "
                    "reference (and naive baseline) is float32 there, the bf16 rows follow it")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="CPU threads for torch and llama.cpp (1 is far faster when other jobs share the cores)")
    args = ap.parse_args()

    n = args.prompts or (16 if args.quick else 64)
    n_base = args.baseline_prompts or (max(4, n // 2) if args.quick else n)
    batch_sizes = args.batch_sizes or ([1, 4, 16] if args.quick else [1, 4, 8, 16, 32])
    threads = args.threads
    torch.set_num_threads(threads)
    hf = load_llm("hf", args.model, batch_size=1, device=args.device, dtype="float32")
    print(f"# model={args.model} ({hf.fingerprint}) cores={os.cpu_count()} threads={threads} "
          f"torch={torch.__version__} device={hf.device} python={platform.python_version()}")  # type: ignore[attr-defined]
    if hf.device.type == "cuda":  # type: ignore[attr-defined]
        print(f"# gpu={torch.cuda.get_device_name()}")
    if importlib.util.find_spec("llama_cpp"):
        import llama_cpp

        print(f"# llama-cpp-python={llama_cpp.__version__}")
    print(f"# load average at the start (1/5/15 min): {os.getloadavg()} (other processes share these cores)")
    rows: list[Row] = []

    def record(row: Row) -> None:
        rows.append(row)
        print(f"# {row.task} {row.backend} batch={row.batch} max_new={row.max_new}: {row.rate:.2f}/s",
              file=sys.stderr, flush=True)

    prompts_of = {t: feedback_prompts(t, n, hf.count_tokens, args.prompt_tokens) for t in args.tasks}
    # the gold output a loglik label scores: a tag (LaMP-2), a title of ~10 words (LaMP-5)
    rng = random.Random(1)
    targets_of = {t: [rng.choice(get_task(t).labels) if get_task(t).labels else synthetic_text(rng, 10).rstrip(".")
                      for _ in range(n)] for t in args.tasks}
    chat_len = {t: sum(len(hf._encode_prompts([p])[0]) for p in ps) / len(ps)  # type: ignore[attr-defined]
                for t, ps in prompts_of.items()}

    def choose_row(llm: LLM, name: str, task: str, prompts: list[str], want: list[str] | None = None) -> list[str]:
        """The evaluation's `answer_mode: choose` on a label task (the most likely of its labels, one prompt
        evaluated once per option set): a row, and its choices (none for a generation task)."""
        labels = get_task(task).labels
        if not labels:
            return []
        choices, seconds = timed_call(lambda ps: choose(llm, task, ps), prompts)
        record(Row(task, f"{name}, choose among the {len(labels)} labels", llm.batch_size, 0, n, chat_len[task],
                   seconds, "(exact)" if want is None else same_answers(choices, want)))
        return choices

    # float32 transformers on the de-quantised weights computes the model exactly (up to float32 rounding): the
    # reference the llamacpp rows' answers are compared with (Q4_1 kernels also round the activations to 8 bits)
    exact: dict[str, tuple[list[str], list[float], list[str]]] = {}  # answers, labels, choices
    for task, prompts in prompts_of.items():
        max_new = default_max_new_tokens(task)
        hf.generate(prompts[:1], 2)  # warm-up
        record(Row(task, "transformers naive (baseline)", 1, BASELINE_MAX_NEW_TOKENS, n_base, chat_len[task],
                   naive_baseline(hf, prompts[:n_base])))
        for bs in batch_sizes:
            hf.batch_size = bs
            warm_up(hf, prompts, targets_of[task], max_new)
            answers, seconds = timed_call(hf.generate, prompts, max_new)
            record(Row(task, "hf", bs, max_new, n, chat_len[task], seconds))
        hf.batch_size = max(batch_sizes)
        record(Row(task, "hf", hf.batch_size, BASELINE_MAX_NEW_TOKENS, n, chat_len[task],
                   timed(hf.generate, prompts, BASELINE_MAX_NEW_TOKENS)))
        # the quick preset's labels: log p(gold | prompt), one forward per candidate, no generation
        scores, seconds = timed_call(hf.score, prompts, targets_of[task])
        record(Row(task, "hf, loglik labels", hf.batch_size, 0, n, chat_len[task], seconds))
        exact[task] = (answers, scores, choose_row(hf, "hf", task, prompts))
    hf.close()

    def against_exact(llm: LLM, name: str, batch: int, warm: Callable[[str, list[str]], object]) -> None:
        """Rows of `llm` (task budget and loglik labels) with their agreement with the exact model's outputs."""
        for task, prompts in prompts_of.items():
            max_new = default_max_new_tokens(task)
            warm(task, prompts)
            answers, seconds = timed_call(llm.generate, prompts, max_new)
            scores, score_seconds = timed_call(llm.score, prompts, targets_of[task])
            record(Row(task, name, batch, max_new, n, chat_len[task], seconds, same_answers(answers, exact[task][0])))
            record(Row(task, f"{name}, loglik labels", batch, 0, n, chat_len[task], score_seconds,
                       same_scores(scores, exact[task][1])))
            choose_row(llm, name, task, prompts, exact[task][2])

    def batch_warm_up(llm: LLM) -> Callable[[str, list[str]], object]:
        return lambda task, prompts: warm_up(llm, prompts, targets_of[task], default_max_new_tokens(task))

    if hf.device.type == "cuda" or cpu_has_native_bf16():  # type: ignore[attr-defined]
        # the same model in bfloat16 weights (what the quick preset answers with, and CUDA's default)
        half = load_llm("hf", args.model, batch_size=max(batch_sizes), device=args.device, dtype="bf16")
        against_exact(half, "hf, bf16", half.batch_size, batch_warm_up(half))
        half.close()
    if hf.device.type == "cpu":
        # int8 dynamic quantisation of every Linear layer (torch.ao's quantize_dynamic with its default qconfig, as
        # the reranker's `reranker_runtime="int8"`): a row of its own, not a backend option, since it loses
        # (docs/performance/llm-feedback.md)
        q8 = load_llm("hf", args.model, batch_size=max(batch_sizes), device="cpu", dtype="float32")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecates quantized tensors in favour of torchao
            q8.model = torch.ao.quantization.quantize_dynamic(q8.model, {torch.nn.Linear}, dtype=torch.qint8)
            against_exact(q8, "hf, int8 dynamic", q8.batch_size, batch_warm_up(q8))
        q8.close()
    if "vllm" in args.backends and torch.cuda.is_available() and importlib.util.find_spec("vllm"):
        # vLLM schedules the whole list itself (continuous batching, prefix caching of the shared chat prefix);
        # its dtype "auto" is the checkpoint's bfloat16, so the bf16 rows above are its like-for-like reference
        engine = load_llm("vllm", args.model, batch_size=max(batch_sizes), gpu_memory_utilization=0.3)
        import vllm

        print(f"# vllm={vllm.__version__}")
        # warm-up: the engine's first batches compile and capture CUDA graphs
        against_exact(engine, "vllm", engine.batch_size, lambda task, prompts: (
            engine.generate(prompts, default_max_new_tokens(task)), engine.score(prompts, targets_of[task])))
        for task, prompts in prompts_of.items():
            record(Row(task, "vllm", engine.batch_size, BASELINE_MAX_NEW_TOKENS, n, chat_len[task],
                       timed(engine.generate, prompts, BASELINE_MAX_NEW_TOKENS)))
        engine.close()
    if "llamacpp" in args.backends and importlib.util.find_spec("llama_cpp"):
        for weights in args.llamacpp_weights:
            local = load_llm("llamacpp", args.model, n_threads=threads, weights=weights)
            name = "llamacpp" + ("" if weights == "gguf" else f", weights {weights}")
            against_exact(local, name, 1, lambda task, prompts, local=local: local.generate(prompts[:1], 2))
            local.close()
        # the default weights' labels other ways: logits at every prompt position (a logits_all context, the
        # former way of `score`), without flash attention (the former default), and several pairs per llama_decode
        # call
        variants = [("logits at every position (before)", 1, False), ("no flash attention (before)", 1, False),
                    *((f"{seqs} pairs per call", seqs, True) for seqs in args.score_seqs)]
        for label, seqs, flash in variants:
            local = load_llm("llamacpp", args.model, n_threads=threads, weights="auto", score_seqs=seqs,
                             flash_attn=flash)
            score = logits_all_score(local, threads) if label.startswith("logits") else local.score
            for task, prompts in prompts_of.items():
                score(prompts[:seqs], targets_of[task][:seqs])
                scores, seconds = timed_call(score, prompts, targets_of[task])
                record(Row(task, f"llamacpp, weights {local.weights}, loglik labels, {label}", seqs, 0, n,
                           chat_len[task], seconds, same_scores(scores, exact[task][1])))
            del score  # frees the baseline's logits_all context (~400 MB of logits) before the next rows
            local.close()
        # `choose` as it first ran: one llama_decode per multi-token option over the prompt's KV cache
        local = load_llm("llamacpp", args.model, n_threads=threads, weights="auto")
        local.option_seqs = 1  # type: ignore[attr-defined]
        for task, prompts in prompts_of.items():
            if get_task(task).labels:
                choose(local, task, prompts[:1])  # warm-up
            choose_row(local, f"llamacpp, weights {local.weights}, one option per call (before)", task, prompts,
                       exact[task][2])
        local.close()
    # The server starts only now so that it takes no CPU from the in-process measurements.
    server = start_llama_server(resolve_model(args.model).path, threads) if "openai" in args.backends else None
    if server is None and "openai" in args.backends:
        print("# openai: llama_cpp.server could not be started (pip install 'llama-cpp-python[server]')")
    try:
        for task, prompts in prompts_of.items() if server is not None else ():
            max_new = default_max_new_tokens(task)
            for conc in (1, 4):
                remote = load_llm("openai", args.model, base_url=server[1], batch_size=conc)
                remote.generate(prompts[:1], 2)
                record(Row(task, "openai (llama_cpp.server)", conc, max_new, n, chat_len[task],
                           timed(remote.generate, prompts, max_new)))
    finally:
        if server is not None:
            server[0].terminate()
            server[0].wait(timeout=15)

    print(f"# load average at the end (1/5/15 min): {os.getloadavg()}")
    print()
    print("| task | backend | batch | max new tokens | prompts | prompt tokens (chat) | seconds | candidates/s "
          "| speedup | same as exact (hf float32) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next(b for b in rows if b.task == r.task and b.backend.endswith("(baseline)"))
        print(f"| {r.task} | {r.backend} | {r.batch} | {r.max_new} | {r.prompts} | {r.prompt_tokens:.0f} | "
              f"{r.seconds:.1f} | {r.rate:.2f} | {r.rate / base.rate:.1f}x | {r.agree} |")


if __name__ == "__main__":
    main()
