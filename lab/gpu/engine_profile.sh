#!/usr/bin/env bash
# Device call, no target needed: the decode-engine variants on a random SmolLM2-shaped model
# (lab/benches/engine_profile.py), then the engine's CUDA tests. Writes $OUT/engine-profile.json
# (rewritten after every variant) and the logs. Extra args go to the profile.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 lab/benches/engine_profile.py --out $OUT/engine-profile.json "$@" 2>&1 | tee $OUT/engine_profile_log.txt
python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine.py -k "cuda or bf16" 2>&1 | tee $OUT/engine_cuda_tests.txt
