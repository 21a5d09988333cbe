"""What this machine computes natively, read at run time: precision and runtimes follow it, never a
fixed flag.

bfloat16 counts as native on a CUDA device that supports it, and on a CPU with AVX512-BF16 or
AMX-BF16 (oneDNN's kernels use them) where a matmul at the reader's shapes also *measures* clearly
faster in bfloat16 than in float32. A CPU without them (AVX2-only, AVX-512 without BF16) emulates
bfloat16 in software: the quick preset's generator trained too slowly to use in bf16-mixed on an
AVX2-only AMD EPYC (Zen 3), so `auto` is float32 there. The instructions alone do not make it pay:
on a 2-core Xeon, AMX ran that matmul several times as fast in bfloat16 as in float32, but its
AVX512-BF16 kernels (oneDNN capped at AVX512_CORE_BF16, as on a CPU with AVX512-BF16 and no AMX) ran
it slower, and the reader answered slower too (benchmarks/bench_reader.py; figures:
docs/getting-started.md, docs/performance/llm-feedback.md). The measurement takes a fraction of a
second once per process. `ONEDNN_MAX_CPU_ISA` (oneDNN's own cap, e.g. `AVX2` or `AVX512_CORE_BF16`)
is honoured, so a run can be made to behave as on a machine with fewer instruction sets.
"""

from __future__ import annotations

import functools
import os
import time
from enum import Enum
from pathlib import Path

import torch

__all__ = ["Precision", "auto_precision", "bf16_is_native", "bf16_verdict",
           "cpu_bf16_instructions", "cpu_flags", "cpu_has_native_bf16", "describe_cpu",
           "linear_seconds", "native_runtime", "uses_bf16"]

# the /proc/cpuinfo flags that name the instruction sets a table of machines cares about, in display
# order
ISA_FLAGS = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI",
             "avx512_bf16": "AVX512-BF16", "avx_vnni": "AVX-VNNI", "amx_bf16": "AMX"}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# bfloat16 is native on a CPU only where its matmul measures at least this much faster than
# float32's: the margin keeps a loaded machine's noise from flipping the answer (what each CPU
# class measured: docs/getting-started.md)
BF16_MIN_SPEEDUP = 1.3
# the probe's Linear: SmolLM2's MLP (576 -> 1536) on 2048 tokens, the reader's own shape,
# milliseconds to time (docs/getting-started.md)
PROBE_SHAPE = (2048, 576, 1536)


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The x86 flags of /proc/cpuinfo, or None where there is no such line (another OS or
    architecture)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), None)
    return None if line is None else frozenset(line.split(":", 1)[1].split())


def onednn_has_bf16() -> bool:
    """oneDNN's own answer (honours ONEDNN_MAX_CPU_ISA); False for a torch build without oneDNN."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _onednn_cap() -> str | None:
    """ONEDNN_MAX_CPU_ISA when it caps oneDNN at all (e.g. AVX2, AVX512_CORE_BF16), else None."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return cap if cap and cap not in ("ALL", "DEFAULT") else None


def _onednn_isa_cap() -> str | None:
    """ONEDNN_MAX_CPU_ISA when it caps below AVX-512 (e.g. AVX2), else None."""
    cap = _onednn_cap()
    return cap if cap and not cap.startswith(("AVX512", "AVX10")) else None


def cpu_bf16_instructions() -> bool:
    """AVX512-BF16 or AMX-BF16 in the flags and oneDNN willing to use them. oneDNN alone also says
    yes on plain AVX-512 (emulated there); without x86 flags (another architecture) its answer
    stands."""
    flags = cpu_flags()
    if _onednn_isa_cap() is not None:
        return False
    if flags is not None and not any(f in flags for f in BF16_FLAGS):
        return False
    return onednn_has_bf16()


def bf16_matmul_speedup() -> float:
    """float32 time / bfloat16 time of one Linear at `PROBE_SHAPE` on this CPU, with torch's
    threads: measured once per process and oneDNN cap (best of 3 after a warm-up each), ~0.1-0.3
    s."""
    return _bf16_matmul_speedup(_onednn_cap(), torch.get_num_threads())


