#!/usr/bin/env bash
# Device job (one GPU), issue 27 item 1 on real data: training tok/s at 32 and 16 sequences per
# step, before the padding and host-read fixes (the source of 8cab536, the parent of their merge
# 47dfeed, carried as .dev/old/src: `git archive 8cab536 src | tar -x -C .dev/old`) and after
# (this checkout), on the same data; then the two-point fit (lab/gpu/train_fixed_cost.py).
# The data is ddp_scaling.sh's (common.sh's subset_data): gpu_smollm2's prompts, 200 per file.
# Order per repeat: after 32, before 32, after 16, before 16 (REPEATS, default 1; STEPS, default 80;
# FC_BATCHES, default "32 16"; CODES, default "after before").
# Writes $OUT/fixed-cost.json with the runs' logs and metrics beside it.
# SMOKE=1: the same on the CPU with a few prompts and steps (a dry run, not a measurement).
source lab/gpu/common.sh
R=/tmp/fc D=/tmp/fc/data OLD=${OLD_SRC:-$PWD/.dev/old/src}
[[ " ${CODES:-after before} " != *" before "* ]] || [ -d $OLD/draftling ] \
  || { echo "train_fixed_cost: no old source at $OLD (CODES=after runs without it)"; exit 2; }
KEYS="train.max_steps=${STEPS:-80} train.max_minutes=0 train.log_every=10 train.ckpt_every=1000
  train.max_val_batches=4 train.lr=5e-4 train.warmup_steps=30 train.smoke_every=0 train.stop_on_convergence=false"
if [ "${SMOKE:-0}" = 1 ]; then
  DEV="--device cpu" KEYS="$KEYS train.max_steps=6 train.log_every=2 train.max_val_batches=1"
  DATA_ARGS="data.max_prompts_per_file=4 data.regen.max_new_tokens=8 data.regen.batch_size=8"
fi
mkdir -p $OUT $R
subset_data $D $OUT ${DEV:-} ${DATA_ARGS:-}
runs=()
for rep in $(seq ${REPEATS:-1}); do
  for b in ${FC_BATCHES:-32 16}; do
    for code in ${CODES:-after before}; do
      src=$PWD/src; [ $code = after ] || src=$OLD
      # the old source ships the recipe as a built-in name; this checkout keeps it in lab/configs
      cfg=lab/configs/gpu_smollm2.yaml; [ ! -f $src/draftling/configs/gpu_smollm2.yaml ] || cfg=gpu_smollm2
      bs=$b; [ "${SMOKE:-0}" = 0 ] || bs=$(( b / 8 ))
      name=$code-$bs-$rep; rm -rf $R/$name
      echo "train_fixed_cost: $name from $(date -u +%T)"
      PYTHONPATH=/tmp/site:$src python3 -m draftling train --config $cfg --target $T --data $D \
        --run-dir $R/$name train.batch_size=$bs \
        $KEYS ${DEV:-} > $OUT/train_$name.txt 2>&1 || { echo "$name: exit $?"; tail -5 $OUT/train_$name.txt; exit 1; }
      cp $R/$name/metrics.jsonl $OUT/metrics_$name.jsonl; cp $R/$name/train_result.json $OUT/result_$name.json
      runs+=(--run $code:$bs=$R/$name)
    done
  done
done
python3 lab/gpu/train_fixed_cost.py --data $D --out $OUT "${runs[@]}" $([ "${SMOKE:-0}" = 1 ] && echo --gpu cpu)
