#!/usr/bin/env bash
# The quick main job on the AMX Xeon capped at AVX2 (an AVX2-only CPU emulated): torch, oneDNN and MKL capped, and
# llama-cpp-python compiled a second time for AVX2/FMA/F16C only (put first on PYTHONPATH), so `backend: auto`
# measures the labels' backends as on such a CPU; a fresh clone, an empty cache folder, each line prefixed with
# seconds since the start. Extra arguments go to the pipeline (seed 1: --run_name synthlamp-quick-seed1 --seed_everything=1).
set -u
rm -rf /work/fresh_avx2 /work/scratch/avx2_cache && git clone -q /work/main /work/fresh_avx2
ln -s /work/main/.venv /work/fresh_avx2/.venv
cd /work/fresh_avx2 && . .venv/bin/activate
git log --oneline | head -1
start=$(date +%s)
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 PYTHONPATH=/work/llama_avx2 \
  PERSRAG_CACHE=/work/scratch/avx2_cache /usr/bin/time -v \
  python train.py pipeline --preset quick "$@" 2>&1 | while IFS= read -r line; do
    printf '%6ds %s\n' $(( $(date +%s) - start )) "$line"; done
