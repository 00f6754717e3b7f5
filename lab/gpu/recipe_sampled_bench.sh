#!/usr/bin/env bash
# The v1 release bench of the GPU recipe head (bench/results/2026-12-05-recipe-92bfb51-nvidia-h100)
# with its sampled figures (temperatures 0.7 and 1.0) beside the greedy ones, against the engine
# without speculation, in bf16. The head (draft.safetensors, 112 MB fp32, sha256 5cac9a99...) goes
# in three pieces of `split -b 50000000`: .dev/h1/part_aa, .dev/h2/part_ab, .dev/h3/part_ac with
# draft_config.json. Device calls straight after each other (the machine goes back 30 s idle):
#   1. carries .dev/a:  mkdir -p /tmp/m /tmp/h && cp .dev/a/* /tmp/m/
#   2. carries .dev/b:  cp .dev/b/* /tmp/m/
#   3. carries .dev/h1: cp .dev/h1/* /tmp/h/
#   4. carries .dev/h2: cp .dev/h2/* /tmp/h/
#   5. carries .dev/h3 .whl: bash lab/gpu/recipe_sampled_bench.sh start
#   6.. bash lab/gpu/recipe_sampled_bench.sh poll SECONDS, until it prints "bench: done"
# `start` runs the bench in a session of its own (it outlives the call) and polls; each poll
# waits up to SECONDS and copies the log and, once done, the results to $OUT.
NEED_TARGET=${NEED_TARGET:-1}
H=/tmp/h W=/tmp/work/sampled
case "${1:-}" in
  start)
    source lab/gpu/common.sh
    mkdir -p $H/draft $W
    cp .dev/h3/* $H/
    cat $H/part_* > $H/draft/draft.safetensors && cp $H/draft_config.json $H/draft/
    sha=$(sha256sum $H/draft/draft.safetensors | cut -c1-16)
    [ "$sha" = 5cac9a9991473d54 ] || { echo "draft checksum $sha != 5cac9a9991473d54"; exit 3; }
    echo "$(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(date -u +%FT%TZ)" > $W/started
    setsid bash -c "source lab/gpu/common.sh; python3 -m draftling bench --release --target $T \
      --dtype bfloat16 --device cuda --draft $H/draft --prompt-set v1 --baselines engine_plain \
      --results-dir $W/results --tag recipe-sampled 'bench.sampled_temperatures=[0.7,1.0]' \
      > $W/log.txt 2>&1; echo \"exit \$?\" > $W/done" < /dev/null > /dev/null 2>&1 &
    exec bash $0 poll ${2:-540} ;;
  poll)
    for _ in $(seq ${2:-540}); do [ -f $W/done ] && break; sleep 1; done
    cp $W/log.txt $W/started $OUT/ 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/gpu.txt || true
    if [ -f $W/done ]; then tar czf $OUT/results.tgz -C $W results; echo "bench: done ($(cat $W/done))"
    else tail -3 $W/log.txt; echo "bench: running"; fi ;;
  *) echo "usage: $0 start|poll [SECONDS]"; exit 2 ;;
esac
