#!/usr/bin/env bash
# The script that ran this folder's commands and cpu-2026-12-02b-gemm-avx2emu's, one after the other, from the
# repository root (the main venv active, PYTHONPATH the checkout); the load average before and after each is kept,
# the machine being shared with two other sessions' jobs. Run after it, alone, with the same load lines: the reader's
# command of cpu-2026-12-02b-gemm-avx2emu again (bench_reader.py had let the runtime policy's line split its table),
# then this folder's reader_gemm.md:
#   python benchmarks/bench_reader.py --gemm openvino,onnxruntime --prompts 24 --llamacpp_weights '' \
#     > $here/reader_gemm.md 2> $here/reader_gemm.err
set -uo pipefail
here=benchmarks/results/cpu-2026-12-02-gemm
capped=benchmarks/results/cpu-2026-12-02b-gemm-avx2emu
load() { echo "$1 $(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)"; }
{
  load "gemm.md before"
  python benchmarks/bench_gemm.py > $here/gemm.md 2> $here/gemm.err
  load "gemm.md after"
} >> $here/load_average.txt
{
  load "gemm_avx2.md before"
  ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell \
    python benchmarks/bench_gemm.py --paths torch,torch-kn,onednn,numpy > $capped/gemm_avx2.md 2> $capped/gemm_avx2.err
  load "gemm_avx2.md after"
  load "reader_gemm_avx2.md before"
  ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell \
    python benchmarks/bench_reader.py --gemm torch-kn,onednn,numpy --prompts 24 --llamacpp_weights '' \
    > $capped/reader_gemm_avx2.md 2> $capped/reader_gemm_avx2.err
  load "reader_gemm_avx2.md after"
} >> $capped/load_average.txt
