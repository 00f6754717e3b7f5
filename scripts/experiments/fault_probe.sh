#!/usr/bin/env bash
# Issue 21's counts, from the two tests that make them: every bad input through the real
# command (tests/test_bad_inputs_cli.py) and the SIGKILL trials of training
# (tests/test_faults.py). Writes bench/results/<date>-fault-probe-<commit>-<machine>.json.
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$REPO"
COMMIT=$(git rev-parse --short HEAD)
TMP=$(mktemp -d /tmp/draftling-faults-XXXX)
DRAFTLING_BAD_INPUTS_JSON="$TMP/bad.json" DRAFTLING_FAULTS_JSON="$TMP/kills.json" \
  python3 -m pytest -q -p no:cacheprovider tests/test_bad_inputs_cli.py tests/test_faults.py | tail -3
python3 - "$TMP" "$COMMIT" <<'PY'
import datetime, json, os, platform, sys
tmp, commit = sys.argv[1:]
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
machine = f"cpu{os.cpu_count()}"
bad, kills = json.load(open(f"{tmp}/bad.json")), json.load(open(f"{tmp}/kills.json"))
out = f"bench/results/{datetime.date.today().isoformat()}-fault-probe-{commit}-{machine}.json"
json.dump({"what": "issue 21: bad inputs through the real command, and SIGKILLs during training",
           "commit": commit, "date": datetime.date.today().isoformat(),
           "command": "bash scripts/experiments/fault_probe.sh",
           "machine": {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()},
           "bad_inputs": bad["counts"], "bad_input_cases": [{k: c[k] for k in ("case", "exit", "outcome")}
                                                            for c in bad["cases"]],
           "kills": kills}, open(out, "w"), indent=1)
print(f"wrote {out}: {bad['counts']}, {kills['kills_survived_bitwise_equal']}/{kills['kills']} kills survived")
PY
