# Sourced by the A/B launch scripts: builds Megatron-LM argument arrays from a config in configs/
# and environment knobs. Every variant gets the same MODEL_ARGS / TRAINING_ARGS / DATA_ARGS /
# TOKENIZER / LOGGING_ARGS / OPTIMIZER_ARGS; only MODEL_PARALLEL_ARGS differ (tsp | tp | tsp_mlp | cp), plus
# the per-variant output directories (OUTPUT_ARGS: checkpoints, TensorBoard).
#
# Knobs (environment):
#   MEGATRON_LM_PATH   Megatron-LM checkout (required; contains pretrain_gpt.py)
#   CONFIG             config name in configs/ or a JSON path      (default tiny-cpu)
#   TSP_SIZE           D: TSP size = TP size = CP size of the A/B   (default: the config's)
#   SEQ_LENGTH         override model.seq_length
#   MICRO_BATCH        override training.micro_batch_size
#   GLOBAL_BATCH       override training.global_batch_size
#   TRAIN_ITERS        override training.train_iters
#   DIST_OPT           1: --use-distributed-optimizer in every variant (default); 0: not added
#   DATA_PATH          Megatron data prefix(es): "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..."
#                      (unset -> --mock-data)
#   SPLIT              --split with DATA_PATH                        (default 949,50,1)
#   DATA_CACHE_PATH    --data-cache-path (index cache of the dataset builders)
#   TOKENIZER_MODEL    --tokenizer-model: a Hugging Face name/path or a SentencePiece / TikToken
#                      model file (tokenizer type: TOKENIZER_TYPE, default HuggingFaceTokenizer)
#   VOCAB_FILE, MERGE_FILE  GPT-2 BPE files (tokenizer type GPT2BPETokenizer)
#   TOKENIZER_TYPE     --tokenizer-type for the two above
#   TOKENIZER_ARGS     the tokenizer flags verbatim (overrides the three above; default without
#                      any: NullTokenizer with the config's vocab size)
#   CKPT_DIR           --save CKPT_DIR/<variant> --save-interval SAVE_INTERVAL, and --load of the
#                      same directory (resume) unless LOAD_DIR is set
#   SAVE_INTERVAL      iterations between checkpoints                (default 1000)
#   LOAD_DIR           --load LOAD_DIR in every variant (TSP and TP=D+SP checkpoints are
#                      interchangeable: a TSP checkpoint resumes under TP and the reverse)
#   TENSORBOARD_DIR    --tensorboard-dir TENSORBOARD_DIR/<variant> with timers, throughput, memory
#                      and world size logged there (scripts/compare.sh reads these directories)
#   EXTRA_ARGS         appended to every variant (same for all)
#   LOG_DIR            where <variant>.log go                       (default ./ab_logs)
#   PYTHON             python executable                            (default python)
#   HAVE_TE, HAVE_APEX 1 / 0: whether the training Python has Transformer Engine / apex (default:
#                      probed). Without TE the tp variant runs Megatron's local layers (and,
#                      without apex, the project's TP+SP spec through the launcher); cp is refused
#   TORCHRUN_ARGS      extra torchrun options (run_ab_local.sh, LAUNCH_MODE=torchrun)
#   SRUN_ARGS          extra srun options for the training step (scripts/slurm): containers,
#                      GPU binding, e.g. "--container-image=img.sqsh --container-mounts=/data:/data
#                      --gpu-bind=closest"
# Lists (DATA_PATH, TOKENIZER_ARGS, EXTRA_ARGS, TORCHRUN_ARGS, SRUN_ARGS) are split on whitespace.
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
    read -r -a _prefixes <<< "${DATA_PATH}"
    DATA_ARGS=(--data-path "${_prefixes[@]}" --split "${SPLIT:-949,50,1}")
    if [[ -n "${DATA_CACHE_PATH:-}" ]]; then
        DATA_ARGS+=(--data-cache-path "${DATA_CACHE_PATH}")
    fi
else
    DATA_ARGS=(--mock-data)
fi
# TSP attention ignores masks (causal over the zigzag layout): no S x S mask in the data loader.
DATA_ARGS+=(--no-create-attention-mask-in-dataloader)
if [[ -n "${TOKENIZER_ARGS:-}" ]]; then
    read -r -a TOKENIZER <<< "${TOKENIZER_ARGS}"
elif [[ -n "${TOKENIZER_MODEL:-}" ]]; then
    TOKENIZER=(--tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}"
               --tokenizer-model "${TOKENIZER_MODEL}")
elif [[ -n "${VOCAB_FILE:-}" || -n "${MERGE_FILE:-}" ]]; then
    : "${VOCAB_FILE:?VOCAB_FILE and MERGE_FILE go together (GPT-2 BPE)}"
    : "${MERGE_FILE:?VOCAB_FILE and MERGE_FILE go together (GPT-2 BPE)}"
    TOKENIZER=(--tokenizer-type "${TOKENIZER_TYPE:-GPT2BPETokenizer}" --vocab-file "${VOCAB_FILE}"
               --merge-file "${MERGE_FILE}")
else
    TOKENIZER=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE}")
fi
LOGGING_ARGS=(--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 1000000)
OPTIMIZER_ARGS=()
[[ "${DIST_OPT:-1}" == "1" ]] && OPTIMIZER_ARGS=(--use-distributed-optimizer)
EXTRA=()
[[ -n "${EXTRA_ARGS:-}" ]] && read -r -a EXTRA <<< "${EXTRA_ARGS}"
TORCHRUN_EXTRA=()
[[ -n "${TORCHRUN_ARGS:-}" ]] && read -r -a TORCHRUN_EXTRA <<< "${TORCHRUN_ARGS}"
SRUN_EXTRA=()
[[ -n "${SRUN_ARGS:-}" ]] && read -r -a SRUN_EXTRA <<< "${SRUN_ARGS}"

