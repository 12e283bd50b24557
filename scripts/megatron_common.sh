# Sourced by the A/B launch scripts: builds Megatron-LM argument arrays from a config in configs/
# and environment knobs. Every variant gets the same MODEL_ARGS / TRAINING_ARGS / DATA_ARGS /
# LOGGING_ARGS; only MODEL_PARALLEL_ARGS differ (tsp | tp | tsp_mlp | cp).
#
# Knobs (environment):
#   MEGATRON_LM_PATH   Megatron-LM checkout (required; contains pretrain_gpt.py)
#   CONFIG             config name in configs/ or a JSON path      (default tiny-cpu)
#   TSP_SIZE           D: TSP size = TP size = CP size of the A/B   (default: the config's)
#   SEQ_LENGTH         override model.seq_length
#   MICRO_BATCH        override training.micro_batch_size
#   GLOBAL_BATCH       override training.global_batch_size
#   TRAIN_ITERS        override training.train_iters
#   DATA_PATH          Megatron data prefix(es); unset -> --mock-data
#   TOKENIZER_ARGS     tokenizer flags (default: NullTokenizer with the config's vocab size)
#   EXTRA_ARGS         appended to every variant (same for all)
#   LOG_DIR            where <variant>.log go                       (default ./ab_logs)
#   PYTHON             python executable                            (default python)
set -euo pipefail

_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TSP_REPO="${TSP_REPO:-$(cd "${_here}/.." && pwd)}"
PYTHON="${PYTHON:-python}"
CONFIG="${CONFIG:-tiny-cpu}"
LOG_DIR="${LOG_DIR:-$PWD/ab_logs}"
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (with pretrain_gpt.py)}"
if [[ ! -f "${MEGATRON_LM_PATH}/pretrain_gpt.py" ]]; then
    echo "error: ${MEGATRON_LM_PATH}/pretrain_gpt.py not found" >&2
    exit 2
fi
export PYTHONPATH="${TSP_REPO}${PYTHONPATH:+:${PYTHONPATH}}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

_sets=()
[[ -n "${SEQ_LENGTH:-}" ]] && _sets+=(--set "model.seq_length=${SEQ_LENGTH}")
[[ -n "${MICRO_BATCH:-}" ]] && _sets+=(--set "training.micro_batch_size=${MICRO_BATCH}")
[[ -n "${GLOBAL_BATCH:-}" ]] && _sets+=(--set "training.global_batch_size=${GLOBAL_BATCH}")
[[ -n "${TRAIN_ITERS:-}" ]] && _sets+=(--set "training.train_iters=${TRAIN_ITERS}")
_size=()
[[ -n "${TSP_SIZE:-}" ]] && _size=(--size "${TSP_SIZE}")

_cfg() { "${PYTHON}" -m megatron_tsp.megatron_lm.configs "${CONFIG}" "${_sets[@]}" --lines "$@"; }

mapfile -t MODEL_ARGS < <(_cfg --part model)
mapfile -t TRAINING_ARGS < <(_cfg --part training)
VOCAB_SIZE="$(_cfg --get model.vocab_size)"
if [[ -n "${DATA_PATH:-}" ]]; then
    read -r -a DATA_ARGS <<< "--data-path ${DATA_PATH} --split 949,50,1"
else
    DATA_ARGS=(--mock-data)
fi
if [[ -n "${TOKENIZER_ARGS:-}" ]]; then
    read -r -a TOKENIZER <<< "${TOKENIZER_ARGS}"
else
    TOKENIZER=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE}")
fi
LOGGING_ARGS=(--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 1000000)
EXTRA=()
[[ -n "${EXTRA_ARGS:-}" ]] && read -r -a EXTRA <<< "${EXTRA_ARGS}"

# parallel_args VARIANT -> MODEL_PARALLEL_ARGS (the only difference between the variants)
parallel_args() {
    mapfile -t MODEL_PARALLEL_ARGS < <(_cfg --part parallel --variant "$1" "${_size[@]}")
}

# entry VARIANT -> ENTRY: TSP goes through the launcher, the baselines run stock pretrain_gpt.py.
entry() {
    if [[ "$1" == "tsp" || "$1" == "tsp_mlp" ]]; then
        ENTRY=(-m megatron_tsp.launch "${MEGATRON_LM_PATH}/pretrain_gpt.py")
    else
        ENTRY=("${MEGATRON_LM_PATH}/pretrain_gpt.py")
    fi
}

common_args() {
    COMMON_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${TOKENIZER[@]}"
                 "${LOGGING_ARGS[@]}" "${EXTRA[@]}")
}
