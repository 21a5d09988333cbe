#!/usr/bin/env bash
# The test install (CONTRIBUTING.md; .ci/run runs it): the main job's install (.ci/install.sh), then the test
# tooling. Into .venv: the dev, docs, onnx, openvino, constrained, serve, memory and wandb extras and
# llama-cpp-python compiled for this CPU. System-wide, with apt (root or sudo): Chromium and its driver for the chat
# page's browser test, and Slurm, munge and iproute2 for the Slurm tests (.ci/install_slurm.sh); where apt or root is
# missing they are not installed and those tests skip, saying why. It says what it installs system-wide before it
# does.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "install_tests.sh: into .venv: the package's dev, docs, onnx, openvino, constrained, serve, memory and wandb extras," \
     "llama-cpp-python (compiled here, several minutes)"
echo "install_tests.sh: system-wide, with apt where root or sudo allows (else those tests skip):" \
     "chromium chromium-driver (the browser test), slurm-wlm munge iproute2 util-linux (the Slurm tests)"
bash .ci/install.sh
. .venv/bin/activate
# onnx, openvino: the reranker in ONNX Runtime / OpenVINO (their tests skip without; OpenVINO serves by default);
# constrained: lm-format-enforcer (JSON-schema decoding under transformers; pure Python, torch stays as pinned);
# serve, memory: the chat service and the memory bank; wandb: the W&B logger's test; docs: mkdocs for the site
# build; dev: pytest, ruff, import-linter and the tests' own tools
python -m pip install -q -e ".[embedded,dev,docs,onnx,openvino,constrained,serve,memory,wandb]"
# llama-cpp-python (the fast CPU LLM path and the OpenAI-compatible server the tests run on loopback), compiled
# for the instruction sets this CPU reports in /proc/cpuinfo, never AMX: some Intel VMs show AMX but trap on
# it, and a fixed list is wrong elsewhere (AVX-VNNI on a Zen 4 EPYC, which has AVX512-VNNI but not the VEX form:
# "Illegal instruction" in the Q4_1 kernel). -march=native (GGML_NATIVE) would take AMX.
if ! python -c "import llama_cpp" 2>/dev/null; then
  cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  ggml_args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  for pair in AVX:avx AVX2:avx2 FMA:fma F16C:f16c BMI2:bmi2 AVX512:avx512f AVX512_VBMI:avx512vbmi \
              AVX512_VNNI:avx512_vnni AVX512_BF16:avx512_bf16 AVX_VNNI:avx_vnni; do
    case "$cpu_flags" in *" ${pair#*:} "*) on=ON ;; *) on=OFF ;; esac
    ggml_args="$ggml_args -DGGML_${pair%%:*}=$on"
  done
  echo "install_tests.sh: llama.cpp build flags: $ggml_args"
  CMAKE_ARGS="$ggml_args" python -m pip install -q --no-cache-dir "llama-cpp-python[server]==0.3.36"
fi
# Debian's chromium + its driver for the chat page's browser test (tests/serving/test_serve_browser.py skips, saying
# why, where they cannot be installed: no root or no apt).
if ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install_tests.sh: apt-get install chromium chromium-driver (system-wide)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
      || echo "install_tests.sh: chromium/chromium-driver not installed; the browser test will skip" >&2
  else
    echo "install_tests.sh: no root/apt; chromium not installed, the browser test will skip" >&2
  fi
fi
bash .ci/install_slurm.sh                         # slurm-wlm + munge for tests/training/test_slurm.py (skips without root/apt)
