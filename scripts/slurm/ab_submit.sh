#!/usr/bin/env bash
# Submit the A/B as one SLURM job per variant: the same model / data / training arguments, only
# the parallel arguments differ (tsp: --tensor-sequence-parallel-size D; tp: --tensor-model-
# parallel-size D --sequence-parallel; cp: --context-parallel-size D --use-distributed-optimizer).
#
#   MEGATRON_LM_PATH=/path/to/Megatron-LM CONFIG=paper-7b-128k NODES=1 GPUS_PER_NODE=8 \
#       scripts/slurm/ab_submit.sh
#
# Knobs: scripts/megatron_common.sh (data, tokenizer, DIST_OPT, CKPT_DIR / LOAD_DIR / SAVE_INTERVAL,
# TENSORBOARD_DIR, SRUN_ARGS for containers / GPU binding, TORCHRUN_ARGS), plus NODES,
# GPUS_PER_NODE, VARIANTS ("tsp tp"), LAUNCH_MODE (srun | torchrun), PARTITION, ACCOUNT, TIME,
# SBATCH_EXTRA (sbatch options, split on whitespace). The job inherits the environment
# (--export=ALL). Logs: $LOG_DIR/<variant>.log. Afterwards: scripts/compare.sh
# tsp=$LOG_DIR/tsp.log tp=$LOG_DIR/tp.log --png $LOG_DIR/loss.png (or the TensorBoard directories
# $TENSORBOARD_DIR/<variant>)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export TSP_REPO="$(cd "${here}/../.." && pwd)"
source "${TSP_REPO}/scripts/megatron_common.sh"   # validates the knobs before submitting

NODES="${NODES:-$(_cfg --get parallel.nodes)}"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(_cfg --get parallel.gpus_per_node)}"
VARIANTS="${VARIANTS:-tsp tp}"
mkdir -p "${LOG_DIR}"
opts=(--nodes "${NODES}" --ntasks-per-node "${GPUS_PER_NODE}" --gpus-per-node "${GPUS_PER_NODE}")
[[ -n "${PARTITION:-}" ]] && opts+=(--partition "${PARTITION}")
[[ -n "${ACCOUNT:-}" ]] && opts+=(--account "${ACCOUNT}")
[[ -n "${TIME:-}" ]] && opts+=(--time "${TIME}")
extra=()
[[ -n "${SBATCH_EXTRA:-}" ]] && read -r -a extra <<< "${SBATCH_EXTRA}"
if [[ "${LAUNCH_MODE:-srun}" == "torchrun" ]]; then
    opts[3]=1   # one task per node; torchrun starts the GPU processes
fi

export MEGATRON_LM_PATH CONFIG LOG_DIR GPUS_PER_NODE PYTHON
for variant in ${VARIANTS}; do
    jobid=$(VARIANT="${variant}" sbatch --parsable "${opts[@]}" "${extra[@]}" \
        --job-name "tsp-ab-${variant}" --output "${LOG_DIR}/${variant}.log" \
        --export=ALL,VARIANT="${variant}" "${here}/train.sbatch")
    echo "submitted ${variant}: job ${jobid} -> ${LOG_DIR}/${variant}.log"
done
echo "compare: ${TSP_REPO}/scripts/compare.sh $(for v in ${VARIANTS}; do printf '%s=%s ' "$v" "${LOG_DIR}/$v.log"; done)--png ${LOG_DIR}/loss.png"
