#!/usr/bin/env bash
# Device call 2 of 2 (call 1 as in serving_under_load.sh). Carries .dev/b, .whl and .dev/old:
#   mkdir -p .dev/old && git archive <commit before the batched engine> src | tar -x -C .dev/old
source lab/gpu/common.sh
python3 lab/gpu/batch1_ab_and_bf16_identity.py --target $T --old-src "$PWD/.dev/old/src" --out $OUT "$@" \
  2>&1 | tee $OUT/log.txt
