"""Data-parallel scaling: training tokens/s of the same run at 1 and N GPUs.

Reads the metrics.jsonl of finished `draftling train` runs (one per world size, same
config and data) and writes a results JSON:

    python3 lab/benches/ddp_scaling.py --run 1=/tmp/r1 --run 2=/tmp/r2 --out results.json \
        [--fsdp /tmp/r2-fsdp] [--split /tmp/r1-split] [--fixed-cost fixed-cost.json]

With runs at 1 and 2 GPUs it adds the two-GPU keys (tok_s_1gpu, tok_s_2gpu, scaling_efficiency);
--fsdp adds the same 2-GPU run under train.parallel=fsdp, with its largest loss difference from
the DDP run at the steps both logged; --split a one-process run whose teacher is spread over the
GPUs (--device-map), against the 1-GPU run; --fixed-cost the step fit of
lab/gpu/train_fixed_cost.py.

tokens/s is the mean over logged windows after the first (the first holds compile and
warm-up), counting every sequence token (prompt and reply) of the global batch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[2] / "src")  # draftling from this checkout, installed or not
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

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


def loss_curve(run_dir: Path) -> dict[tuple[str, int], float]:
    """{(split, step): loss} of a run's logged training windows and validations."""
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {(r["split"], r["step"]): r["loss"] for r in rows if r.get("split") in ("train", "val") and "loss" in r}


def loss_diff(run: Path, reference: Path) -> dict:
    """The largest absolute and relative loss difference of ``run`` from ``reference`` over the
    (split, step) points both logged."""
    a, b = loss_curve(run), loss_curve(reference)
    shared = sorted(a.keys() & b.keys())
    if not shared:
        raise SystemExit(f"{run}/metrics.jsonl and {reference}/metrics.jsonl: no logged step in common")
    return {
        "max_abs": max(abs(a[k] - b[k]) for k in shared),
        "max_rel": max(abs(a[k] - b[k]) / abs(b[k]) for k in shared if b[k]),
        "points": len(shared),
    }


def run_entry(run_dir: Path) -> dict:
    tok_s, n = steady_tok_s(run_dir)
    result = json.loads((run_dir / "train_result.json").read_text())
    return {
        "tok_s": tok_s,
        "windows": n,
        "steps": result["steps"],
        "train_wall_s": result["train_wall_s"],
        "peak_gpu_gib_rank0": result.get("peak_gpu_gib"),
        "val_sim_tau": result.get("val", {}).get("sim_tau"),
        "val_chain_tau": result.get("val", {}).get("chain_tau"),
    }


def two_gpu_fields(
    runs: dict[int, Path],
    per_world: dict,
    fsdp: Path | None = None,
    split: Path | None = None,
    fixed_cost: Path | None = None,
) -> dict:
    """The two-GPU results keys (issue 27's contract) from what was run."""
    out = {}
    if {"1", "2"} <= per_world.keys():
        out.update(
            tok_s_1gpu=per_world["1"]["tok_s"],
            tok_s_2gpu=per_world["2"]["tok_s"],
            scaling_efficiency=per_world["2"]["scaling_efficiency"],
        )
    if fixed_cost:
        fit = json.loads(fixed_cost.read_text())
        out.update(fixed_cost_s_before=fit.get("fixed_cost_s_before"), fixed_cost_s_after=fit.get("fixed_cost_s_after"))
    if fsdp:
        entry, diff = run_entry(fsdp), loss_diff(fsdp, runs[2])
        out["fsdp"] = {
            "tok_s_2gpu": entry["tok_s"],
            "peak_gib": entry["peak_gpu_gib_rank0"],
            "max_loss_diff_vs_ddp": diff["max_abs"],
            "max_rel_loss_diff_vs_ddp": diff["max_rel"],
            "points_compared": diff["points"],
            "ddp_tok_s_2gpu": per_world["2"]["tok_s"],
            "ddp_peak_gib": per_world["2"]["peak_gpu_gib_rank0"],
            "val_sim_tau": entry["val_sim_tau"],
        }
    if split:
        entry, diff = run_entry(split), loss_diff(split, runs[1])
        out["teacher_split"] = {
            "tok_s": entry["tok_s"],
            "peak_gib_cuda0": entry["peak_gpu_gib_rank0"],
            "val_sim_tau": entry["val_sim_tau"],
            "val_chain_tau": entry["val_chain_tau"],
            "one_gpu_val_sim_tau": per_world["1"]["val_sim_tau"],
            "one_gpu_val_chain_tau": per_world["1"]["val_chain_tau"],
            "max_loss_diff_vs_1gpu": diff["max_abs"],
            "points_compared": diff["points"],
        }
    return out


