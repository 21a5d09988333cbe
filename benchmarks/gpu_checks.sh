#!/usr/bin/env bash
# The GPU checks of one lease, from the repository root of a CUDA machine, after
# `python3 benchmarks/gpu_payload.py unpack --site /tmp/site` (docs/training/gpu.md). Each step's output goes to
# $OUT/<step>.txt (default benchmarks/results/gpu-checks/); a failing step is reported and the next one runs.
#
#   bash benchmarks/gpu_checks.sh search   # machine, faiss-gpu + vLLM tests, faiss-gpu at 1M users, vLLM vs hf rows
#   bash benchmarks/gpu_checks.sh feedback # stage 1, then stage 2 of --preset full-feedback with vLLM's labels
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# no network there: nothing may wait on the Hub, vLLM's usage statistics or wandb
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 WANDB_MODE=disabled

step() {  # step NAME COMMAND...: run, keep its output, say how it ended and how long it took
    local name=$1 start=$SECONDS
    shift
    echo "== $name: $*" | tee "$OUT/$name.txt"
    "$@" 2>&1 | tee -a "$OUT/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$OUT/$name.txt"
}

machine() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    lscpu | grep -E "^(Model name|CPU\(s\))"
    python3 - <<'EOF'
import faiss, torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"faiss {faiss.__version__} (GPUs {faiss.get_num_gpus() if hasattr(faiss, 'get_num_gpus') else 0})")
try:
    import vllm
    print(f"vllm {vllm.__version__}")
except Exception as err:  # reported, the other steps still run
    print(f"vllm does not import: {err!r}")
EOF
}

case "${1:-search}" in
search)
    step machine machine
    step gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "faiss_gpu or vllm"
    step bench_retrieval python3 benchmarks/bench_retrieval.py --sizes 1000000 --vectors gaussian \
        --kinds flat-gpu ivf-gpu --threads 16
    step bench_llm python3 benchmarks/bench_llm.py --quick --tasks LaMP-2 --prompts 64 --batch-sizes 64 \
        --backends hf vllm
    ;;
feedback)
    common=(--run_name=gpu-vllm --export_root=checkpoints --trainer.enable_progress_bar=false)
    step stage1 python3 train.py fit --config cfrag_user_encoder.yaml --trainer.max_epochs=20 \
        --model.init_args.judgments=paired "${common[@]}"
    step stage2_vllm python3 train.py fit --config cfrag_retriever.yaml --data.init_args.feedback_metric=loglik \
        --data.init_args.llm.batch_size=64 --data.init_args.llm.backend=vllm "${common[@]}"
    ;;
*)
    echo "usage: bash benchmarks/gpu_checks.sh search|feedback" >&2
    exit 2
    ;;
esac
