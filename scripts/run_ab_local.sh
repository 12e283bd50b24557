#!/usr/bin/env bash
# Local A/B with torchrun on one node: the same model / data / training arguments per variant,
# differing only in the parallel arguments. One log per variant in $LOG_DIR, then a comparison.
#
#   MEGATRON_LM_PATH=/path/to/Megatron-LM CONFIG=llama3-8b-32k NPROC=8 scripts/run_ab_local.sh
#
# Knobs: see scripts/megatron_common.sh (data, tokenizer, DIST_OPT, CKPT_DIR / LOAD_DIR /
# SAVE_INTERVAL, TENSORBOARD_DIR, TORCHRUN_ARGS, ...), plus
#   NPROC        GPUs (processes) on this node          (default: the config's gpus_per_node)
#   VARIANTS     subset of "tsp tp tsp_mlp cp"          (default "tsp tp")
#   MASTER_PORT  torchrun rendezvous port               (default 29500)
#   DRY_RUN=1    only validate through Megatron's argument code and build one rank on the meta
#                device (python -m megatron_tsp.megatron_lm.launch ... --tsp-dry-run; no GPU needed)
source "$(dirname "${BASH_SOURCE[0]}")/megatron_common.sh"

NPROC="${NPROC:-$(_cfg --get parallel.gpus_per_node)}"
VARIANTS="${VARIANTS:-tsp tp}"
MASTER_PORT="${MASTER_PORT:-29500}"
mkdir -p "${LOG_DIR}"
# every variant checked against what this box offers before the first one runs
for variant in ${VARIANTS}; do
    box_args "${variant}"
done

logs=()
for variant in ${VARIANTS}; do
    variant_args "${variant}"
    box_notice "${variant}"
    log="${LOG_DIR}/${variant}.log"
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        cmd=("${PYTHON}" -m megatron_tsp.megatron_lm.launch "${MEGATRON_LM_PATH}/pretrain_gpt.py"
             "${VARIANT_ARGS[@]}" --tsp-dry-run --tsp-dry-run-world-size "${NPROC}")
    else
        entry "${variant}"
        cmd=(torchrun --nproc-per-node "${NPROC}" --master-port "${MASTER_PORT}"
             "${TORCHRUN_EXTRA[@]}" "${ENTRY[@]}" "${VARIANT_ARGS[@]}")
    fi
    echo "[ab] ${variant}: ${cmd[*]}" | tee "${log}"
    "${cmd[@]}" 2>&1 | tee -a "${log}"
    if [[ -n "${TENSORBOARD_DIR:-}" && "${DRY_RUN:-0}" != "1" ]]; then
        logs+=("${variant}=${TENSORBOARD_DIR}/${variant}")
    else
        logs+=("${variant}=${log}")
    fi
done

if [[ "${DRY_RUN:-0}" != "1" ]]; then
    "${PYTHON}" -m megatron_tsp.megatron_lm.compare "${logs[@]}" --png "${LOG_DIR}/loss.png"
fi
