#!/usr/bin/env bash
# Retrain the quickstart head on an earlier quickstart's data (its replies and kept target
# states), once per variant, and print each run's validation line. Compare variants with the
# same validation coverage: train.max_val_batches x train.batch_size sequences are evaluated.
#   bash lab/experiments/quickstart_train_variants.sh RUNS/quickstart/data OUT
set -euo pipefail
DATA=$1; OUT=$2; mkdir -p "$OUT"
run() {
  name=$1; shift; start=$(date +%s)
  python3 -m draftling train --config quickstart_cpu --data "$DATA" --run-dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name $(( $(date +%s) - start ))s $(grep '^validation' "$OUT/$name.log")" | tee -a "$OUT/results.txt"
}
run wd train.weight_decay=0.1
run ep5 train.epochs=5
run bs8 train.batch_size=8 train.lr=1.4e-3
