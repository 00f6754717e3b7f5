#!/usr/bin/env bash
# A dflash head against the quickstart's EAGLE-3 head on the CPU: the same data (a quickstart
# run's regenerated replies and kept teacher states), the same config and step budget
# (715 steps: what the quickstart's time budget gave its EAGLE-3 head), then `draftling bench`
# of both heads on the same validation prompts in one session.
#   bash lab/experiments/block_vs_eagle_cpu.sh QUICKSTART_RUN OUT [LAYERS]
# QUICKSTART_RUN: README command 1's runs/quickstart (config.yaml, data/, run/). Writes
# OUT/{train-dflash.log,bench-eagle3.json,bench-dflash.json,run-dflash/}.
set -euo pipefail
qs=$1 out=$2 layers=${3:-1}
steps=$(python3 -c "import json;print(json.load(open('$qs/summary.json'))['train_steps'])")
mkdir -p $out
export PYTHONPATH=${PYTHONPATH:-$PWD/src}
[ -d $out/run-dflash/draft ] || python3 -m draftling train --config $qs/config.yaml --data $qs/data \
  --run-dir $out/run-dflash --device cpu draft.method=dflash draft.layers=$layers train.max_steps=$steps \
  2>&1 | tee $out/train-dflash.log
for head in eagle3:$qs/run dflash:$out/run-dflash; do
  python3 -m draftling bench --config $qs/config.yaml --device cpu --draft ${head#*:} \
    --prompts $qs/data/val.jsonl --num-prompts ${PROMPTS:-16} --max-new-tokens 96 --out $out/bench-${head%%:*}.json
done
