#!/usr/bin/env bash
# Device job on nvidia-h200-x2 (issue 27): training tok/s of one run at 1 and 2 GPUs (DDP via
# `draftling train --nproc N`, the SmolLM2 teacher resident on every rank, the same global batch),
# the 2-GPU run again under train.parallel=fsdp, and one process with the teacher spread over both
# GPUs (--device-map balanced, the draft on cuda:0).
#   ddp_scaling.sh data   regenerate a corpus subset and build the vocab (one GPU), then stop
#   ddp_scaling.sh        the same if not done yet, then the runs and the results JSON per batch
# BATCHES (default "64 128"): global batches; 1 and 2 GPUs at each, FSDP and the split teacher at
# the first. STEPS (default 200, logged every 20). RUNS (default "1 2 fsdp split") picks runs.
# FIXED_COST: the one-GPU step fit (train_fixed_cost.py) whose before/after the JSON carries.
# Extra args after the mode go to every `train` run. Logs and metrics are teed into $OUT/ddp.
# Writes $OUT/ddp/ddp-scaling-b<B>.json. SMOKE=1: the same on the CPU (gloo), a dry run.
# Rough device time at the defaults: data ~70 s, then ~100 s per run (target load, compile).
source lab/gpu/common.sh
mode=${1:-all}; shift || true
mkdir -p $OUT/ddp
R=/tmp/ddp D=/tmp/ddp/data RUNS=${RUNS:-1 2 fsdp split}
FIXED_COST=${FIXED_COST:-bench/results/2026-12-04-train-fixed-cost-f7c2186-nvidia-h200/run1/fixed-cost.json}
KEYS="train.max_steps=${STEPS:-200} train.max_minutes=0 train.log_every=20 train.ckpt_every=100000
  train.max_val_batches=4 train.smoke_every=0 train.stop_on_convergence=false"
MAP=balanced
if [ "${SMOKE:-0}" = 1 ]; then
  DEV="--device cpu" KEYS="$KEYS train.max_steps=6 train.log_every=2 train.max_val_batches=1"
  DATA_ARGS="data.max_prompts_per_file=4 data.regen.max_new_tokens=8 data.regen.batch_size=8"
fi
subset_data $D $OUT/ddp ${DEV:-} ${DATA_ARGS:-}
[ "$mode" = data ] && exit 0
train() {  # train NAME BATCH ARGS...: one run, its log and metrics copied to $OUT/ddp
  local name=$1 b=$2; shift 2; rm -rf $R/$name
  echo "ddp_scaling: $name from $(date -u +%T)"
  python3 -m draftling train --config lab/configs/gpu_smollm2.yaml --target $T --data $D --run-dir $R/$name \
    train.batch_size=$b $KEYS ${DEV:-} "$@" > $OUT/ddp/train_$name.txt 2>&1 \
    || { echo "$name: exit $?"; tail -5 $OUT/ddp/train_$name.txt; return 1; }
  cp $R/$name/metrics.jsonl $OUT/ddp/metrics_$name.jsonl; cp $R/$name/train_result.json $OUT/ddp/result_$name.json
}
first=""
for B in ${BATCHES:-64 128}; do
  [ "${SMOKE:-0}" = 0 ] || B=$(( B / 16 ))
  args=()
  for r in $RUNS; do
    case $r in
      1|2) train b$B-$r $B --nproc $r "$@" && args+=(--run $r=$R/b$B-$r) ;;
      fsdp) [ -n "$first" ] || { train b$B-fsdp $B --nproc 2 train.parallel=fsdp "$@" && args+=(--fsdp $R/b$B-fsdp); } ;;
      split) [ -n "$first" ] || { train b$B-split $B --device-map $MAP "$@" && args+=(--split $R/b$B-split); } ;;
    esac
  done
  first=$B
  [ ! -f "$FIXED_COST" ] || args+=(--fixed-cost $FIXED_COST)
  python3 lab/benches/ddp_scaling.py "${args[@]}" --out $OUT/ddp/ddp-scaling-b$B.json \
    --note teacher=SmolLM2-135M-Instruct.Q4_1.gguf --note global_batch=$B \
    --note command="BATCHES='${BATCHES:-64 128}' lab/gpu/ddp_scaling.sh (nvidia-h200-x2)" $([ "${SMOKE:-0}" = 1 ] && echo --gpu cpu)
done