# parallel_args VARIANT -> MODEL_PARALLEL_ARGS (the only difference between the variants). With
# DIST_OPT=1 every variant already has --use-distributed-optimizer (OPTIMIZER_ARGS).
parallel_args() {
    local _all
    mapfile -t _all < <(_cfg --part parallel --variant "$1" "${_size[@]}")
    MODEL_PARALLEL_ARGS=()
    for _a in "${_all[@]}"; do
        if [[ "${_a}" == "--use-distributed-optimizer" && "${#OPTIMIZER_ARGS[@]}" -gt 0 ]]; then
            continue
        fi
        MODEL_PARALLEL_ARGS+=("${_a}")
    done
}

# output_args VARIANT -> OUTPUT_ARGS: per-variant checkpoint and TensorBoard directories.
output_args() {
    OUTPUT_ARGS=()
    if [[ -n "${CKPT_DIR:-}" ]]; then
        OUTPUT_ARGS+=(--save "${CKPT_DIR}/$1" --save-interval "${SAVE_INTERVAL:-1000}")
        if [[ -z "${LOAD_DIR:-}" ]]; then
            OUTPUT_ARGS+=(--load "${CKPT_DIR}/$1")
        fi
    fi
    if [[ -n "${LOAD_DIR:-}" ]]; then
        OUTPUT_ARGS+=(--load "${LOAD_DIR}")
    fi
    if [[ -n "${TENSORBOARD_DIR:-}" ]]; then
        OUTPUT_ARGS+=(--tensorboard-dir "${TENSORBOARD_DIR}/$1" --tensorboard-log-interval 1
                      --log-timers-to-tensorboard --log-memory-to-tensorboard
                      --log-world-size-to-tensorboard)
    fi
}

# What the box's ${PYTHON} offers the stock baselines, probed once (HAVE_TE / HAVE_APEX = 1 or 0
# override the probe). Megatron's default layers are Transformer Engine's; without TE the
# baselines need Megatron's local layers, whose norm supports --sequence-parallel only from apex.
_have() {
    "${PYTHON}" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$1') is None)" \
        2>/dev/null && echo 1 || echo 0
}
box_support() {
    if [[ -z "${HAVE_TE:-}" ]]; then HAVE_TE="$(_have transformer_engine)"; fi
    if [[ -z "${HAVE_APEX:-}" ]]; then HAVE_APEX="$(_have apex)"; fi
}

# box_args VARIANT -> BOX_ARGS (appended to the variant's parallel arguments) and BOX_LAUNCHER
# (1: the variant needs the launcher's spec hook); refuses (exit 2) a variant the box cannot run.
# tp without TE: Megatron's local layers (--transformer-impl local), and without apex also the
# project's TP+SP spec (local layers with sequence-parallel torch norms, no TSP code), which the
# launcher resolves; cp without TE is refused (Megatron's context parallelism runs in
# TEDotProductAttention only). tsp / tsp_mlp select their own specs.
TP_SP_SPEC_ARGS=(--spec megatron_tsp.megatron_lm.spec tp_sp_block_spec)
box_args() {
    box_support
    BOX_ARGS=()
    BOX_LAUNCHER=0
    [[ "${HAVE_TE}" == "1" ]] && return 0
    case "$1" in
        tp)
            BOX_ARGS=(--transformer-impl local)
            if [[ "${HAVE_APEX}" != "1" ]]; then
                BOX_ARGS+=("${TP_SP_SPEC_ARGS[@]}")
                BOX_LAUNCHER=1
            fi
            ;;
        cp)
            echo "error: VARIANTS has cp, which needs Transformer Engine (Megatron's context" \
                 "parallelism runs in TEDotProductAttention only) and ${PYTHON} has none;" \
                 "drop cp from VARIANTS or install Transformer Engine" >&2
            exit 2
            ;;
    esac
}

# box_notice VARIANT: one line when the box changes the variant's layers (after box_args).
box_notice() {
    if [[ "${#BOX_ARGS[@]}" -gt 0 ]]; then
        local what="Megatron's local layers (apex norm)"
        [[ "${BOX_LAUNCHER}" == "1" ]] && what="the project's TP+SP spec (Megatron's local layers with sequence-parallel torch norms, through the launcher)"
        echo "[ab] $1: no Transformer Engine for ${PYTHON}: using ${what}: ${BOX_ARGS[*]}" >&2
    fi
}

# entry VARIANT -> ENTRY: TSP goes through the launcher, the baselines run stock pretrain_gpt.py
# (a baseline whose spec is the project's TP+SP spec through the launcher too, with no TSP flag).
entry() {
    box_args "$1"
    if [[ "$1" == "tsp" || "$1" == "tsp_mlp" || "${BOX_LAUNCHER}" == "1" ]]; then
        ENTRY=(-m megatron_tsp.megatron_lm.launch "${MEGATRON_LM_PATH}/pretrain_gpt.py")
    else
        ENTRY=("${MEGATRON_LM_PATH}/pretrain_gpt.py")
    fi
}

common_args() {
    COMMON_ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${TOKENIZER[@]}"
                 "${LOGGING_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${EXTRA[@]}")
}

# variant_args VARIANT -> VARIANT_ARGS: everything after the entry point for that variant.
variant_args() {
    common_args
    parallel_args "$1"
    output_args "$1"
    box_args "$1"
    VARIANT_ARGS=("${COMMON_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
                  "${BOX_ARGS[@]}")
}
