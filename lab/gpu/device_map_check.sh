#!/usr/bin/env bash
# Device call (one GPU): issue 26 item 3, the SmolLM2 teacher split between cuda:0 and host RAM
# by a --device-map FILE against the same teacher loaded whole: aux states, logits and three
# 20-step training runs (whole, split, whole again). Writes $OUT/device-map-check/ and tees the
# log there. Carries .dev/b and .whl (after a call that carried .dev/a, as common.sh expects).
# Extra args go to the script, e.g. --steps 40 or KEY=VALUE overrides. Rough device time:
# 2-4 min (two GGUF loads, the first run's compile, three short runs).
source lab/gpu/common.sh
mkdir -p $OUT/device-map-check
python3 lab/gpu/device_map_check.py --target $T --out $OUT/device-map-check "$@" 2>&1 \
  | tee $OUT/device-map-check/log.txt
