"""methods.json from lab/gpu/methods.sh's results folder: one record per (method, decode
config) with tau, round and plain-step cost, speedup over plain and identity on prompt set v1,
the per-workload table, and each head's training steps and wall time.

    python3 lab/gpu/methods.py RESULTS_DIR   (writes RESULTS_DIR/methods.json, prints a table)
"""

import json
import sys
from pathlib import Path

METHODS = {"eagle3": "EAGLE-3", "eagle31": "EAGLE-3.1 (fc_norm, norm_output)", "dflash": "dflash block drafter"}


def release_json(folder: Path) -> dict | None:
    """The release bench's results JSON under ``folder`` (the one with configs and baselines)."""
    for path in sorted(folder.rglob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "configs" in data and "baselines" in data:
            return data
    return None


def training(results: Path, method: str) -> dict:
    out: dict = {}
    for name in (f"train-{method}-result.json", f"train-{method}-wall.json"):
        path = results / name
        if path.is_file():
            out.update(json.loads(path.read_text()))
    keep = ("steps", "stop_reason", "wall_s", "train_wall_s", "data")
    return {k: out[k] for k in keep if k in out}


def records(results: Path) -> list[dict]:
    rows = []
    for method, label in METHODS.items():
        bench = release_json(results / f"bench-{method}") if (results / f"bench-{method}").is_dir() else None
        if bench is None:
            continue
        plain = bench["baselines"]["engine_plain"]
        for c in bench["configs"]:
            rows.append(
                {
                    "method": method,
                    "label": label,
                    "config": c["name"],
                    "tau": c["mean_tau"],
                    "round_ms": c["cost"]["round_ms"],
                    "plain_ms": c["cost"]["plain_step_ms"],
                    "verify_ms": c["cost"]["verify_step_ms"],
                    "round_split_ms": c["round_split_ms"],
                    "speedup": c["mean_speedup"],
                    "identical_fraction": c["identical_fraction"],
                    "accept_rate_by_depth": c["accept_rate_by_depth"],
                    "per_workload": c["per_workload"],
                    "engine_plain_tok_s": plain,
                    "training": training(results, method),
                    "draft": bench["draft"],
                    "engine": bench["engine"],
                    "gpu": bench["gpu"],
                    "date": bench["date"],
                }
            )
    return rows


def main() -> None:
    results = Path(sys.argv[1])
    rows = records(results)
    best = max(rows, key=lambda r: r["speedup"] if r["identical_fraction"] == 1.0 else 0.0, default=None)
    out = {
        "target": "SmolLM2-135M-Instruct (GGUF Q4_1, run in bf16)",
        "prompt_set": "v1",
        "methods": rows,
        "best": {k: best[k] for k in ("method", "config", "speedup", "tau")} if best else None,
        "goal_best_speedup": 2.0,
    }
    (results / "methods.json").write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        t = r["training"]
        print(
            f"{r['method']:8} {r['config']:12} tau {r['tau']:.2f}  round {r['round_ms']:.2f} ms  "
            f"plain {r['plain_ms']:.2f} ms  {r['speedup']:.2f}x  identical {r['identical_fraction']:.2f}  "
            f"steps {t.get('steps')} wall {t.get('wall_s')} s"
        )


if __name__ == "__main__":
    main()
