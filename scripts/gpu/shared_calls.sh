#!/usr/bin/env bash
# One warm H200 shared by issue 26's checks and issue 25's curve points (2026-12-03). A command's
# processes end with it, except a new session's (setsid), which runs until the machine goes back:
# so `start` launches this script's `master` that way, and the calls after it only stage files
# and `poll`. What may share the GPU runs side by side; the bench whose speed is a result runs
# alone, with the optional extra run paused (SIGSTOP) meanwhile.
# Device calls straight after each other (the machine goes back 30 s after a call):
#   0. carries .dev/a .dev/p .whl: mkdir -p /tmp/m /tmp/prompts && cp .dev/a/* /tmp/m/ &&
#      tar xzf .dev/p/prompts.tgz -C /tmp/prompts
#   1. carries .dev/b .dev/j .whl: bash scripts/gpu/shared_calls.sh start
#   2-6. carry the Gemma parts (.dev/g_part_a?; ae and af together): mkdir -p /tmp/g &&
#      cp .dev/g_part_*/part_* /tmp/g/ (the last adds && touch /tmp/g/ready)
#   7.. carry .whl: bash scripts/gpu/shared_calls.sh poll [SECONDS], until it prints "master: done"
# The master, side by side:
#   - data_scaling.sh FRACTION=0.25 and 0.5 (RESTORE=1 from .dev/j; both share /tmp/scale/data);
#     their benches overlap other work: their tau and identity are results, their speeds are not;
#   - EXTRA (KEY=VALUE train args, e.g. "train.batch_size=64"): a third run on all the data,
#     named NAME, paused while the Gemma bench runs (its speed is not a result either);
#   - cuda_tests.sh, then device_map_check.sh;
#   - once /tmp/g/ready: second_arch_release.sh UNTIL=train;
# then, when all but EXTRA are done, second_arch_release.sh's bench alone.
# Each job's output is under /tmp/work/out/<job>/ and comes back as $OUT/work.tgz from `poll`.
source scripts/gpu/common.sh
W=/tmp/work
job() {  # job NAME ENV... : scripts/gpu/<script> with its output under $W/out/NAME
  local name=$1; shift; mkdir -p $W/out/$name
  env OUT=$W/out/$name "$@" > $W/out/$name.txt 2>&1 || echo "$name: exit $?" >> $W/out/$name.txt
  touch $W/out/$name.done
}
points() {
  job s0.25 FRACTION=0.25 RESTORE=1 JDIR=$W/j CALL_S=3000 bash scripts/gpu/data_scaling.sh &
  until [ -f /tmp/scale/data/vocab.safetensors ] || [ -f $W/out/s0.25.done ]; do sleep 5; done
  job s0.5 FRACTION=0.5 CALL_S=3000 bash scripts/gpu/data_scaling.sh &
  [ -z "${EXTRA:-}" ] || job ${NAME:-extra} FRACTION=1.0 RUN_NAME=${NAME:-extra} CALL_S=3000 \
    bash scripts/gpu/data_scaling.sh $EXTRA &
  wait
}
checks() { job cuda-tests TESTS_S=300 bash scripts/gpu/cuda_tests.sh; job device-map bash scripts/gpu/device_map_check.sh ${DMC_ARGS:-}; }
gemma_train() {
  until [ -f /tmp/g/ready ]; do sleep 5; done
  job arch2 UNTIL=train CALL_S=3000 bash scripts/gpu/second_arch_release.sh
}
master() {
  mkdir -p $W/out && cp -r .dev/j $W/j
  export BENCH_ARGS="bench.sampled_temperatures=[]"
  points & p=$!; checks & c=$!; gemma_train & g=$!
  # The extra run is not waited for: it is paused during the Gemma bench and then resumed.
  wait $c $g; until [ -f $W/out/s0.25.done ] && [ -f $W/out/s0.5.done ]; do sleep 5; done
  pkill -STOP -f "/tmp/scale/run-${NAME:-extra}" || true
  echo "master: Gemma bench alone from $(date -u +%T)"
  job arch2-bench CALL_S=3000 bash scripts/gpu/second_arch_release.sh
  pkill -CONT -f "/tmp/scale/run-${NAME:-extra}" || true
  wait $p; touch $W/done; echo "master: done $(date -u +%T)"
}
case ${1:?start, poll or master} in
  start) mkdir -p $W; setsid nohup bash scripts/gpu/shared_calls.sh master > $W/master.log 2>&1 < /dev/null &
         sleep 20; cat $W/master.log ;;
  poll) end=$(( $(date +%s) + ${2:-540} ))
        until [ -f $W/done ] || [ $(date +%s) -ge $end ]; do sleep 10; done
        tar czf $OUT/work.tgz --exclude='*.safetensors' --exclude='replies.jsonl.gz.*' -C $W out master.log || true
        cat $W/master.log; for f in $W/out/*.txt; do echo "== $f"; tail -n 4 $f; done
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader ;;
  master) master ;;
esac
