#!/usr/bin/env bash
# The quick main job on the AMX Xeon with oneDNN capped at AVX512_CORE_BF16 (a CPU with AVX512-BF16 but no AMX,
# emulated): a fresh clone, an empty cache folder, each line prefixed with seconds since the start.
set -u
rm -rf /work/fresh_noamx2 /work/scratch/noamx2_cache && git clone -q /work/main /work/fresh_noamx2
ln -s /work/main/.venv /work/fresh_noamx2/.venv
cd /work/fresh_noamx2 && . .venv/bin/activate
start=$(date +%s)
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 PERSRAG_CACHE=/work/scratch/noamx2_cache /usr/bin/time -v \
  python train.py pipeline --preset quick 2>&1 | while IFS= read -r line; do
    printf '%6ds %s\n' $(( $(date +%s) - start )) "$line"; done
