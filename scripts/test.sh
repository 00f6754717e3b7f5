#!/usr/bin/env bash
# Set up, then run the whole test suite (unit tests on tiny models + the real-SmolLM2 integration test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
${PYTHON:-python3} -m ruff check src tests scripts
exec ${PYTHON:-python3} -m pytest -q "$@"
