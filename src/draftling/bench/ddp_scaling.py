"""Data-parallel scaling: training tokens/s of the same run at 1 and N GPUs.

Reads the metrics.jsonl of finished `draftling train` runs (one per world size, same
config and data) and writes a results JSON:

    python -m draftling.bench.ddp_scaling --run 1=/tmp/r1 --run 2=/tmp/r2 --out results.json

tokens/s is the mean over logged windows after the first (the first holds compile and
warm-up), counting every sequence token (prompt and reply) of the global batch.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from draftling.io import write_json


def steady_tok_s(run_dir: Path) -> tuple[float, int]:
    """Mean tok/s over training log windows, skipping the first; and how many were used."""
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    windows = [r["tok_s"] for r in rows if r.get("split") == "train"]
    if len(windows) < 2:
        raise SystemExit(f"{run_dir}/metrics.jsonl: need at least 2 logged training windows, got {len(windows)}")
    steady = windows[1:]
    return sum(steady) / len(steady), len(steady)


def line_fit(xy: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points (through both, for two):
    with x sequences per step and y seconds per step, the step's fixed cost and its cost per
    sequence."""
    mx, my = sum(x for x, _ in xy) / len(xy), sum(y for _, y in xy) / len(xy)
    slope = sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)
    return my - mx * slope, slope


def summarize(runs: dict[int, Path], gpu: str, extra: dict | None = None) -> dict:
    per_world = {}
    for world, run_dir in sorted(runs.items()):
        tok_s, n = steady_tok_s(run_dir)
        result = json.loads((run_dir / "train_result.json").read_text())
        per_world[str(world)] = {"tok_s": tok_s, "windows": n, "steps": result["steps"],
                                 "train_wall_s": result["train_wall_s"],
                                 "peak_gpu_gib_rank0": result.get("peak_gpu_gib"),
                                 "val_sim_tau": result.get("val", {}).get("sim_tau")}
    base = per_world[str(min(runs))]["tok_s"] / min(runs)
    for world, entry in per_world.items():
        entry["speedup_vs_1"] = entry["tok_s"] / (base * min(runs))
        entry["scaling_efficiency"] = entry["tok_s"] / (base * int(world))
    first = runs[min(runs)]
    config = (first / "config.yaml").read_text() if (first / "config.yaml").exists() else None
    caveats = ["single run per world size",
               "the global batch is the same at every world size (each rank takes batch/N sequences)",
               "tok/s counts prompt and reply tokens of the global batch; the first log window "
               "(compile, warm-up) is excluded"]
    return {"date": datetime.date.today().isoformat(), "gpu": gpu, "per_world_size": per_world,
            "config_yaml": config, "caveats": caveats, **(extra or {})}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, metavar="N=DIR",
                   help="world size and the run directory trained at it; repeat")
    p.add_argument("--out", required=True, help="results JSON to write")
    p.add_argument("--gpu", default=None, help="GPU name (default: torch's name for cuda:0)")
    p.add_argument("--note", action="append", default=[], metavar="KEY=VALUE", help="extra fields")
    args = p.parse_args(argv)
    runs = {}
    for item in args.run:
        world, _, path = item.partition("=")
        runs[int(world)] = Path(path)
    gpu = args.gpu
    if gpu is None:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    extra = dict(n.split("=", 1) for n in args.note)
    result = summarize(runs, gpu, extra)
    write_json(args.out, result)
    for world, e in result["per_world_size"].items():
        print(f"{world} GPU(s): {e['tok_s']:.0f} tok/s, speedup {e['speedup_vs_1']:.2f}x, "
              f"efficiency {e['scaling_efficiency']:.0%}")


if __name__ == "__main__":
    main()
