#!/usr/bin/env bash
# Device call (one GPU): issue 26 item 4's fallback, the release bench on a random-weight
# Gemma 3 of gemma-3-270m's shape through the engine's general path, and the same on a random
# SmolLM2-shaped Llama on the fast and (forced) general paths (lab/gpu/second_arch_bench.py).
# $T (common.sh) serves only as the tokenizer that renders v1. Writes $OUT/second-arch-bench/
# and tees the log there. ARCH picks the runs (default gemma3), e.g.
#   ARCH=gemma3 bash lab/gpu/second_arch_bench.sh
#   ARCH=llama,llama-general bash lab/gpu/second_arch_bench.sh   # the general path's overhead
# Extra args go to the script, e.g. --prompts-per-workload 1 --max-new-tokens 64.
# Rough device time at the defaults (14 prompts, 128 new tokens): gemma3 4-5 min;
# llama,llama-general 5-7 min (the general path runs eager). One call each; timeout 600.
source lab/gpu/common.sh
dir=$OUT/second-arch-bench
mkdir -p $dir
python3 lab/gpu/second_arch_bench.py --arch "${ARCH:-gemma3}" --tokenizer $T --out $dir "$@" 2>&1 \
  | tee $dir/log.txt
