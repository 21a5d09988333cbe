cd "$(git rev-parse --show-toplevel)" && . .venv/bin/activate
D=benchmarks/results
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/bench_reader.py --int8 --llamacpp_weights '' > $D/cpu-2026-11-28-reader-int8-avx2emu/reader_int8_avx2.md 2> $D/cpu-2026-11-28-reader-int8-avx2emu/reader_int8_avx2.err
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 FBGEMM_ENABLE_INSTRUCTIONS=AVX512_E1 python benchmarks/bench_reader.py --int8 --llamacpp_weights '' > $D/cpu-2026-11-28-reader-int8-noamx/reader_int8_avx512bf16_noamx.md 2> $D/cpu-2026-11-28-reader-int8-noamx/reader_int8_avx512bf16_noamx.err
