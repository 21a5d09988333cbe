#!/usr/bin/env bash
# The quick main job on the AMX Xeon, no caps: the same-host baseline of the AVX2-emulated run before it; a fresh
# clone, an empty cache folder, each line prefixed with seconds since the start.
set -u
rm -rf /work/fresh_amx /work/scratch/amx_cache && git clone -q /work/main /work/fresh_amx
ln -s /work/main/.venv /work/fresh_amx/.venv
cd /work/fresh_amx && . .venv/bin/activate
start=$(date +%s)
PERSRAG_CACHE=/work/scratch/amx_cache /usr/bin/time -v \
  python train.py pipeline --preset quick 2>&1 | while IFS= read -r line; do
    printf '%6ds %s\n' $(( $(date +%s) - start )) "$line"; done