@functools.cache
def _bf16_matmul_speedup(cap: str | None, threads: int) -> float:
    del cap, threads  # the cache key: the answer belongs to them
    tokens, d_in, d_out = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, d_in, generator=gen), torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5

    return linear_seconds(x, w, rounds=3) / linear_seconds(x.bfloat16(), w.bfloat16(), rounds=3)


def linear_seconds(x: torch.Tensor, w: torch.Tensor, rounds: int, repeats: int = 1) -> float:
    """Seconds of `repeats` calls of `linear(x, w)`, the best of `rounds` after one warm-up call
    (which pays oneDNN's kernel selection); a shared machine's noise only slows, so the best round
    is the machine's rate."""
    best = float("inf")
    with torch.inference_mode():
        torch.nn.functional.linear(x, w)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(repeats):
                torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t0)
    return best


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively *and faster*: `cpu_bf16_instructions` and
    a measured `bf16_matmul_speedup` of at least `BF16_MIN_SPEEDUP` (AVX512-BF16 without AMX can be
    slower than float32)."""
    return cpu_bf16_instructions() and bf16_matmul_speedup() >= BF16_MIN_SPEEDUP


def bf16_verdict(device: str = "auto") -> str:
    """`bf16_is_native`'s answer with its reason: the first line of a run."""
    if device in ("auto", "cuda", "gpu") and torch.cuda.is_available():
        reason = "CUDA"
    elif not cpu_bf16_instructions():
        reason = "no AVX512-BF16 or AMX in use: emulated"
    else:
        reason = f"a bfloat16 matmul measures {bf16_matmul_speedup():.2f}x float32's speed"
    return f"{'yes' if bf16_is_native(device) else 'no'} ({reason})"


class Precision(Enum):
    """The one precision policy: where a kind of work computes in bfloat16. Every consumer resolves
    it with `uses_bf16` (trainer precision, the feedback labels' and the reader's dtype, the
    rerankers, the query encoder, the corpus embeddings, serving); a config spells it
    `bf16_if_native` (NATIVE) or a preset `cpu_native`."""

    # wherever bfloat16 is native where the work runs: a CUDA device, or such a CPU
    NATIVE = "native"
    # only on such a CPU; float32 on a GPU machine (work that gains nothing there)
    CPU_NATIVE = "cpu_native"
    FLOAT32 = "float32"        # never


def uses_bf16(policy: Precision | str, device: str = "auto") -> bool:
    """Whether work under `policy` computes in bfloat16 on `device` (auto: CUDA when present, else
    this CPU)."""
    policy = Precision(policy)
    if policy is Precision.FLOAT32:
        return False
    if policy is Precision.CPU_NATIVE:
        return not torch.cuda.is_available() and cpu_has_native_bf16()
    return bf16_is_native(device)


def native_runtime(runtime: str) -> str:
    """`bf16_if_native` resolved for CPU work (the evaluation's and serving's reranker and query
    runtimes, the corpus embeddings): bf16 where `uses_bf16(NATIVE, "cpu")`, fp32 elsewhere; any
    other runtime name as given."""
    if runtime != "bf16_if_native":
        return runtime
    return "bf16" if uses_bf16(Precision.NATIVE, "cpu") else "fp32"


def _cuda_has_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def bf16_is_native(device: str = "auto") -> bool:
    """bfloat16 is native where the work runs: CUDA when present (device auto / cuda), else this
    CPU."""
    if device in ("auto", "cuda", "gpu") and torch.cuda.is_available():
        return _cuda_has_bf16()
    return cpu_has_native_bf16()


def auto_precision(device: str = "auto", policy: Precision | str = Precision.NATIVE) -> str:
    """Lightning's precision under `policy` (`auto`: NATIVE): bf16-mixed where it uses bfloat16,
    32-true elsewhere."""
    return "bf16-mixed" if uses_bf16(policy, device) else "32-true"


def describe_cpu() -> str:
    """`<model name>, <n> cores, <instruction sets>` for logs and result tables: a machine named by
    what it is."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags() or frozenset()
    isa = [name for flag, name in ISA_FLAGS.items() if flag in flags]
    cap = _onednn_cap()
    capped = f" (oneDNN capped at {cap})" if cap else ""
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa) or 'no AVX2'}{capped}"
