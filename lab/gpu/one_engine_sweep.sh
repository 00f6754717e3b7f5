#!/usr/bin/env bash
# Issue 46's sweep (lab/gpu/one_engine_sweep.py) with the GPU recipe head of
# lab/configs/gpu_smollm2.yaml (draft.safetensors, 112 MB fp32, sha256 5cac9a99..., in three
# pieces of `split -b 50000000`: .dev/h1/part_aa, .dev/h2/part_ab, .dev/h3/part_ac with
# draft_config.json). Device calls straight after each other (the machine goes back 30 s idle):
#   1. carries .dev/a:  mkdir -p /tmp/m /tmp/h && cp .dev/a/* /tmp/m/
#   2. carries .dev/b:  cp .dev/b/* /tmp/m/
#   3. carries .dev/h1: cp .dev/h1/* /tmp/h/
#   4. carries .dev/h2: cp .dev/h2/* /tmp/h/
#   5. carries .dev/h3 .whl: bash lab/gpu/one_engine_sweep.sh start [SECONDS] [ARGS]
#   6.. bash lab/gpu/one_engine_sweep.sh poll SECONDS, until it prints "sweep: done"
# `start` runs the sweep in a session of its own (it outlives the call) and polls; each poll
# waits up to SECONDS and copies the log and, once done, the results to $OUT. SWEEP_S (900) caps
# the run: after a device-side assert the process can hang instead of exiting.
H=/tmp/h W=/tmp/work/one-engine
case "${1:-}" in
  start)
    source lab/gpu/common.sh
    mkdir -p $H/draft $W
    cp .dev/h3/* $H/
    cat $H/part_* > $H/draft/draft.safetensors && cp $H/draft_config.json $H/draft/
    sha=$(sha256sum $H/draft/draft.safetensors | cut -c1-16)
    [ "$sha" = 5cac9a9991473d54 ] || { echo "draft checksum $sha != 5cac9a9991473d54"; exit 3; }
    echo "$(date -u +%FT%TZ)" > $W/started
    wait_s=${2:-540}; shift 2 || shift $#
    setsid bash -c "source lab/gpu/common.sh; timeout ${SWEEP_S:-900} python3 lab/gpu/one_engine_sweep.py --target $T \
      --draft $H/draft --out $W $* > $W/log.txt 2>&1; echo \"exit \$?\" > $W/done" \
      < /dev/null > /dev/null 2>&1 &
    exec bash $0 poll $wait_s ;;
  poll)
    for _ in $(seq ${2:-540}); do [ -f $W/done ] && break; sleep 1; done
    cp $W/log.txt $W/started $OUT/ 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/gpu.txt || true
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $OUT/versions.txt 2>&1 || true
    if [ -f $W/done ]; then tar czf $OUT/results.tgz -C $W results; echo "sweep: done ($(cat $W/done))"
    else tail -3 $W/log.txt; echo "sweep: running"; fi ;;
  *) echo "usage: $0 start [SECONDS] [ARGS] | poll [SECONDS]"; exit 2 ;;
esac
