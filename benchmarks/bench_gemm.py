"""The float32 GEMM paths of this CPU at the reader's and the encoders' shapes, against the CPU's float32 peak.

Every path of persrag_lightning/runtime.py (the runtime policy chooses among them at the start of a run): torch's
linear (MKL), MKL on the weight stored transposed, oneDNN's linear on a packed weight, numpy's matmul (OpenBLAS),
OpenVINO and ONNX Runtime on a one-MatMul model; each on 1 and 2 threads (--threads), at the shapes the policy
measures (runtime.GEMM_SHAPES: SmolLM2-135M's MLP on a batch of main-job prompts, MiniLM's feed-forward and
attention projections on a batch of texts). A cell is GFLOP/s (2 x rows x in x out per call), the best of
--rounds calls after a warm-up, over --repeats passes that interleave the paths (a loaded machine's noise only
slows, and interleaving spreads it over every path alike).

The peak it assumes: threads x clock x float32 FLOP per cycle per core, read off this CPU: AVX-512 with FMA 64
(16 lanes x 2 for the fused multiply-add x 2 FMA units), AVX2 with FMA 32, AVX without FMA 16. The clock is
/proc/cpuinfo's `cpu MHz` of the first CPU (in a virtual machine, the frequency the hypervisor reports; a turbo
clock above it is not counted, so a path can pass 100 %), or --ghz. An instruction-set cap in the environment
(`ATEN_CPU_CAPABILITY=avx2`, `MKL_ENABLE_INSTRUCTIONS=AVX2`, `ONEDNN_MAX_CPU_ISA=AVX2`) sets the AVX2 peak and is
printed in the table's title: such a run emulates the instruction sets of an AVX2-only CPU, not its
microarchitecture, and only the paths that honour the caps belong in it (--paths torch,torch-kn,onednn,numpy with
OPENBLAS_CORETYPE=Haswell for numpy). Prints Markdown; asserts nothing about time.

    python benchmarks/bench_gemm.py
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell python benchmarks/bench_gemm.py --paths torch,torch-kn,onednn,numpy
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch

from persrag_lightning.hardware import cpu_flags, describe_cpu
from persrag_lightning.runtime import GEMM_SHAPES, PATHS, gemm_seconds, gflops

CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def capped_at_avx2() -> list[str]:
    """The instruction-set caps to AVX2 set in this environment, as `NAME=value`."""
    return [f"{k}={os.environ[k]}" for k, v in CAPS.items() if os.environ.get(k, "").upper() == v.upper()]


def flop_per_cycle() -> tuple[int, str]:
    """float32 FLOP per cycle per core that this CPU's instruction sets allow, and which sets they are."""
    flags = cpu_flags() or frozenset()
    if "avx512f" in flags and "fma" in flags and not capped_at_avx2():
        return 64, "AVX-512 FMA, 2 units: 16 lanes x 2 x 2"
    if "avx2" in flags and "fma" in flags:
        return 32, "AVX2 FMA, 2 units: 8 lanes x 2 x 2"
    return 16, "AVX without FMA: 8 lanes x 2 (a multiply and an add)"


def clock_ghz(given: float | None) -> tuple[float, str]:
    """The clock the peak assumes, and where it was read."""
    if given is not None:
        return given, "--ghz"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":", 1)[1]) / 1000, "/proc/cpuinfo cpu MHz"
    except OSError:
        pass
    raise SystemExit("bench_gemm: no clock in /proc/cpuinfo here; pass --ghz")


def measure(paths: list[str], threads: list[int], rounds: int, repeats: int) -> tuple[dict, dict[str, str]]:
    """GFLOP/s by (path, threads, consumer, shape): the best over `repeats` interleaved passes; failed paths."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(consumer, shape) for consumer, dims in GEMM_SHAPES.items() for shape in dims]
    data = {shape: (torch.randn(shape[0], shape[1], generator=gen), torch.randn(shape[2], shape[1], generator=gen)
                    / shape[1] ** 0.5, torch.randn(shape[2], generator=gen)) for _, shape in shapes}
    best: dict[tuple, float] = {}
    failed: dict[str, str] = {}
    for _ in range(repeats):
        for n in threads:
            torch.set_num_threads(n)
            for name in (p for p in paths if p not in failed):
                try:
                    for consumer, shape in shapes:
                        x, w, b = data[shape]
                        seconds = gemm_seconds(name, PATHS[name].prepare(w, b, n), x, rounds)
                        key = (name, n, consumer, shape)
                        best[key] = max(best.get(key, 0.0), gflops((shape,), seconds))
                except Exception as err:  # noqa: BLE001 - a path that cannot load here is a row saying so
                    failed[name] = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
    return best, failed


def consumer_rate(best: dict, name: str, n: int, consumer: str) -> float:
    """One pass over the consumer's shapes at each shape's best rate."""
    dims = GEMM_SHAPES[consumer]
    return gflops(dims, sum(gflops((s,), 1.0) / best[(name, n, consumer, s)] for s in dims))


def table(best: dict, failed: dict[str, str], paths: list[str], threads: list[int], ghz: float, per_cycle: int) -> str:
    shapes = [(c, s) for c, dims in GEMM_SHAPES.items() for s in dims]
    head = ["path", "threads", *(f"{c} [{r}x{i}]·[{i}x{o}]" for c, (r, i, o) in shapes),
            "reader, % of peak", "encoders, % of peak", "peak assumed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in paths:
        if name in failed:
            lines.append(f"| {name} | – | " + " | ".join(["skipped"] * len(shapes)) + f" | {failed[name]} | | |")
            continue
        for n in threads:
            peak = n * ghz * per_cycle
            cells = [f"{best[(name, n, c, s)]:.0f}" for c, s in shapes]
            cells += [f"{100 * consumer_rate(best, name, n, c) / peak:.0f} %" for c in GEMM_SHAPES]
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + f" | {peak:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per cell and pass, after a warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes over every path")
    parser.add_argument("--ghz", type=float, default=None, help="the clock the peak assumes (default: read)")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; use {', '.join(PATHS)}")
    threads = [int(n) for n in args.threads.split(",")]
    ghz, source = clock_ghz(args.ghz)
    per_cycle, isa = flop_per_cycle()
    caps = capped_at_avx2()
    import numpy

    print(f"Machine: {describe_cpu()}; torch {torch.__version__}, numpy {numpy.__version__}, Python "
          f"{platform.python_version()}")
    print(f"Peak assumed: threads x {ghz:.2f} GHz ({source}) x {per_cycle} float32 FLOP/cycle ({isa})"
          + (f"; capped at AVX2 by {' '.join(caps)} (instruction sets emulated, not the microarchitecture)"
             if caps else ""))
    for name in paths:
        print(f"- {name}: {PATHS[name].what}")
    best, failed = measure(paths, threads, args.rounds, args.repeats)
    print(f"\nGFLOP/s per shape ([rows x in]·[in x out]), best of {args.rounds} calls x {args.repeats} passes; "
          "% of peak: one pass over the consumer's shapes\n")
    print(table(best, failed, paths, threads, ghz, per_cycle))


if __name__ == "__main__":
    main()
