"""The fixed cost of a training step on real data, before and after the padding and host-read
fixes of issue 27, with the two-point fit of the 2-GPU DDP run (BENCHMARKS.md, "Data-parallel
scaling"): seconds per step at 32 sequences (the global batch) and at 16 (one rank's share at 2
GPUs), step_s = fixed + per_seq * n.

    python lab/gpu/train_fixed_cost.py --data D --run before:32=DIR --run before:16=DIR \\
        --run after:32=DIR --run after:16=DIR --out OUT       # after train_fixed_cost.sh's runs

Each DIR is a finished `draftling train` run. Its steady tok/s is the mean over logged windows after
the first (lab/benches/ddp_scaling.py's run_entry). A step of n sequences takes
n * L / tok_s seconds, L being the data's mean sequence length (train tokens / train sequences in
D/summary.json), so both batch sizes are priced on the same sequences. A (code, batch) run more
than once is a point per run; the fit is the least-squares line through them.

Writes OUT/fixed-cost.json ({date, gpu, fixed_cost_s_before, fixed_cost_s_after, points, ...}).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])  # this checkout, for lab.benches
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from draftling.io import write_json
from lab.benches.ddp_scaling import line_fit, run_entry

CODES = ("before", "after")


def parse_run(item: str) -> tuple[str, int, Path]:
    """'before:32=DIR' -> ('before', 32, DIR)."""
    key, sep, path = item.partition("=")
    code, _, batch = key.partition(":")
    if not sep or code not in CODES or not batch.isdigit():
        raise SystemExit(f"--run {item}: expected CODE:BATCH=DIR with CODE one of {', '.join(CODES)}")
    return code, int(batch), Path(path)


def mean_seq_tokens(data: Path) -> float:
    summary = json.loads((data / "summary.json").read_text())
    return summary["train_tokens"] / summary["train_sequences"]


def point(code: str, batch: int, run: Path, seq_tokens: float) -> dict:
    e = run_entry(run)
    return {
        "code": code,
        "batch": batch,
        "tok_s": round(e["tok_s"], 1),
        "step_s": round(batch * seq_tokens / e["tok_s"], 5),
        "windows": e["windows"],
        "steps": e["steps"],
        "peak_gpu_gib": e["peak_gpu_gib_rank0"],
        "run": run.name,
    }


def efficiency_bound(points: list[dict]) -> dict:
    """{code: {global batch B: step_s(B) / (2 * step_s(B/2))}}: the 2-GPU scaling efficiency at
    global batch B if each rank's step took as long as one GPU's step at B/2, i.e. with no gradient
    all-reduce and no rank skew (an upper bound)."""

    def mean_step(code, batch):
        s = [p["step_s"] for p in points if p["code"] == code and p["batch"] == batch]
        return sum(s) / len(s) if s else None

    out = {}
    for code in CODES:
        for batch in sorted({p["batch"] for p in points if p["code"] == code}):
            full, half = mean_step(code, batch), mean_step(code, batch // 2) if batch % 2 == 0 else None
            if half:
                out.setdefault(code, {})[str(batch)] = round(full / (2 * half), 3)
    return out


def summarize(points: list[dict], seq_tokens: float, gpu: str) -> dict:
    out = {"date": datetime.date.today().isoformat(), "gpu": gpu, "mean_seq_tokens": round(seq_tokens, 1)}
    for code in CODES:
        xy = [(p["batch"], p["step_s"]) for p in points if p["code"] == code]
        if len({x for x, _ in xy}) >= 2:
            fixed, per_seq = line_fit(xy)
            out[f"fixed_cost_s_{code}"], out[f"per_seq_s_{code}"] = round(fixed, 5), round(per_seq, 6)
    ratio = {}
    for batch in sorted({p["batch"] for p in points}):
        tok = {c: [p["tok_s"] for p in points if p["code"] == c and p["batch"] == batch] for c in CODES}
        if tok["before"] and tok["after"]:
            ratio[str(batch)] = round(
                sum(tok["after"]) / len(tok["after"]) / (sum(tok["before"]) / len(tok["before"])), 3
            )
    out["tok_s_after_over_before"] = ratio
    out["two_gpu_efficiency_bound"] = efficiency_bound(points)
    out["points"] = points
    out["caveats"] = [
        "before is the code of the fixes' merge parent (8cab536), carried as a source tree; after is this checkout",
        "one GPU: B/2 sequences per step stands in for one rank's share of B at 2 GPUs, without the "
        "gradient all-reduce, so two_gpu_efficiency_bound is an upper bound",
        "the first logged window (compile, warm-up) is excluded from tok/s",
        "step_s prices both batch sizes at the data's mean sequence length; the sampled batches differ",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, type=Path, help="the runs' data folder (its summary.json)")
    p.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="CODE:BATCH=DIR",
        help="a finished run: CODE before or after, BATCH its sequences per step; repeat",
    )
    p.add_argument("--out", required=True, type=Path, help="folder for fixed-cost.json")
    p.add_argument("--gpu", default=None, help="GPU name (default: torch's name for cuda:0)")
    args = p.parse_args(argv)
    runs = [parse_run(item) for item in args.run]
    gpu = args.gpu
    if gpu is None:
        from draftling.bench.manifest import first_gpu_name

        gpu = first_gpu_name()
    seq_tokens = mean_seq_tokens(args.data)
    result = summarize([point(c, b, d, seq_tokens) for c, b, d in runs], seq_tokens, gpu)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "fixed-cost.json", result)
    for code in CODES:
        if f"fixed_cost_s_{code}" in result:
            print(
                f"[train-fixed-cost] {code}: {result[f'fixed_cost_s_{code}']:.4f} s fixed + "
                f"{result[f'per_seq_s_{code}'] * 1e3:.2f} ms per sequence"
            )
    print(f"[train-fixed-cost] tok/s after / before by batch: {result['tok_s_after_over_before']}")
    print(f"[train-fixed-cost] 2-GPU efficiency bound by global batch: {result['two_gpu_efficiency_bound']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
