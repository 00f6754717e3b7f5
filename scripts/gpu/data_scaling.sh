#!/usr/bin/env bash
# The data-scaling curve of issue 25: one recipe (configs/gpu_smollm2.yaml, extra KEY=VALUE args
# to `train`) on nested shares of the same regenerated data, each head validated and run
# through the v1 release bench. Device calls straight after each other on one warm machine:
#   0. carries .dev/a and .whl:            mkdir -p /tmp/m && cp .dev/a/* /tmp/m/
#   1. carries .dev/b, .whl, .dev/p:       STAGE=data bash scripts/gpu/data_scaling.sh
#      (regenerates every prompt file of the corpus; journaled, so a call cut at its limit is
#      continued by the same command in the next call)
#   2.. carries .whl:                      STAGE=train FRACTION=0.25 bash scripts/gpu/data_scaling.sh [KEY=VALUE ...]
#      (a run cut at its limit continues with RESUME=1), then STAGE=bench FRACTION=0.25, and so on
#      for 0.5 and 1.0
# Then, here: python3 scripts/gpu/scaling_curve.py --runs DIR... --out bench/results/<folder>
source scripts/gpu/common.sh
mkdir -p $OUT/$STAGE
log=$OUT/$STAGE/log.txt
S=/tmp/scale
FILES='["shared:sharegpt.jsonl","shared:instruct.jsonl","shared:code_mbpp.jsonl","shared:math_gsm8k_train.jsonl",
"shared:summarize.jsonl","shared:tool_use.jsonl","shared:code_gpteacher.jsonl","shared:roleplay_gpteacher.jsonl",
"shared:tool_toolformer.jsonl","shared:t0_tasks.jsonl"]'
run="$S/run-${FRACTION:-1.0}"
case $STAGE in
data)
  timeout ${DATA_LIMIT_S:-560} python3 -m draftling data --config gpu_smollm2 --target $T --out $S/data \
    "data.prompts=$(echo $FILES | tr -d '\n ')" data.max_prompts_per_file=0 data.max_prompts_by_file={} \
    ${DATA_ARGS:-} 2>&1 | grep --line-buffered -v "^regenerate: " | tee -a $log
  python3 -m draftling vocab --data $S/data --config gpu_smollm2 --target $T | tee -a $log
  cp $S/data/summary.json $OUT/data/ ;;
train)
  python3 -m draftling train --config gpu_smollm2 --target $T --data $S/data --run-dir $run \
    ${RESUME:+--resume} train.data_fraction=${FRACTION:?} "$@" 2>&1 | tee -a $log
  cp $run/train_result.json $run/metrics.jsonl $run/config.yaml $OUT/train/ ;;
bench)
  python3 -m draftling bench --release --target $T --dtype bfloat16 --device cuda --draft $run/draft \
    --prompt-set v1 --baselines engine_plain --results-dir $OUT/results --tag "fraction-${FRACTION:?}" \
    2>&1 | tee -a $log ;;
*) echo "STAGE must be data, train or bench"; exit 2 ;;
esac
