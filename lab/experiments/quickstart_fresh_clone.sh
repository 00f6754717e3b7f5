#!/usr/bin/env bash
# README command 1, as a new user runs it: clone this checkout's HEAD into an empty folder in /tmp
# (no shared/ above it, no DRAFTLING_SHARED_PROMPTS), run setup and the quickstart, and write
# bench/results/<date>-quickstart-cpu-<commit>-<label>.json: the summary with a manifest
# (commit, command, machine, date, setup and quickstart wall times).
#
#   bash lab/experiments/quickstart_fresh_clone.sh LABEL [quickstart overrides...]
#   e.g. ... fp32 data.regen.dtype=null train.compute_dtype=float32   (a CPU without fast bf16)
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
LABEL=${1:?label, e.g. auto or fp32}; shift
COMMIT=$(git -C "$REPO" rev-parse --short HEAD)
DIR=$(mktemp -d /tmp/draftling-fresh-XXXX)
git clone -q "$REPO" "$DIR/draftling"
cd "$DIR/draftling"
unset DRAFTLING_SHARED_PROMPTS
export PYTHONUNBUFFERED=1
t0=$(date +%s.%N)
bash scripts/setup.sh
t1=$(date +%s.%N)
python3 -m draftling quickstart --out runs/quickstart "$@" 2>&1 | tee "$DIR/quickstart.log"
t2=$(date +%s.%N)
OUT="$REPO/bench/results/$(date +%F)-quickstart-cpu-$COMMIT-$LABEL.json"
python3 - "$OUT" "$COMMIT" "$t0" "$t1" "$t2" "$*" <<'EOF'
import datetime, json, os, platform, sys
out, commit, t0, t1, t2, overrides = sys.argv[1:]
t0, t1, t2 = map(float, (t0, t1, t2))
flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
from draftling.hardware import bf16_matmul_is_faster
summary = json.load(open("runs/quickstart/summary.json"))
record = {
    "what": "README command 1 from a fresh clone in an empty folder (no shared/, no hub)",
    "commit": commit, "date": datetime.date.today().isoformat(),
    "command": "bash scripts/setup.sh && python3 -m draftling quickstart --out runs/quickstart" + (f" {overrides}" if overrides else ""),
    "config": "quickstart_cpu" + (f" with {overrides}" if overrides else ""),
    "machine": {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
                "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
                "amx_bf16": "amx_bf16" in flags, "bf16_probe_faster": bf16_matmul_is_faster("cpu")},
    "setup_s": round(t1 - t0, 1), "quickstart_s": round(t2 - t1, 1), "total_s": round(t2 - t0, 1),
    "summary": summary,
}
os.makedirs(os.path.dirname(out), exist_ok=True)
with open(out, "w") as f:
    json.dump(record, f, indent=1)
print(f"wrote {out}: total {record['total_s']} s (setup {record['setup_s']}, quickstart {record['quickstart_s']}), "
      f"tau_chain3 {summary['tau_chain3']}, identical {summary['identical_to_greedy']}")
EOF
