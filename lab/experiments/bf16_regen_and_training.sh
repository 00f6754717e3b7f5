#!/usr/bin/env bash
# bf16 on a CPU that multiplies it fast (AVX512-BF16/AMX): regenerate the quickstart's training
# replies with a bf16 copy of the target (validation's stay fp32) and train under bf16
# autocast, then compare heads with validation's chain walk over the same 53 fp32 sequences.
#   bash lab/experiments/bf16_regen_and_training.sh OUT [FP32_DATA]
# FP32_DATA: an earlier quickstart's data dir (fp32 replies, kept states, its vocab) for the
# bf16-autocast-only run. Each step's wall time is in its log (`time`).
set -euo pipefail
OUT=$1; FP32_DATA=${2:-}; mkdir -p "$OUT"
train() {  # NAME DATA OVERRIDES...
  name=$1; data=$2; shift 2
  { time python3 -m draftling train --config quickstart_cpu --data "$data" --run-dir "$OUT/$name" \
      train.max_minutes=0 "$@"; } > "$OUT/$name.log" 2>&1
}
if [ -n "$FP32_DATA" ]; then train fp32data_bf16train "$FP32_DATA" train.compute_dtype=bfloat16; fi
for per_file in 120 160; do
  data=$OUT/data_bf16_$per_file
  { time python3 -m draftling data --config quickstart_cpu --out "$data" data.max_prompts_per_file=$per_file; } \
      > "$OUT/data_bf16_$per_file.log" 2>&1
  python3 -m draftling vocab --data "$data" --config quickstart_cpu
done
train ep4 "$OUT/data_bf16_120"
train ep6 "$OUT/data_bf16_120" train.epochs=6
train p160_ep4 "$OUT/data_bf16_160"
# The 160-per-file head on the 120-per-file validation split (its tasks are validation in both:
# the split hashes task ids), so every head is scored on the same sequences.
python3 lab/experiments/chain_walk.py --config quickstart_cpu --draft "$OUT/p160_ep4/draft" \
    --data "$OUT/data_bf16_120/val.jsonl" --out "$OUT/p160_ep4_on_val120.json"
