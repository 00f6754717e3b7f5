#!/usr/bin/env bash
# Device call (one GPU): the fixed cost of a training step before and after the padding and
# host-read fixes of issue 27, as a two-point fit at 16 and 32 sequences per step
# (lab/gpu/step_fixed_cost.py). Writes $OUT/step-fixed-cost/{step-fixed-cost.json,manifest.json}
# and tees the log beside them. Extra args go to the script, e.g. --measured 30.
source lab/gpu/common.sh
mkdir -p $OUT/step-fixed-cost
python3 lab/gpu/step_fixed_cost.py --target $T --out $OUT/step-fixed-cost "$@" 2>&1 \
  | tee $OUT/step-fixed-cost/log.txt
