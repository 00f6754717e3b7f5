#!/usr/bin/env bash
# Device call: the training-step bench (lab/benches/train_bench.py). Memory of a 36B-class draft
# with every memory feature on, each feature turned off in turn, and at seq 1024..8192, each
# against train/memory.py's estimate; then tokens/s of the trainer's default path against the
# eager SDPA path with the SmolLM2 teacher. Writes $OUT/train-bench.json (rewritten after
# every run) and tees the log to $OUT/train_bench_log.txt, so a call cut at its time limit
# still returns what finished. Extra args go to the bench, e.g. --quick or --phases memory,throughput.
source lab/gpu/common.sh
start=$(date +%s)
python3 lab/benches/train_bench.py --out $OUT/train-bench.json --target $T "$@" 2>&1 \
  | tee $OUT/train_bench_log.txt
echo "{\"wall_s\": $(( $(date +%s) - start ))}" > $OUT/train_bench_wall.json
