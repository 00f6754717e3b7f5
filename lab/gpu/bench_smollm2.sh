#!/usr/bin/env bash
# Device call, right after train_smollm2.sh on the same warm machine: the release bench
# of the trained head against the engine without speculation (and, unless told otherwise
# with --baselines, the three HF baselines on one prompt per workload).
source lab/gpu/common.sh
# The draft: left in /tmp/run by train_smollm2.sh on this warm machine, or carried in .dev/d
# as the parts that lab/gpu/draft_transport.py packed.
if [ ! -f /tmp/run/train/draft/draft.safetensors ] && [ -d .dev/d ]; then
  python3 lab/gpu/draft_transport.py unpack .dev/d /tmp/run/train/draft
fi
[ -f /tmp/run/train/draft/draft.safetensors ] || { echo "no trained draft in /tmp/run (machine went cold?)"; exit 4; }
python3 -m draftling bench --release --target $T --dtype bfloat16 --device cuda \
  --draft /tmp/run/train/draft --prompt-set v1 --baseline-prompts-per-workload 1 \
  --results-dir $OUT/results "$@" 2>&1 | tee $OUT/bench_log.txt
