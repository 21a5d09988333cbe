"""`backend: auto`: the backend that computes exact labels fastest *on this machine*, measured once
and remembered.

On a CPU the winner depends on the processor, not on the code: on one 2-core Xeon llama.cpp (f16
weights) labelled SmolLM2's feedback prompts faster than float32 transformers, on another (the same
instruction set, another host) transformers was the faster (docs/training/feedback.md,
docs/performance/llm-feedback.md). Both compute the exact model (labels within 0.1 nat). So on a
CPU-only machine where both could run, `auto` times both on a few feedback-sized prompts and keeps
the faster; the decision is written once per processor, software and model
(`<cache>/llm/auto-backend-<key>.json`, under a lock, so DDP ranks and concurrent jobs on a machine
agree) and read by every later run. Delete the file to measure again; name `hf` or `llamacpp` to
skip the measurement.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import platform
import random
import time
from pathlib import Path

import torch

from persrag_lightning.llm.base import LLM, LLMBackendError, ModelSource, cache_root, resolve_model
from persrag_lightning.utils import atomic_write_json

__all__ = ["PROBE_VOCABULARY", "auto_backend"]

log = logging.getLogger(__name__)
# feedback-sized pairs timed per backend (one batch for hf), after one untimed warm-up pair
PROBE_PROMPTS = 8
# ~250 tokens with the chat template: a feedback prompt (one history doc + the query)
PROBE_WORDS = 180
PROBE_VOCABULARY = (  # noqa: SIM905 -- a sentence of common words reads better than a 75-item list literal
    "the of and to in is was for that with as on by at from their this which be are an or it have has not "
    "were but they one all new more first after time two when been who years also other into people its "
    "model learning method results paper study approach performance graph user retrieval language network "
    "data system energy routing sensor wireless science space planet robot future novel music film"
).split()
"""The words a probe prompt is drawn from (common English and the corpus's topics), so a probe
tokenizes like a real prompt of the same length."""


def auto_backend(model: str, options: dict | None = None) -> str:
    """`hf` on a CUDA machine (it labels at ~350-460 per s there; this llama-cpp-python is a CPU
    build), for an HF folder, without llama-cpp-python, or with an option only hf takes (`dtype`:
    the bf16 fast path); `llamacpp` with an option only it takes (`weights`, `n_threads`, ...);
    otherwise, on a CPU with a GGUF model, the one `measured_winner` finds faster on this
    machine."""
    if torch.cuda.is_available() or not _llama_cpp_installed():
        return "hf"
    try:
        source = resolve_model(model)
    except LLMBackendError:
        return "hf"  # the hf backend reports the missing model when it is loaded
    if not source.is_gguf:
        return "hf"
    classes = _backend_classes()
    keys = set(options or {})
    if not keys <= set(inspect.signature(classes["llamacpp"].__init__).parameters):
        return "hf"
    if not keys <= set(inspect.signature(classes["hf"].__init__).parameters):
        return "llamacpp"
    return measured_winner(model, dict(options or {}))


def measured_winner(model: str, options: dict) -> str:
    """The backend whose recorded (or, the first time, measured) label rate on this machine is
    higher."""
    source = resolve_model(model)
    record = cache_root() / "llm" / f"auto-backend-{_machine_key(source, options)}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one measurement per machine; the others wait and read it
        if record.is_file():
            try:
                return str(json.loads(record.read_text())["backend"])
            except (ValueError, KeyError):
                pass  # a damaged record (atomic writes make this unlikely): measure again
        started = time.perf_counter()
        rates = {backend: label_rate(backend, model, options) for backend in ("hf", "llamacpp")}
        winner = max(rates, key=lambda b: rates[b])
        atomic_write_json(record, {"backend": winner, "labels_per_s": rates, "model": source.name,
                                   "digest": source.digest, "options": options, "machine": _machine_facts(),
                                   "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                                   "seconds": round(time.perf_counter() - started, 1)})
    log.warning("backend auto: %s on this machine (exact labels per s: %s; measured once, kept in %s)", winner,
                ", ".join(f"{b} {r:.2f}" for b, r in rates.items()), record)
    return winner


def label_rate(backend: str, model: str, options: dict) -> float:
    """Feedback labels per second of `backend` (float32 transformers or llama.cpp's default weights)
    on PROBE_PROMPTS feedback-sized pairs; 0 when the backend cannot load the model here. `model` as
    the run names it (an alias keeps the backends' converted copies under the names the run itself
    uses)."""
    prompts, targets = _probe_pairs()
    defaults = {"batch_size": PROBE_PROMPTS, "dtype": "float32"} if backend == "hf" else {}
    try:
        llm: LLM = _backend_classes()[backend](model, **{**defaults, **options})
    except (LLMBackendError, OSError, ValueError) as err:
        log.warning("backend auto: %s cannot run %s here (%s)", backend, model, err)
        return 0.0
    try:
        llm.score(prompts[:1], targets[:1])  # warm-up: first-call allocations and kernel choices
        started = time.perf_counter()
        llm.score(prompts, targets)
        return len(prompts) / (time.perf_counter() - started)
    finally:
        llm.close()


def _probe_pairs() -> tuple[list[str], list[str]]:
    """PROBE_PROMPTS (prompt, target) pairs of a feedback label's size: a ~180-word abstract and a
    ~10-word title."""
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(PROBE_VOCABULARY) for _ in range(n))

    prompts = [f"Generate a title for the following abstract of a paper: {words(PROBE_WORDS)}."
               for _ in range(PROBE_PROMPTS)]
    return prompts, [words(10).capitalize() for _ in range(PROBE_PROMPTS)]


def _machine_facts() -> dict[str, object]:
    """What decides the winner: the processor (model and instruction set), the cores this process
    may use, torch's threads and both libraries' versions."""
    cpu, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:  # not Linux: the platform's own description
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "flags_sha": hashlib.sha256(flags.encode()).hexdigest()[:12], "cores": cores,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "llama_cpp_python": _llama_cpp_version(), "node": platform.node()}


def _machine_key(source: ModelSource, options: dict) -> str:
    """Processor, software, model and options: machines alike share a record (not the host name: a
    Slurm array's nodes of one type agree on one backend, hence one feedback cache)."""
    facts = {k: v for k, v in _machine_facts().items() if k != "node"}
    blob = json.dumps([facts, source.digest, options], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _backend_classes() -> dict[str, type]:
    """The two exact CPU backends, imported on use (transformers is slow to import); a GGUF is a
    causal LM, so no seq2seq case as in `load_llm` (which this module cannot import: registry
    imports it)."""
    from persrag_lightning.llm.hf import HFLLM
    from persrag_lightning.llm.llamacpp import LlamaCppLLM

    return {"hf": HFLLM, "llamacpp": LlamaCppLLM}


def _llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _llama_cpp_installed() -> bool:
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except ValueError:  # a module entry without a spec
        return False
