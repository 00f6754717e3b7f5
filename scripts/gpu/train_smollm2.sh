#!/usr/bin/env bash
# Device call: regenerate replies with SmolLM2 on the GPU, build the vocab, train a head
# with configs/gpu_smollm2.yaml (extra KEY=VALUE args go to `train`). Leaves the run in
# /tmp/run for bench_smollm2.sh and copies logs, config, data summary and metrics to $OUT.
# Logs go to files under $OUT with tee: a call cut at its time limit still returns them.
source scripts/gpu/common.sh
mkdir -p $OUT/train
start=$(date +%s)
if [ ! -f /tmp/run/data/train.jsonl ]; then
  python3 -m draftling data --config gpu_smollm2 --target $T --out /tmp/run/data 2>&1 \
    | grep --line-buffered -v "^regenerate: " | tee $OUT/train/data_log.txt
  python3 -m draftling vocab --data /tmp/run/data --config gpu_smollm2 --target $T | tee -a $OUT/train/data_log.txt
fi
python3 -m draftling train --config gpu_smollm2 --target $T --data /tmp/run/data --run-dir /tmp/run/train "$@" 2>&1 \
  | tee $OUT/train/log.txt
cp /tmp/run/train/config.yaml /tmp/run/train/metrics.jsonl /tmp/run/train/train_result.json $OUT/train/
cp /tmp/run/data/summary.json $OUT/train/data_summary.json
echo "{\"wall_s\": $(( $(date +%s) - start ))}" > $OUT/train/wall.json
