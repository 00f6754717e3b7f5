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
# The serving check's venv (real vLLM, its CPU build) is built beside the suite: the install is
# mostly unpacking, which the suite's two workers leave room for. VLLM_TESTS=0 leaves it out.
if [ "${VLLM_TESTS:-1}" != 0 ]; then
  log=$(mktemp)
  bash scripts/test_vllm.sh --install-only >"$log" 2>&1 &
  venv_pid=$!
fi
# One worker per core, a test module to a worker (its module fixtures built once; the times
# this takes are in BENCHMARKS.md), and one torch thread per worker: each worker's default of a
# thread per core would oversubscribe the cores the workers fill (subprocesses inherit it too).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ${PYTHON:-python3} -m pytest -q -n auto --dist loadscope "$@" || rc=$?
# Second step, run whatever the first gave: the serving check's tests. They run after the suite,
# not beside it: a vLLM start competing with the suite's workers took several times as long.
if [ "${VLLM_TESTS:-1}" != 0 ]; then
  if wait "$venv_pid"; then
    bash scripts/test_vllm.sh || { s=$?; [ "$rc" != 0 ] || rc=$s; }  # the first failure's status
  else
    s=$?; cat "$log"; echo "scripts/test.sh: building the vLLM venv failed (exit $s)" >&2
    [ "$rc" != 0 ] || rc=$s
  fi
  rm -f "$log"
fi
exit $rc
