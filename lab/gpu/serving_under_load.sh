#!/usr/bin/env bash
# Device call 2 of 2: the batched engine under load (lab/gpu/serving_under_load.py).
# Call 1, right before on the same warm machine, carries .dev/a and .whl and runs
#   mkdir -p /tmp/m && cp .dev/a/* /tmp/m/
# This call carries .dev/b and the draft (runs/qs2/export-sglang: the quickstart's head,
# trained on the 2-core CPU; any draft directory works).
source lab/gpu/common.sh
python3 lab/gpu/serving_under_load.py --target $T --draft "${DRAFT:-runs/qs2/export-sglang}" \
  --out $OUT "$@" 2>&1 | tee $OUT/log.txt
