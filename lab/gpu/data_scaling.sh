#!/usr/bin/env bash
# The data-scaling curve of issue 25: one recipe (configs/gpu_smollm2.yaml at a fixed number of
# steps, so the points differ in data only) on nested shares of the whole regenerated corpus.
# Every call does what is left, in order, inside its own time (CALL_S):
#   data    regenerate gpu_smollm2's prompts (the ten non-agent corpus files; journaled: a call
#           cut short is resumed by the next), then the draft vocab. The replies come back as
#           replies.jsonl.gz.* with the journal's settings, so a later machine can skip
#           regeneration (RESTORE below).
#   train   the share FRACTION for STEPS steps with the smoke bench on (--resume across calls).
#   bench   the v1 release bench against the engine without speculation; then `draftling report`.
# Device calls straight after each other on one warm machine:
#   0. carries .dev/a and .whl:        mkdir -p /tmp/m && cp .dev/a/* /tmp/m/
#   1. carries .dev/b, .whl, .dev/p:   FRACTION=1.0 bash lab/gpu/data_scaling.sh [KEY=VALUE ...]
#   2.. carries .whl:                  the same command, until it prints "scaling: done"
# UNTIL=train stops before the bench (while other work shares the GPU: the bench times speed).
# BENCH_ARGS: more bench flags or keys, e.g. bench.sampled_temperatures=[] (greedy only) for the
# points that are not the release run.
# RESTORE=1 with .dev/j carried (the replies.jsonl.gz.* and journal.json of an earlier call)
# rebuilds the journal first. RUN_NAME names a run that is not a plain curve point (default: F).
# Extra KEY=VALUE args go to `train`. The curve's points train with OLD_RECIPE (stages.sh) at
# STEPS steps; CURVE_ARGS= (empty) trains with gpu_smollm2's own recipe instead.
# The sampled-replies point: SAMPLES=2 FRACTION=1.0 RUN_NAME=sampled-1.0 RESTORE=1 (the greedy
# replies come from .dev/j; the samples are written through the batched engine, seeded per batch).
# Then, here: python3 lab/gpu/scaling_curve.py --runs DIR... --out bench/results/<folder>
source lab/gpu/common.sh
source lab/gpu/stages.sh
S=/tmp/scale F=${FRACTION:?set FRACTION, e.g. 1.0} STEPS=${STEPS:-2394} N=${SAMPLES:-1}
# SAMPLES=N: N-1 sampled replies per training prompt added (data.regen.samples_per_prompt), in
# data-sN; its journal resumes the greedy replies (RESTORE), so only the samples are written.
D=$S/data$([ $N = 1 ] || echo -s$N)
run=$S/run-${RUN_NAME:-$F} log=$OUT/log.txt J=$S/.$(basename $D).journal
# SMOKE=1: every stage tiny, on the CPU (a dry run of the commands, not a measurement).
if [ "${SMOKE:-0}" = 1 ]; then
  DEV="--device cpu" STEPS=4 DATA_ARGS="data.max_prompts_per_file=3 data.regen.max_new_tokens=8 data.regen.batch_size=8"
  SMOKE_ARGS="train.batch_size=2 train.smoke_every=2 train.smoke_max_new_tokens=4" BENCH_ARGS="--max-new-tokens 8 --prompt-set /tmp/scale/tiny.jsonl bench.sampled_temperatures=[]"
  mkdir -p /tmp/scale && head -2 src/draftling/bench/prompt_sets/v1.jsonl > /tmp/scale/tiny.jsonl
fi

if [ ! -f $D/vocab.safetensors ]; then
  mkdir -p $S
  if [ "${RESTORE:-0}" = 1 ] && [ ! -d $J ]; then
    # The journal names the target by its label (the GGUF's file name), which a restore sets.
    mkdir -p $J && python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); j["target"]=sys.argv[2]
j["data"]["regen"].pop("samples_per_prompt", None)  # no longer a journal setting (data/prepare.py)
json.dump(j, open(sys.argv[3], "w"), indent=2)' ${JDIR:-.dev/j}/journal.json $(basename $T) $J/journal.json && cat ${JDIR:-.dev/j}/replies.jsonl.gz.* | gunzip \
      | python3 -c 'import json,sys
for line in sys.stdin:
    r = json.loads(line); r.pop("split", None); r.pop("run", None); print(json.dumps(r, ensure_ascii=False))' > $J/replies.jsonl
  fi
  # The journal is removed when the data is written: keep its settings for RESTORE.
  (until [ -f $J/journal.json ]; do sleep 2; done; cp $J/journal.json $OUT/journal.json) & watcher=$!
  timeout $(( $(left) - 20 )) python3 -m draftling data --config lab/configs/gpu_smollm2.yaml --target $T --out $D data.regen.samples_per_prompt=$N \
    ${DEV:-} ${DATA_ARGS:-} 2>&1 | quiet | tee -a $log || true
  kill $watcher 2>/dev/null || true
  [ -f $D/summary.json ] || { echo "scaling: data not finished; call again" | tee -a $log; exit 0; }
  d vocab --data $D --config lab/configs/gpu_smollm2.yaml --target $T
  cp $D/summary.json $OUT/data_summary.json
  gzip -c $D/replies.jsonl | split -b 15000000 - $OUT/replies.jsonl.gz.
fi

if ! finished $run; then
  [ $(left) -gt 150 ] || { echo "scaling: too little time left to train; call again" | tee -a $log; exit 0; }
  minutes=$(train_minutes 100)
  d train --config lab/configs/gpu_smollm2.yaml --target $T --data $D --run-dir $run $([ -d $run ] && echo --resume) \
    ${CURVE_ARGS-$OLD_RECIPE} train.data_fraction=$F train.max_steps=$STEPS train.max_minutes=$minutes train.smoke_every=400 \
    train.smoke_max_new_tokens=64 train.ckpt_every=400 ${DEV:-} ${SMOKE_ARGS:-} "$@"
  tar czf $OUT/train.tgz -C $run train_result.json metrics.jsonl config.yaml
  finished $run \
    || { echo "scaling: training continues in the next call" | tee -a $log; exit 0; }
fi

[ "${UNTIL:-}" != train ] || { echo "scaling: trained; the bench is left (UNTIL=train)" | tee -a $log; exit 0; }
[ $(left) -gt 170 ] || { echo "scaling: too little time left for the bench; call again" | tee -a $log; exit 0; }
d bench --release --target $T --dtype bfloat16 --device cuda --draft $run/draft --prompt-set v1 \
  --baselines engine_plain --results-dir $S/results-${RUN_NAME:-$F} --tag "${RUN_NAME:-fraction-$F}" ${DEV:-} ${BENCH_ARGS:-}
d report $run
tar czf $OUT/done.tgz -C $run train_result.json metrics.jsonl config.yaml report -C $S results-${RUN_NAME:-$F}
echo "scaling: done" | tee -a $log
