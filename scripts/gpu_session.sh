#!/usr/bin/env bash
# The prepared checks for one lent GPU (H100 / H200), in priority order, inside one time budget:
#   1. scripts/gpu_check.py at 7B / 128k, D=8 (timing, kernels, memory vs the fake-tensor tool,
#      attention backends verified, bf16 vs fp32);
#   2. scripts/hbm_check.py at 7B / 32k, D=8 under Nsight Compute: DRAM bytes of one layer step
#      per scheme beside the traffic model's count;
#   3. scripts/gpu_check.py at 7B / 32k (no fake-tensor prediction);
#   4. both again with cuDNN attention timed in the TSP layers instead of the default.
# STAGES (space-separated) picks some: check_128k hbm check_32k check_128k_cudnn check_32k_cudnn.
# A stage starts only when the budget left covers its own limit. Everything lands in
# $OUT/results.tgz (re-packed after each stage, so a run cut short still returns what finished)
# and the log in $OUT/log.txt.
#
#   OUT=/some/dir BUDGET_S=400 [STAGES="check_128k hbm"] bash scripts/gpu_session.sh
#
# megatron-core is not on the GPU image: carry its wheel in .whl/ (see docs/gpu_check.md).
set -u
: "${OUT:?set OUT to the folder that comes back}"
BUDGET_S=${BUDGET_S:-400}
WORK=$(mktemp -d)
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
start=$SECONDS

pack() { tar -czf "$OUT/results.tgz" -C "$WORK" . 2>>"$LOG"; }
left() { echo $((BUDGET_S - (SECONDS - start))); }
stage() {  # stage NAME LIMIT_S COMMAND...: run COMMAND if LIMIT_S fits in what is left
    local name=$1 limit=$2
    shift 2
    if [ "$(left)" -lt "$limit" ]; then
        echo "[session] skip $name: $(left) s left, it needs $limit" | tee -a "$LOG"
        return 0
    fi
    echo "[session] $name (limit $limit s, $(left) s left)" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "[session] $name: exit $? after $((SECONDS - t0)) s" | tee -a "$LOG"
    pack
}

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheel install failed" >>"$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{
    nvidia-smi -L
    python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', m.__version__, torch.cuda.get_device_name())"
} >>"$LOG" 2>&1

want() { [[ " $STAGES " == *" $1 "* ]]; }
STAGES=${STAGES:-check_128k hbm check_32k check_128k_cudnn check_32k_cudnn}

if want check_128k; then
    stage check_128k 240 python3 scripts/gpu_check.py --out-dir "$WORK/check_128k" --host-profile
    # the fake-tensor prediction runs on the GPU image's torch: if it breaks, time without it
    [ -f "$WORK/check_128k/gpu_check.json" ] ||
        stage check_128k_skip_fake 150 python3 scripts/gpu_check.py \
            --out-dir "$WORK/check_128k" --skip-fake --host-profile
fi

NCU=$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if want hbm && [ -n "$NCU" ]; then
    mkdir -p "$WORK/hbm_32k"
    for scheme in tsp tp_sp; do
        stage "hbm_$scheme" 120 "$NCU" --profile-from-start off --clock-control none \
            --print-units base --csv \
            --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
            --log-file "$WORK/hbm_32k/ncu_$scheme.csv" \
            python3 scripts/hbm_check.py step --scheme "$scheme" --seq 32768 --out "$WORK/hbm_32k"
    done
    stage hbm_report 30 python3 scripts/hbm_check.py report --dir "$WORK/hbm_32k"
elif want hbm; then
    echo "[session] no ncu found: HBM check skipped" | tee -a "$LOG"
fi

want check_32k && stage check_32k 120 python3 scripts/gpu_check.py \
    --out-dir "$WORK/check_32k" --seq 32768 --skip-fake --host-profile
# cuDNN attention (verified by the check itself) timed instead of the default flash kernel
want check_128k_cudnn && stage check_128k_cudnn 150 python3 scripts/gpu_check.py \
    --out-dir "$WORK/check_128k_cudnn" --skip-fake --timed-backend cudnn
want check_32k_cudnn && stage check_32k_cudnn 120 python3 scripts/gpu_check.py \
    --out-dir "$WORK/check_32k_cudnn" --seq 32768 --skip-fake --timed-backend cudnn
echo "[session] done in $((SECONDS - start)) s" | tee -a "$LOG"
