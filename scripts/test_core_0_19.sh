#!/usr/bin/env bash
# Run the TSP core numerics tests against megatron-core 0.19.2 (Python >= 3.12 required).
# Creates .venv312/ (git-ignored) with pyenv's Python 3.12; torch 2.13.0 there is a CUDA build
# (about 4.8 GB, ~40 s) that runs on CPU. Skips with a message when no Python 3.12 exists or the
# packages cannot be installed; fails when a test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV312:-.venv312}
if [ ! -x "$VENV/bin/python" ]; then
  PY312=$(PYENV_VERSION=3.12.1 pyenv which python3 2>/dev/null || command -v python3.12 || true)
  if [ -z "$PY312" ]; then echo "SKIP megatron-core 0.19 line: no Python 3.12 found"; exit 0; fi
  "$PY312" -m venv "$VENV" || { echo "SKIP: could not create $VENV"; exit 0; }
fi
if ! "$VENV/bin/python" -c "import megatron.core, torch" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q torch==2.13.0 megatron-core==0.19.2 pytest \
    || { echo "SKIP megatron-core 0.19 line: install failed"; exit 0; }
fi
"$VENV/bin/python" -c "import megatron.core as m, torch; print('megatron-core', m.__version__, 'torch', torch.__version__)"
exec "$VENV/bin/python" -m pytest -q tests/test_layers.py tests/test_gpt.py tests/test_comm.py \
  tests/test_validation.py tests/test_rejections.py "$@"
