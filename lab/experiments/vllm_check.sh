#!/usr/bin/env bash
# Issue 43's committed figures: a trained head served by real vLLM, both export formats, against
# draftling's engine on the same prompts (`draftling serve-check`), merged into one results JSON
# with a manifest under bench/results/<date>-vllm-check-<commit>-<machine>[-LABEL]/.
#   HEAD_NOTE="where the head came from" bash lab/experiments/vllm_check.sh DRAFT_DIR LABEL [serve-check flags...]
# Run it with vLLM installed (README "Served by vLLM": the .venv-vllm venv, PY=.venv-vllm/bin/python).
# The target is the default one unless the flags pass --target.
set -euo pipefail
cd "$(dirname "$0")/../.."
DRAFT=${1:?draft directory}; LABEL=${2:?label, e.g. quickstart}; shift 2
PY=${PY:-.venv-vllm/bin/python}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
for fmt in sglang speculators; do
  # The speculators config names the verifier by hub id; the default target's is the default here.
  $PY -m draftling export --draft "$DRAFT" --out "$W/$fmt" --format "$fmt" --target "${TARGET:-default}"
  $PY -m draftling serve-check "$W/$fmt" --target "${TARGET:-default}" --out "$W/$fmt.json" "$@" \
    2>&1 | grep -v -E "^\(|^INFO|^WARNING" | tee "$W/$fmt.log" || true  # exit 2 is a result too
done
HEAD_NOTE=${HEAD_NOTE:-} $PY - "$W" "$LABEL" "$DRAFT" "$*" <<'PY'
import json, os, sys, datetime
from pathlib import Path
from draftling.bench.manifest import code_commit, device_slug, machine_slug, run_folder_name, write_manifest
w, label, draft, flags = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
runs = {f: json.loads((w / f"{f}.json").read_text()) for f in ("sglang", "speculators")}
recs = [dict(r, head=label) for run in runs.values() for r in run["vllm_check"]]
date = datetime.date.today().isoformat()
out = Path("bench/results") / run_folder_name(date, "vllm-check", code_commit(), machine_slug(device_slug("cpu")), label)
out.mkdir(parents=True, exist_ok=True)
results = {"date": date, "vllm_check": recs, "caveats": runs["sglang"]["caveats"]}
(out / "vllm_check.json").write_text(json.dumps(results, indent=2) + "\n")
for f in runs:
    (out / f"{f}.log").write_text((w / f"{f}.log").read_text())
write_manifest(out, f"bash lab/experiments/vllm_check.sh DRAFT_DIR {label} {flags}".rstrip(),
               {"head": label, "head_from": os.environ.get("HEAD_NOTE", ""), "flags": flags,
               "serve_check": {f: r["manifest"]["config"] for f, r in runs.items()}}, "cpu", date,
               what="a head served by vLLM (CPU build) against draftling's engine, both export formats",
               files=sorted(p.name for p in out.iterdir()))
print(f"wrote {out}")
PY
