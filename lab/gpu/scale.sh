#!/usr/bin/env bash
# Issue 47 items 1, 2 and 4 on one H200: lab/gpu/scale.py (see its docstring). The 36B and 8B
# sections build random weights on the GPU (nothing downloaded); the peer needs the SmolLM2 GGUF
# (.dev/a, .dev/b as for one_engine_sweep.sh), the prompts (.dev/p), the gguf wheel (.whl) and
# the wheels staged here: `bash lab/gpu/scale.sh stage` (on this machine, once) downloads
#   .dev/s1: bitsandbytes 0.50.2 (its CUDA 13.0 library inside) and torchao 0.18.0 (43 + 3 MB)
#   .dev/s2: pyarrow (55 MB; speculators' datasets needs it)
#   .dev/s3: speculators 0.9.0 and the rest of its dependencies not on the GPU machine (26 MB)
# (cp312 manylinux wheels, no torch: the machine's torch 2.11 and transformers 5.17 satisfy it).
# Device calls straight after each other (the machine goes back 30 s idle):
#   1. carries .dev/a .dev/p:  mkdir -p /tmp/m /tmp/sw /tmp/prompts && cp .dev/a/* /tmp/m/ &&
#                              tar xf .dev/p/prompts.txz -C /tmp/prompts
#   2. carries .dev/b .whl:    cp .dev/b/* /tmp/m/ && python3 -m pip install -q --no-index --no-deps
#                              --target /tmp/site .whl/*.whl
#   3. carries .dev/s1:        cp .dev/s1/* /tmp/sw/
#   4. carries .dev/s2:        cp .dev/s2/* /tmp/sw/
#   5. carries .dev/s3:        cp .dev/s3/* /tmp/sw/ && bash lab/gpu/scale.sh start [SECONDS] [ARGS]
#   6.. bash lab/gpu/scale.sh poll SECONDS, until it prints "scale: done"
# `start` installs the wheels (bitsandbytes and torchao into /tmp/site beside gguf; speculators
# and its dependencies into /tmp/spec/site-packages, which only speculators' own process sees: the
# name matters, as dill (datasets' fingerprints) pickles a module outside the interpreter's prefix
# by value unless its path holds "site-packages", and pyarrow's module cannot be), makes the
# peer's data (`draftling data` of gpu_smollm2.yaml, PEER_PROMPTS per file, default 200, and its
# vocab), then runs scale.py in a session of its own (it outlives the call); each poll waits up
# to SECONDS and copies the log and, once done, results.tgz (scale.json, manifest, sections and
# the peer's logs; not the hidden states) to $OUT. SCALE_S (1800) caps the whole run.
# Estimated device time (not yet measured): staging 5 calls x ~10 s; data ~90 s; 36B section
# ~4 min (build and quantize ~1-2 min, 60 steps at ~1-2 s); 8B ~5 min (build, compiles,
# decode, regen, training); peer ~5 min (2 x 400 steps, hidden states, evaluation): about
# 16-18 minutes with the polls, under one 30-minute lease.
W=/tmp/work/scale
SW=/tmp/sw
SPEC_WHEELS="speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
xxhash==4.1.0 fsspec==2026.7.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 openai==3.63.0 anyio==4.16.0 sniffio==1.3.1
h11==0.16.0 httpcore==1.0.9 httpcore2==2.17.0 httpx==0.29.0 httpx2==2.17.0 jiter==0.19.0 truststore==0.10.5
pydantic==2.13.4 pydantic-core==2.46.4 pydantic-settings==2.14.1 typing-inspection==0.4.2 annotated-types==0.7.0
python-dotenv==1.2.2 typer==0.29.2 click==8.5.1 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0
mdurl==0.1.2 pygments==2.20.0 annotated-doc==0.0.7 loguru==0.7.3 psutil==7.2.2 protobuf==7.36.2
python-dateutil==2.9.0.post0 six==1.17.0"
dl() {  # dl DIR SPEC...: cp312 linux wheels, no dependencies
  local d=$1; shift
  for w in "$@"; do
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d $d "$w" || { echo "stage: no wheel for $w"; return 1; }
  done
}
case "${1:-}" in
  stage)
    mkdir -p .dev/s1 .dev/s2 .dev/s3
    dl .dev/s1 bitsandbytes==0.50.2 torchao==0.18.0
    dl .dev/s2 pyarrow==26.0.1
    dl .dev/s3 pandas==3.1.1 $SPEC_WHEELS
    du -sh .dev/s1 .dev/s2 .dev/s3 ;;
  start)
    NEED_TARGET=1 source lab/gpu/common.sh
    mkdir -p $W
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $SW/bitsandbytes-*.whl $SW/torchao-*.whl \
      || echo "scale: bitsandbytes/torchao install failed (the 36B section records it)"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spec/site-packages \
      $(ls $SW/*.whl | grep -v -e bitsandbytes -e torchao -e gguf) || echo "scale: speculators install failed"
    echo "$(date -u +%FT%TZ)" > $W/started
    wait_s=${2:-540}; shift 2 || shift $#
    setsid bash -c "source lab/gpu/common.sh; set +e; D=$W/data; \
      subset_data \$D $W data.max_prompts_per_file=${PEER_PROMPTS:-200} > /dev/null; \
      SPEC_PYTHONPATH=/tmp/spec/site-packages:/tmp/site timeout ${SCALE_S:-1800} python3 lab/gpu/scale.py --out $W/results \
      --target $T --data \$D --spec-python python3 $* > $W/log.txt 2>&1; echo \"exit \$?\" > $W/done" \
      < /dev/null > /dev/null 2>&1 &
    exec bash $0 poll $wait_s ;;
  poll)
    for _ in $(seq ${2:-540}); do [ -f $W/done ] && break; sleep 1; done
    cp $W/log.txt $W/started $W/data_log.txt $OUT/ 2>/dev/null || true
    # Each finished section's JSON comes back at once, and its errors are printed: a run that
    # outlives the lease still reports what failed and why.
    mkdir -p $OUT/sections && cp $W/results/sections/*.json $OUT/sections/ 2>/dev/null || true
    grep -ho '"error": "[^"]*"' $W/results/sections/*.json 2>/dev/null | cut -c1-300 || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/gpu.txt || true
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $OUT/versions.txt 2>&1 || true
    if [ -f $W/done ]; then
      tar czf $OUT/results.tgz -C $W/results scale.json manifest.json sections \
        $(cd $W/results && ls -d peer/spec/spec_log.txt peer/spec/metrics.jsonl 2>/dev/null)
      echo "scale: done ($(cat $W/done))"
    else tail -3 $W/log.txt; echo "scale: running"; fi ;;
  *) echo "usage: $0 stage | start [SECONDS] [ARGS] | poll [SECONDS]"; exit 2 ;;
esac
