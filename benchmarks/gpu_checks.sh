#!/usr/bin/env bash
# The GPU checks, from the repository root of a CUDA machine, after
# `python3 benchmarks/gpu_payload.py unpack --site /tmp/site` (docs/training/gpu.md). Each step's output goes to
# $OUT/<step>.txt (default benchmarks/results/gpu-checks/); a failing step is reported and the next one runs.
#
#   bash benchmarks/gpu_checks.sh [STEP...]   # default: machine tests llm retrieval feedback
# machine: GPU, CPU, versions; tests: the faiss-gpu and vLLM tests of tests/training/test_gpu.py; llm: vLLM's rows next to the
# hf ones (bench_llm.py); retrieval: faiss-gpu flat and IVF at 1M users (bench_retrieval.py); feedback: stage 1, then
# stage 2 of --preset full-feedback with its labels from vLLM; mainjob (not in the default list): the whole
# `pipeline --preset $PRESET` (default full-feedback) for seed $SEED (default 0), its tables, dev choice and
# pipeline.json copied beside its log.
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# no network there: nothing may wait on the Hub, vLLM's usage statistics or wandb
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 WANDB_MODE=disabled
# the payload carries no FlashInfer: vLLM's sampler would import it (greedy answers and prompt logprobs need none)
export VLLM_USE_FLASHINFER_SAMPLER=0

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

run_step() {
    case "$1" in
    machine) step machine machine ;;
    tests) step gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/training/test_gpu.py -k "faiss_gpu or vllm" ;;
    llm) step bench_llm python3 benchmarks/bench_llm.py --quick --tasks LaMP-2 --prompts 64 --batch-sizes 64 \
        --backends hf vllm ;;
    retrieval) step bench_retrieval python3 benchmarks/bench_retrieval.py --sizes 1000000 --vectors gaussian \
        --kinds flat-gpu ivf-gpu --threads 16 ;;
    feedback)
        local common=(--run_name=gpu-vllm --export_root=checkpoints --trainer.enable_progress_bar=false)
        step stage1 python3 train.py fit --config cfrag_user_encoder.yaml --trainer.max_epochs=20 \
            --model.init_args.config.judgments=paired "${common[@]}"
        step stage2_vllm python3 train.py fit --config cfrag_retriever.yaml \
            --data.init_args.feedback.metric=loglik --data.init_args.feedback.llm.batch_size=64 \
            --data.init_args.feedback.llm.backend=vllm "${common[@]}" ;;
    mainjob)
        local preset=${PRESET:-full-feedback} seed=${SEED:-0}
        local run=synthlamp-$preset
        [ "$seed" = 0 ] || run=synthlamp-$preset-s$seed
        step "pipeline_$run" python3 train.py pipeline --preset "$preset" --run_name "$run" --seed_everything="$seed"
        cp "runs/$run/evaluate/results.md" "$OUT/results_$run.md"
        cp "runs/$run/evaluate/metrics.json" "$OUT/metrics_$run.json"
        cp "runs/$run/select-on-dev/results.md" "$OUT/select_on_dev_$run.md"
        cp "checkpoints/$run/pipeline.json" "$OUT/pipeline_$run.json" ;;
    *) echo "unknown step $1 (machine, tests, llm, retrieval, feedback, mainjob)" >&2; exit 2 ;;
    esac
}

for name in "${@:-machine tests llm retrieval feedback}"; do
    for one in $name; do run_step "$one"; done
done
