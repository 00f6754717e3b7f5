#!/usr/bin/env bash
# Device call: regenerate replies with SmolLM2 on the GPU, build the vocab, train a head
# with configs/gpu_smollm2.yaml (extra KEY=VALUE args go to `train`). Leaves the run in
# /tmp/run for bench_smollm2.sh. Returns the log, the draft packed in parts ($OUT/draft, see
# draft_transport.py) and one archive of config, metrics and data summary: a call returns
# at most 8 files. Logs go to $OUT with tee, so a call cut at its time limit still returns them.
# DATA_ONLY=1 stops after the data and vocab: on a warm machine the next call trains on them.
# Since 2026-12-03 the config's recipe (ten files, until convergence: about 4 min of data and
# 10 of training) does not fit one call: run it through `JOBS=recipe bash
# lab/gpu/shared_calls.sh start` (data_scaling.sh, which resumes across calls and benches),
# or give this script a smaller budget (OLD_RECIPE in stages.sh as args, fewer prompts in DATA_ARGS).
# DATA_ARGS="KEY=VALUE ..." overrides the config of `data` (e.g. more prompts).
source lab/gpu/common.sh
mkdir -p $OUT/train
start=$(date +%s)
if [ ! -f /tmp/run/data/vocab.safetensors ]; then
  python3 -m draftling data --config lab/configs/gpu_smollm2.yaml --target $T --out /tmp/run/data ${DATA_ARGS:-} 2>&1 \
    | grep --line-buffered -v "^regenerate: " | tee $OUT/train/data_log.txt
  python3 -m draftling vocab --data /tmp/run/data --config lab/configs/gpu_smollm2.yaml --target $T | tee -a $OUT/train/data_log.txt
  cp /tmp/run/data/summary.json $OUT/train/data_summary.json
fi
echo "data and vocab: $(( $(date +%s) - start )) s"
[ "${DATA_ONLY:-0}" = 1 ] && exit 0
python3 -m draftling train --config lab/configs/gpu_smollm2.yaml --target $T --data /tmp/run/data --run-dir /tmp/run/train "$@" 2>&1 \
  | tee $OUT/train/log.txt
echo "{\"wall_s\": $(( $(date +%s) - start ))}" > /tmp/run/train/wall.json
python3 lab/gpu/draft_transport.py pack /tmp/run/train/draft $OUT/draft
cp /tmp/run/data/summary.json /tmp/run/train/data_summary.json
tar czf $OUT/train/run_files.tgz -C /tmp/run/train config.yaml metrics.jsonl train_result.json wall.json data_summary.json
