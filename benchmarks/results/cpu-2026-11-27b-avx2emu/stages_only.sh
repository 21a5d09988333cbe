#!/bin/bash
# AVX2-only CPU emulated; the quick pipeline's stages, stopped when the dev choice starts; every line timestamped.
cd /work/fresh5
export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 PERSRAG_CACHE=/tmp/empty-cache
start=$(date +%s)
.venv/bin/python -u train.py pipeline --preset quick --run_name synthlamp-quick-seed1 --seed_everything=1 --llm-backend hf 2>&1 | while IFS= read -r line; do
  printf '%6ds %s\n' $(( $(date +%s) - start )) "$line"
  case "$line" in "[evaluate 1/2]"*) pkill -f "train.py pipeline --preset quick --run_name synthlamp-quick-seed1" ;; esac
done
