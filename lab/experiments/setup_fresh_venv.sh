#!/usr/bin/env bash
# How long README command 1's setup takes in an environment with nothing installed: a fresh
# clone of HEAD and a new venv, then `PYTHON=<venv python> bash scripts/setup.sh`, timed.
# Writes bench/results/<date>-setup-fresh-venv-<commit>.json.
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
COMMIT=$(git -C "$REPO" rev-parse --short HEAD)
DIR=$(mktemp -d /tmp/draftling-setup-XXXX)
git clone -q "$REPO" "$DIR/draftling"
python3 -m venv "$DIR/venv"
cd "$DIR/draftling"
t0=$(date +%s.%N)
PYTHON="$DIR/venv/bin/python" bash scripts/setup.sh
t1=$(date +%s.%N)
OUT="$REPO/bench/results/$(date +%F)-setup-fresh-venv-$COMMIT.json"
"$DIR/venv/bin/python" - "$OUT" "$COMMIT" "$t0" "$t1" <<'PY'
import datetime, json, os, platform, sys
out, commit, t0, t1 = sys.argv[1:]
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
import torch, transformers
json.dump({"what": "scripts/setup.sh in a new venv (nothing installed) on a fresh clone",
           "commit": commit, "date": datetime.date.today().isoformat(),
           "command": "PYTHON=<new venv>/bin/python bash scripts/setup.sh",
           "machine": {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()},
           "installed": {"torch": torch.__version__, "transformers": transformers.__version__},
           "setup_s": round(float(t1) - float(t0), 1)}, open(out, "w"), indent=1)
print(f"wrote {out}: setup {float(t1) - float(t0):.1f} s")
PY
