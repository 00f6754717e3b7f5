#!/usr/bin/env bash
# Issue 21's counts, from the two tests that make them: every bad input through the real
# command (tests/cli/test_bad_inputs_cli.py) and the SIGKILL trials of training
# (tests/test_faults.py). Writes bench/results/<date>-fault-probe-<commit>-<machine>/{result,manifest}.json.
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$REPO"
COMMIT=$(git rev-parse --short HEAD)
TMP=$(mktemp -d /tmp/draftling-faults-XXXX)
DRAFTLING_BAD_INPUTS_JSON="$TMP/bad.json" DRAFTLING_FAULTS_JSON="$TMP/kills.json" DRAFTLING_FAULT_KILLS=20 \
  python3 -m pytest -q -p no:cacheprovider tests/cli/test_bad_inputs_cli.py tests/test_faults.py | tail -3 \
  || echo "some trials failed: the counts below say which"
python3 - "$TMP" "$COMMIT" <<'PY'
import datetime, json, os, platform, sys
tmp, commit = sys.argv[1:]
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
kind = "epyc" if "EPYC" in model else "xeon" if "Xeon" in model else "x86"
machine = f"cpu-{kind}-{os.cpu_count()}core"
today = datetime.date.today().isoformat()
bad, kills = json.load(open(f"{tmp}/bad.json")), json.load(open(f"{tmp}/kills.json"))
out = f"bench/results/{today}-fault-probe-{commit}-{machine}"
os.makedirs(out, exist_ok=True)
json.dump({"bad_inputs": bad["counts"],
           "bad_input_cases": [{k: c[k] for k in ("case", "exit", "outcome")} for c in bad["cases"]],
           "kills": kills}, open(f"{out}/result.json", "w"), indent=1)
json.dump({"commit": commit, "date": today, "machine": f"{machine} ({model}, python {platform.python_version()})",
           "command": "bash lab/experiments/fault_probe.sh",
           "config": "tests/cli/test_bad_inputs_cli.py CASES; tests/test_faults.py QUICK, DATA_OPTS, TRAIN_OPTS",
           "files": ["result.json"],
           "notes": "issue 21: bad inputs through the real command, and SIGKILLs during training"},
          open(f"{out}/manifest.json", "w"), indent=1)
print(f"wrote {out}: {bad['counts']}, {kills['kills_survived_bitwise_equal']}/{kills['kills']} kills survived")
PY
