"""What this machine computes natively, read at run time: precision and runtimes follow it, never a fixed flag.

bfloat16 counts as native on a CPU with AVX512-BF16 or AMX-BF16 (oneDNN's kernels use them) and on a CUDA device
that supports it. A CPU without them (AVX2-only, AVX-512 without BF16) emulates bfloat16 in software: the quick
preset's generator trained at 0.02 examples/s in bf16-mixed on an AVX2-only AMD EPYC (Zen 3), so `auto` is float32
there. `ONEDNN_MAX_CPU_ISA` (oneDNN's own cap, e.g. `AVX2`) is honoured, so a run can be made to behave as on a
machine with fewer instruction sets.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

# the /proc/cpuinfo flags that name the instruction sets a table of machines cares about, in display order
ISA_FLAGS = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI",
             "avx512_bf16": "AVX512-BF16", "avx_vnni": "AVX-VNNI", "amx_bf16": "AMX"}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The x86 flags of /proc/cpuinfo, or None where there is no such line (another OS or architecture)."""
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


def onednn_isa_cap() -> str | None:
    """ONEDNN_MAX_CPU_ISA when it caps below AVX-512 (e.g. AVX2), else None."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return cap if cap and not cap.startswith(("AVX512", "AVX10", "ALL", "DEFAULT")) else None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively: AVX512-BF16 or AMX-BF16 in the flags and oneDNN willing
    to use them. oneDNN alone also says yes on plain AVX-512 (emulated there); without x86 flags its answer stands."""
    flags = cpu_flags()
    if onednn_isa_cap() is not None:
        return False
    if flags is not None and not any(f in flags for f in BF16_FLAGS):
        return False
    return onednn_has_bf16()


def native_runtime(runtime: str) -> str:
    """`bf16_if_native` resolved on this CPU: bf16 where it computes bfloat16 natively, fp32 elsewhere; any other
    runtime name as given (the evaluation's and serving's reranker and query runtimes)."""
    if runtime != "bf16_if_native":
        return runtime
    return "bf16" if cpu_has_native_bf16() else "fp32"


def cuda_has_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def bf16_is_native(device: str = "auto") -> bool:
    """bfloat16 is native where the work runs: CUDA when present (device auto / cuda), else this CPU."""
    if device in ("auto", "cuda", "gpu") and torch.cuda.is_available():
        return cuda_has_bf16()
    return cpu_has_native_bf16()


def auto_precision(device: str = "auto") -> str:
    """Lightning's precision for `auto`: bf16-mixed where bfloat16 is native, 32-true elsewhere."""
    return "bf16-mixed" if bf16_is_native(device) else "32-true"


def describe_cpu() -> str:
    """`<model name>, <n> cores, <instruction sets>` for logs and result tables: a machine named by what it is."""
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
    cap = onednn_isa_cap()
    capped = f" (oneDNN capped at {cap})" if cap else ""
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa) or 'no AVX2'}{capped}"