def summarize(
    runs: dict[int, Path],
    gpu: str,
    extra: dict | None = None,
    fsdp: Path | None = None,
    split: Path | None = None,
    fixed_cost: Path | None = None,
) -> dict:
    per_world = {str(world): run_entry(run_dir) for world, run_dir in sorted(runs.items())}
    base = per_world[str(min(runs))]["tok_s"] / min(runs)
    for world, entry in per_world.items():
        entry["speedup_vs_1"] = entry["tok_s"] / (base * min(runs))
        entry["scaling_efficiency"] = entry["tok_s"] / (base * int(world))
    first = runs[min(runs)]
    config = (first / "config.yaml").read_text() if (first / "config.yaml").exists() else None
    caveats = [
        "single run per world size",
        "the global batch is the same at every world size (each rank takes batch/N sequences)",
        "tok/s counts prompt and reply tokens of the global batch; the first log window (compile, warm-up) is excluded",
    ]
    if fsdp:
        caveats.append(
            "fsdp: the same run under train.parallel=fsdp; its loss is compared with the DDP "
            "run's at every logged training window and validation"
        )
    if split:
        caveats.append(
            "teacher_split: one process, the teacher spread over the GPUs (--device-map), the "
            "draft on the first; compared with the 1-GPU run"
        )
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        **two_gpu_fields(runs, per_world, fsdp, split, fixed_cost),
        "per_world_size": per_world,
        "config_yaml": config,
        "caveats": caveats,
        **(extra or {}),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="N=DIR",
        help="world size and the run directory trained at it; repeat",
    )
    p.add_argument("--out", required=True, help="results JSON to write")
    p.add_argument("--gpu", default=None, help="GPU name (default: torch's name for cuda:0)")
    p.add_argument("--note", action="append", default=[], metavar="KEY=VALUE", help="extra fields")
    p.add_argument("--fsdp", type=Path, help="the 2-GPU run under train.parallel=fsdp")
    p.add_argument("--split", type=Path, help="a one-process run with the teacher spread over the GPUs")
    p.add_argument("--fixed-cost", type=Path, help="fixed-cost.json of lab/gpu/train_fixed_cost.py")
    args = p.parse_args(argv)
    runs = {}
    for item in args.run:
        world, _, path = item.partition("=")
        runs[int(world)] = Path(path)
    gpu = args.gpu
    if gpu is None:
        from draftling.bench.manifest import first_gpu_name

        gpu = first_gpu_name()
    extra = dict(n.split("=", 1) for n in args.note)
    for path in filter(None, (args.fsdp, args.split, args.fixed_cost)):
        if not path.exists():
            raise SystemExit(f"{path}: not found")
    for flag, world in (("fsdp", 2), ("split", 1)):
        if getattr(args, flag) and world not in runs:
            raise SystemExit(f"--{flag}: needs the run at {world} GPU(s) to compare with (--run {world}=DIR)")
    result = summarize(runs, gpu, extra, args.fsdp, args.split, args.fixed_cost)
    write_json(args.out, result)
    for world, e in result["per_world_size"].items():
        print(
            f"{world} GPU(s): {e['tok_s']:.0f} tok/s, speedup {e['speedup_vs_1']:.2f}x, "
            f"efficiency {e['scaling_efficiency']:.0%}"
        )
    for key in ("fsdp", "teacher_split"):
        if key in result:
            print(
                f"{key}: "
                + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result[key].items())
            )


if __name__ == "__main__":
    main()
