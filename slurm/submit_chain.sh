#!/usr/bin/env bash
# Submit CFRAG's stage chain; each job starts only if the one before it succeeded (--dependency=afterok):
#   stage 1 fit → stage-2 feedback array → stage 2 fit → stage-3 feedback array → stage 3 fit
# The feedback arrays label with the export of the stage before (checkpoints/<run_name>/...), so the chain
# shares one --run_name.
#
#   slurm/submit_chain.sh --run_name synthlamp                 # arguments here go to every stage
#   SHARDS=8 TRAIN_SBATCH="--ntasks-per-node=4 --gres=gpu:4" slurm/submit_chain.sh --run_name lamp2
#
# Environment: STAGE{1,2,3}_CONFIG (cfrag_user_encoder.yaml, cfrag_retriever.yaml, cfrag_reranker.yaml),
# STAGE{1,2,3}_ARGS (CLI arguments of one stage only), SHARDS (feedback array size, 4), TRAIN_SBATCH and
# FEEDBACK_SBATCH (extra sbatch options), FIRST_DEPENDENCY (e.g. afterok:1234 to wait for another job),
# SBATCH (the sbatch program). Run from the repository root; prints the job ids, the last line is stage 3's.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SBATCH="${SBATCH:-sbatch}"
SHARDS="${SHARDS:-4}"
S1="${STAGE1_CONFIG:-cfrag_user_encoder.yaml}"
S2="${STAGE2_CONFIG:-cfrag_retriever.yaml}"
S3="${STAGE3_CONFIG:-cfrag_reranker.yaml}"

submit() {  # submit <dependency or ""> <sbatch options...> -- <script and its arguments...>; prints the job id
    local dep="$1"
    shift
    local opts=()
    while [[ "$1" != "--" ]]; do opts+=("$1"); shift; done
    shift
    [[ -n "$dep" ]] && opts+=("--dependency=$dep" "--kill-on-invalid-dep=yes")
    "$SBATCH" --parsable "${opts[@]}" "$@" | cut -d';' -f1
}

# shellcheck disable=SC2086  # the *_SBATCH and STAGE*_ARGS variables are whitespace-separated lists
{
j1=$(submit "${FIRST_DEPENDENCY:-}" ${TRAIN_SBATCH:-} -- "$HERE/train.sbatch" "$S1" "$@" ${STAGE1_ARGS:-})
echo "stage 1 fit ($S1): job $j1"
f2=$(submit "afterok:$j1" --array="0-$((SHARDS - 1))" ${FEEDBACK_SBATCH:-} -- \
     "$HERE/feedback_array.sbatch" "$S2" "$@" ${STAGE2_ARGS:-})
echo "stage 2 feedback ($S2, $SHARDS shards): job $f2"
j2=$(submit "afterok:$f2" ${TRAIN_SBATCH:-} -- "$HERE/train.sbatch" "$S2" "$@" ${STAGE2_ARGS:-})
echo "stage 2 fit ($S2): job $j2"
f3=$(submit "afterok:$j2" --array="0-$((SHARDS - 1))" ${FEEDBACK_SBATCH:-} -- \
     "$HERE/feedback_array.sbatch" "$S3" "$@" ${STAGE3_ARGS:-})
echo "stage 3 feedback ($S3, $SHARDS shards): job $f3"
j3=$(submit "afterok:$f3" ${TRAIN_SBATCH:-} -- "$HERE/train.sbatch" "$S3" "$@" ${STAGE3_ARGS:-})
echo "stage 3 fit ($S3): job $j3"
}
