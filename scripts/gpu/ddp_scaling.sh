#!/usr/bin/env bash
# Device call on nvidia-h200-x2: training tokens/s of one run at 1 and at 2 GPUs (DDP via
# `draftling train --nproc N`), SmolLM2 teacher resident on every rank, same global batch.
#   ddp_scaling.sh data   regenerate a corpus subset and build the vocab (one GPU), then stop
#   ddp_scaling.sh        the same if not done yet, then both runs and the results JSON
# Extra args after the mode go to both `train` runs. Logs are teed into $OUT/ddp.
source scripts/gpu/common.sh
mode=${1:-all}; shift || true
mkdir -p $OUT/ddp
D=/tmp/ddp/data
if [ ! -f $D/vocab.safetensors ]; then
  python3 -m draftling data --config gpu_smollm2 --target $T --out $D data.max_prompts_per_file=200 2>&1 \
    | grep --line-buffered -v "^regenerate: " | tee $OUT/ddp/data_log.txt
  python3 -m draftling vocab --data $D --config gpu_smollm2 --target $T | tee -a $OUT/ddp/data_log.txt
fi
[ "$mode" = data ] && exit 0
for n in 1 2; do
  rm -rf /tmp/ddp/run$n
  python3 -m draftling train --config gpu_smollm2 --target $T --data $D --run-dir /tmp/ddp/run$n --nproc $n \
    train.max_steps=80 train.max_minutes=0 train.log_every=10 train.ckpt_every=1000 train.max_val_batches=4 "$@" \
    2>&1 | tee $OUT/ddp/train_$n.txt
  cp /tmp/ddp/run$n/metrics.jsonl $OUT/ddp/metrics_$n.jsonl
done
python3 -m draftling.bench.ddp_scaling --run 1=/tmp/ddp/run1 --run 2=/tmp/ddp/run2 \
  --out $OUT/ddp/ddp-scaling.json --note teacher=SmolLM2-135M-Instruct.Q4_1.gguf --note dtype=bfloat16 \
  --note command="scripts/gpu/ddp_scaling.sh (nvidia-h200-x2)" | tee -a $OUT/ddp/train_2.txt
