#!/usr/bin/env bash
# Set up, then run the whole test suite (unit tests on tiny models + the real-SmolLM2 integration test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
${PYTHON:-python3} -m ruff check src tests scripts lab
${PYTHON:-python3} -m ruff format --check src tests scripts lab
# Types on the package (pyproject's [tool.mypy]: modules listed there are not yet checked).
${PYTHON:-python3} -m mypy
rc=0
# The serving check (real vLLM, its CPU build, in a venv of its own) runs beside the suite: its
# venv install is mostly unpacking and a vLLM start mostly waits on processes, which the
# suite's workers fill. Its output comes after the suite's. VLLM_TESTS=0 leaves it out.
if [ "${VLLM_TESTS:-1}" != 0 ]; then
  log=$(mktemp)
  (bash scripts/test_vllm.sh --install-only && echo "scripts/test.sh: vLLM venv ready" && bash scripts/test_vllm.sh) >"$log" 2>&1 &
  vllm_pid=$!
fi
# One worker per core, a test module to a worker (its module fixtures built once; the times
# this takes are in BENCHMARKS.md), one torch thread per worker: each worker's default of a thread per core would oversubscribe
# the cores the workers already fill (the suite's subprocesses inherit it too).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ${PYTHON:-python3} -m pytest -q -n auto --dist loadscope "$@" || rc=$?
if [ "${VLLM_TESTS:-1}" != 0 ]; then
  echo "scripts/test.sh: waiting for the serving check's tests (scripts/test_vllm.sh)"
  wait "$vllm_pid" || { s=$?; [ "$rc" != 0 ] || rc=$s; }  # the first failure's status
  cat "$log"
  rm -f "$log"
fi
exit $rc
