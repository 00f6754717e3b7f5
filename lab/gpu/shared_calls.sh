#!/usr/bin/env bash
# One warm H200 for several jobs (2026-12-03). A command's processes end with it, except a new
# session's (setsid), which runs until the machine goes back: so `start` launches this script's
# `master` that way, and the calls after it only stage files and `poll`. The master runs JOBS in
# order, one at a time: side by side, two data steps and the tests slowed each other to a crawl.
#   graphs, compile   the two halves of cuda_tests.sh
#   arch2             second_arch_release.sh (Gemma 3 270M), once /tmp/g/ready
#   device-map        device_map_check.sh
#   points            data_scaling.sh for each FRACTION in POINTS (default "0.25 0.5") side by
#                     side (the first with RESTORE=1 from .dev/j if carried, else it
#                     regenerates; `poll` brings the replies and journal back for .dev/j),
#                     and EXTRA (train KEY=VALUEs) on all the data as run NAME; their tau and
#                     identity are results, their speeds are not (they share the GPU)
#   recipe            data_scaling.sh on all the data with gpu_smollm2's own recipe (CURVE_ARGS
#                     empty; it stops at convergence) as run RECIPE_NAME (default "recipe"),
#                     restored from the journal staged in /tmp/work/j (see call 0b),
#                     STEPS=RECIPE_STEPS (default 5600) and the train KEY=VALUEs of RECIPE; alone,
#                     so its bench's speeds are results. 2026-12-03, 0fc3677 (RECIPE=
#                     "train.batch_size=64 train.lr=7e-4 train.warmup_steps=60", now the config's
#                     defaults): converged at step 3,600 after 575 s of training; 16.8 min from
#                     start to "master: done". An annealed variant: RECIPE_NAME=anneal
#                     RECIPE_STEPS=3600 RECIPE="train.stop_on_convergence=false". Without a staged
#                     journal it regenerates the replies (about 5 min; poll brings them back).
#                     BENCH_ARGS='bench.sampled_temperatures=[0.7,1.0]' (the release default) adds
#                     the sampled figures to its bench (about 3 min more); `head` brings the head back
#   sampled           the curve's sampled point: data_scaling.sh with SAMPLES=2 on all the data
#                     (the greedy replies restored from /tmp/work/j, one sampled reply per prompt
#                     written), the curve's recipe (OLD_RECIPE, 2,394 steps). 2026-12-04, db907a7:
#                     19.1 min from start to done (data 552 s, training 357 s, bench 183 s); poll
#                     brings back all 84,516 replies (26 MB: keep them in .dev/j2 to skip the data)
#   step-scaling      step_fixed_cost.py: training s/step and tok/s at BATCHES (default 32,64,128)
#                     sequences per step, the code as it is, synthetic lengths (about 3 min)
#   fixed-cost        train_fixed_cost.sh: real-data training tok/s at 32 and 16 sequences per
#                     step, before the issue-27 fixes (.dev/old/src, carried) and after
#                     (REPEATS, STEPS); FC_BATCHES overrides "32 16"
#   x2                ddp_scaling.sh on nvidia-h200-x2 (issue 27): 1 and 2 GPUs at BATCHES, FSDP
#                     and the split teacher; about 70 s of data, then about 100 s per run
#   both              points (data and training) beside graphs, compile and arch2's data and
#                     training; then arch2's bench and the points' benches, one at a time
#                     (TESTS=0 leaves the CUDA tests out)
# Device calls straight after each other (the machine goes back 30 s after a call):
#   0. carries .dev/a .dev/p .whl: mkdir -p /tmp/m /tmp/prompts && cp .dev/a/* /tmp/m/ &&
#      tar xzf .dev/p/prompts.tgz -C /tmp/prompts
#   0b. for recipe: carries .dev/p .dev/j .whl: mkdir -p /tmp/work /tmp/prompts &&
#      cp -r .dev/j /tmp/work/j && tar xzf .dev/p/prompts.tgz -C /tmp/prompts (then 0 without .dev/p)
#   1. carries .dev/b .whl (.dev/b with .dev/j is over the 64 MiB carry with the tree: for points,
#      carry .dev/j in a call of its own first): JOBS=... bash lab/gpu/shared_calls.sh start
#   2-6. carry the Gemma parts (.dev/g_part_a?; ae and af together): mkdir -p /tmp/g &&
#      cp .dev/g_part_*/part_* /tmp/g/ (the last adds && touch /tmp/g/ready)
#   7.. bash lab/gpu/shared_calls.sh poll [SECONDS], until it prints "master: done"
# The trained head (run RECIPE_NAME's final draft, about 112 MB in fp32) is over what one call
# brings back (64 MiB): `bash lab/gpu/shared_calls.sh head SECONDS "PIECES"` waits up to
# SECONDS for it, tars <run>/draft once into 15,000,000-byte pieces draft.tar.aa, .ab, ... with
# its sha256, and copies PIECES (e.g. "aa ab ac ad"; the rest in a later call) and the data's
# vocab.safetensors to $OUT. Here: cat draft.tar.* | sha256sum (against the printed one), tar xf.
# Each job's output is under /tmp/work/out/<job>/ and comes back as $OUT/work.tgz from `poll`.
# Measured on 2026-12-03 (second machine, jobs one at a time): graphs 78 s; device-map 2 min;
# arch2 11.5 min (data 2 min with 64 s of regeneration, training 161 s, bench 271 s with a 69 s
# warm-up); compile 91 s. Staging a part costs about 5 s of held time, a fresh machine about 90 s.
# 2026-12-03, third run (both, POINTS=0.25, TESTS=0, no journal carried): the point's data stage
# (regenerating all 42,855 replies, tokenizing, vocab) took about 14 min beside arch2's data and
# training, against about 5 min alone on an earlier machine: regenerate alone, and carry the
# journal (.dev/j, from poll) where one exists. arch2's bench then ran in 285 s.
# 2026-12-03, fourth run (JOBS="step-scaling points", POINTS="0.25 0.5", no journal): step-scaling
# 161 s; points 14.7 min: the data stage alone about 223 s (42,855 replies), both trainings side by
# side (324 s and 340 s of training), then both benches side by side.
# Issue each call as soon as the last returns. Never `pkill -f PATTERN` in a call whose own
# command line holds PATTERN: it kills the call's own shell and wrapper, and on 2026-12-03 the
# machine went with them. Kill by a PID file instead.
source lab/gpu/common.sh
W=/tmp/work
job() {  # job NAME ENV... : lab/gpu/<script> with its output under $W/out/NAME
  local name=$1; shift; mkdir -p $W/out/$name
  env OUT=$W/out/$name "$@" > $W/out/$name.txt 2>&1 || echo "$name: exit $?" >> $W/out/$name.txt
  touch $W/out/$name.done
}
points() {  # the curve points POINTS side by side; the first makes the data the others wait for
  local first="" sfx=${1:-} restore=0  # sfx names a later pass's output apart from the first's
  [ -d $W/j ] || [ ! -d .dev/j ] || cp -r .dev/j $W/j
  [ ! -f $W/j/journal.json ] || restore=1  # without a carried journal, the first regenerates
  for f in ${POINTS:-0.25 0.5}; do
    if [ -z "$first" ]; then
      first=$f
      job s$f$sfx FRACTION=$f RESTORE=$restore JDIR=$W/j CALL_S=3000 bash lab/gpu/data_scaling.sh &
      until [ -f /tmp/scale/data/vocab.safetensors ] || [ -f $W/out/s$f$sfx.done ]; do sleep 5; done
    else
      job s$f$sfx FRACTION=$f CALL_S=3000 bash lab/gpu/data_scaling.sh &
    fi
  done
  [ -z "${EXTRA:-}" ] || job ${NAME:-extra} FRACTION=1.0 RUN_NAME=${NAME:-extra} CALL_S=3000 \
    bash lab/gpu/data_scaling.sh $EXTRA &
  wait
}
tests() { job cuda-tests-$1 TESTS_S=240 HALVES=$1 bash lab/gpu/cuda_tests.sh; }
gemma() {
  until [ -f /tmp/g/ready ]; do sleep 5; done
  job ${1:-arch2} QUIET=0 CALL_S=3000 bash lab/gpu/second_arch_release.sh
}
both() {  # the points' data and training beside the tests and arch2's data and training; then
  # each bench alone, since a bench times speed
  (export UNTIL=train; points) & local pts=$!
  [ "${TESTS:-1}" = 0 ] || { tests graphs; tests compile; }  # TESTS=0: no CUDA tests
  (export UNTIL=train; gemma arch2)
  wait $pts
  gemma arch2-bench
  points -bench
}
master() {  # JOBS in order, one at a time (side by side, CPU-heavy steps slowed each other to a crawl)
  mkdir -p $W/out
  export BENCH_ARGS="${BENCH_ARGS-bench.sampled_temperatures=[]}"  # set: the bench's flags, sampled ones too
  for j in ${JOBS:-graphs device-map arch2 compile}; do
    echo "master: $j from $(date -u +%T)"
    case $j in
      graphs|compile) tests $j ;;
      arch2) gemma ;;
      device-map) job device-map bash lab/gpu/device_map_check.sh ${DMC_ARGS:-} ;;
      step-scaling) job step-scaling bash -c "python3 lab/gpu/step_fixed_cost.py --target $T --out \$OUT \
                      --batches ${BATCHES:-32,64,128} --modes after --measured 20" ;;
      fixed-cost) job fixed-cost bash lab/gpu/train_fixed_cost.sh ;;
      x2) job x2 bash lab/gpu/ddp_scaling.sh ;;
      points) points ;;
      recipe) local r=${RECIPE_NAME:-recipe} restore=0
              [ ! -f $W/j/journal.json ] || restore=1  # without a staged journal, it regenerates
              job $r FRACTION=1.0 RUN_NAME=$r RESTORE=$restore JDIR=$W/j CURVE_ARGS= STEPS=${RECIPE_STEPS:-5600} CALL_S=3000 \
                bash lab/gpu/data_scaling.sh ${RECIPE:-} ;;
      sampled) job sampled SAMPLES=2 FRACTION=1.0 RUN_NAME=sampled-1.0 RESTORE=1 JDIR=$W/j CALL_S=3000 \
                 bash lab/gpu/data_scaling.sh ;;
      both) both ;;
    esac
  done
  touch $W/done; echo "master: done $(date -u +%T)"
}
case ${1:?start, poll, head or master} in
  start) mkdir -p $W; rm -f $W/done; setsid nohup bash lab/gpu/shared_calls.sh master > $W/master.log 2>&1 < /dev/null &
         sleep 20; cat $W/master.log ;;
  poll) end=$(( $(date +%s) + ${2:-540} ))
        until [ -f $W/done ] || [ $(date +%s) -ge $end ]; do sleep 10; done
        tar czf $OUT/work.tgz --exclude='*.safetensors' --exclude='replies.jsonl.gz.*' --exclude='*/runs/*' \
          --exclude='*.pt' -C $W out master.log || true
        cp $W/out/*/replies.jsonl.gz.* $W/out/*/journal.json $OUT/ 2>/dev/null || true  # the replies, for RESTORE
        cat $W/master.log; for f in $W/out/*.txt; do echo "== $f"; tail -n 4 $f; done
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
  head) r=/tmp/scale/run-${RECIPE_NAME:-recipe} H=$W/head end=$(( $(date +%s) + ${2:-0} ))
        until [ -f $r/train_result.json ] || [ $(date +%s) -ge $end ]; do sleep 10; done
        [ -f $r/train_result.json ] || { echo "head: $r has no final draft yet"; tail -n 3 $W/out/*.txt || true; exit 0; }
        if [ ! -f $H/draft.tar.sha256 ]; then
          mkdir -p $H && tar cf $H/draft.tar -C $r draft && (cd $H && split -b 15000000 draft.tar draft.tar. \
            && sha256sum draft.tar > draft.tar.sha256 && rm draft.tar)
        fi
        (cd $r/draft && sha256sum *); cat $H/draft.tar.sha256; ls -l $H; cat $r/train_result.json
        for p in ${3:-}; do cp $H/draft.tar.$p $OUT/; done
        cp /tmp/scale/data/vocab.safetensors $OUT/ 2>/dev/null || true ;;
  master) master ;;
esac
