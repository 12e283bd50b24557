#!/usr/bin/env bash
# Unpack the Megatron-LM trees that pretrain_gpt.py needs (../shared/third_party/*.tar.gz, see its
# README) into .third_party/ (git-ignored), and put the megatron-core wheel's compiled
# helpers_cpp extension next to helpers.cpp in each tree (the archives hold sources only).
#
#   scripts/megatron_lm_sources.sh [PYTHON_FOR_0_16] [PYTHON_FOR_0_19]
#
# Prints `export MEGATRON_LM_PATH=...` and `export MEGATRON_LM_PATH_0_19=...` lines (eval them).
# Idempotent: an unpacked tree is reused. Fails when an archive is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCHIVES=${MEGATRON_LM_ARCHIVES:-../shared/third_party}
DEST=${MEGATRON_LM_SOURCES:-.third_party}
PY016=${1:-python3}
PY019=${2:-${VENV312:-.venv312}/bin/python}
mkdir -p "$DEST"

unpack() {  # tag python -> prints the tree's absolute path
  local tag=$1 py=$2 tree="$DEST/Megatron-LM-$1"
  local archive="$ARCHIVES/Megatron-LM-$tag.tar.gz"
  if [ ! -f "$tree/pretrain_gpt.py" ]; then
    [ -f "$archive" ] || { echo "megatron_lm_sources: missing $archive" >&2; return 1; }
    tar -xzf "$archive" -C "$DEST"
  fi
  if [ -x "$py" ] || command -v "$py" >/dev/null 2>&1; then
    # The wheel of the same line ships the compiled extension; the checkout imports it from its
    # own megatron/core/datasets/ (it is first on sys.path).
    local so
    so=$("$py" - <<'PY' 2>/dev/null || true
import glob, os, importlib.util
spec = importlib.util.find_spec("megatron.core")
if spec and spec.origin:
    hits = glob.glob(os.path.join(os.path.dirname(spec.origin), "datasets", "helpers_cpp*.so"))
    print(hits[0] if hits else "")
PY
)
    if [ -n "$so" ]; then
      cp -f "$so" "$tree/megatron/core/datasets/"
    else
      echo "megatron_lm_sources: no compiled helpers_cpp in $py's megatron-core" >&2
    fi
  fi
  echo "$(cd "$tree" && pwd)"
}

P016=$(unpack core_v0.16.1 "$PY016")
echo "export MEGATRON_LM_PATH=$P016"
P019=$(unpack core_v0.19.0 "$PY019")
echo "export MEGATRON_LM_PATH_0_19=$P019"
