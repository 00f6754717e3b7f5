"""Check the committed release-bench results: the H200 results in bench/results are what
BENCHMARKS.md quotes. Each keeps the release bench's results contract, and the newest is the
file BENCHMARKS.md's release section links.

    python3 lab/check_results.py [REPO_ROOT]     # default: this checkout

Prints one line per problem and exits 1 if there is any; 0 (with a line saying what it checked,
or that there is nothing to check) otherwise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = {"date", "gpu", "target", "draft", "prompt_set", "baselines", "configs"}
BASELINES = {"engine_plain", "hf_static", "hf_prompt_lookup", "hf_eager"}
CONFIGS = {"chain-3-1-4", "tree-3-4-8", "tree-5-8-16"}
CONFIG_KEYS = {"name", "steps", "topk", "draft_tokens", "per_workload", "mean_speedup", "mean_tau"}
WORKLOAD_KEYS = {"tau", "tok_s", "speedup"}


def result_files(root: Path) -> list[Path]:
    # One folder per run (bench/results/<date>-<what>-<commit>-<machine>/); superseded runs are in archive/.
    return sorted((root / "bench" / "results").glob("*/????-??-??-nvidia-h200.json"), key=lambda f: f.name)


def check_file(f: Path) -> list[str]:
    where = f"{f.parent.name}/{f.name}"
    try:
        r = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        return [f"{where}: unreadable: {e}"]
    missing = KEYS - set(r)
    if missing:
        return [f"{where}: missing keys {sorted(missing)}"]
    problems = []
    if f.name != f"{r['date']}-{r['gpu']}.json":
        problems.append(f"{where}: named {f.name}, not {r['date']}-{r['gpu']}.json (its date and gpu)")
    if set(r["baselines"]) != BASELINES:
        problems.append(f"{where}: baselines {sorted(r['baselines'])}, not {sorted(BASELINES)}")
    names = [c.get("name") for c in r["configs"]]
    if not set(names) >= CONFIGS:
        problems.append(f"{where}: configs {names} lack {sorted(CONFIGS - set(names))}")
    for c in r["configs"]:
        missing = CONFIG_KEYS - set(c)
        if missing:
            problems.append(f"{where}: config {c.get('name')} misses keys {sorted(missing)}")
            continue
        name = f"{'chain' if c['topk'] == 1 else 'tree'}-{c['steps']}-{c['topk']}-{c['draft_tokens']}"
        if c["name"] != name:
            problems.append(f"{where}: config {c['name']} has the shape of {name}")
        for workload, v in c["per_workload"].items():
            if not set(v) >= WORKLOAD_KEYS:
                problems.append(f"{where}: {c['name']} {workload} misses keys {sorted(WORKLOAD_KEYS - set(v))}")
            elif v["tau"] < 1.0:
                problems.append(f"{where}: {c['name']} {workload} tau {v['tau']} below 1.0")
    return problems


def check(root: Path) -> tuple[list[Path], list[str]]:
    files = result_files(root)
    problems = [p for f in files for p in check_file(f)]
    if files:
        latest = files[-1]
        link = f"[{latest.name}](bench/results/{latest.parent.name}/{latest.name})"
        md = root / "BENCHMARKS.md"
        if not md.is_file() or link not in md.read_text():
            problems.append(f"BENCHMARKS.md: does not link the newest results, {link}")
    return files, problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    files, problems = check(root)
    for line in problems:
        print(line)
    if problems:
        return 1
    print(
        f"{len(files)} committed release results keep the contract"
        if files
        else "no committed GPU results (not a full checkout)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
