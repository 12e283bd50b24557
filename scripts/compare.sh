#!/usr/bin/env bash
# Side-by-side table (lm loss, tokens/s, TFLOP/s/GPU, peak memory) and a loss-curve PNG from the
# Megatron logs or TensorBoard event directories of the A/B variants:
#   scripts/compare.sh tsp=ab_logs/tsp.log tp=ab_logs/tp.log
#   scripts/compare.sh tsp=$TENSORBOARD_DIR/tsp tp=$TENSORBOARD_DIR/tp
# (PNG: --png FILE; needs matplotlib, the megatron-tsp[plot] extra).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$(cd "${here}/.." && pwd)${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python}" -m megatron_tsp.megatron_lm.compare "$@"
