"""The data-scaling curve (issue 25's results contract) from the runs of lab/gpu/data_scaling.sh.

    python3 lab/gpu/scaling_curve.py --point TRAIN_RESULT.json BENCH.json [--point ...]
        [--sampled N] --gpu "NVIDIA H200" --out DIR

Each --point is one head: its train_result.json (train.data_fraction, the sequences and loss
tokens it drew from, validation chain tau) and its release-bench results JSON (v1 mean tau per
config). ``--sampled`` marks the last N points as trained with sampled replies added. Writes
DIR/scaling.json ({date, gpu, data_scaling: [{fraction, sampled_replies, replies, loss_tokens,
val_chain_tau, v1_mean_tau}]}) and DIR/scaling.png (tau against loss tokens, log scale).
"""

import argparse
import datetime
import json
from pathlib import Path

from draftling.io import write_json


def point(train_result: Path, bench: Path, sampled: bool) -> dict:
    result, bench_json = json.loads(train_result.read_text()), json.loads(bench.read_text())
    data = result.get("data")
    if not data:
        raise SystemExit(f"{train_result}: no 'data' record (trained before train.data_fraction existed)")
    return {
        "fraction": data["fraction"],
        "sampled_replies": sampled,
        "replies": data["sequences"],
        "loss_tokens": data["loss_tokens"],
        "val_chain_tau": result["val"]["chain_tau"],
        "v1_mean_tau": {c["name"]: c["mean_tau"] for c in bench_json["configs"]},
    }


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    metrics = [("validation chain tau", lambda p: p["val_chain_tau"])] + [
        (f"v1 {name}", lambda p, name=name: p["v1_mean_tau"][name]) for name in points[0]["v1_mean_tau"]
    ]
    for sampled in (False, True):  # one colour per metric; sampled points hollow, apart from the line
        pts = sorted((p for p in points if p["sampled_replies"] == sampled), key=lambda p: p["loss_tokens"])
        for i, (label, value) in enumerate(metrics if pts else []):
            ax.plot(
                [p["loss_tokens"] for p in pts],
                [value(p) for p in pts],
                ("o" if i == 0 else "s") + "-",
                color=f"C{i}",
                mfc="none" if sampled else f"C{i}",
                label=label + (" (sampled replies added)" if sampled else ""),
            )
    ax.set_xscale("log")
    ax.set_xlabel("training loss tokens")
    ax.set_ylabel("mean tau (bonus token counted)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--point", nargs=2, action="append", required=True, metavar=("TRAIN_RESULT", "BENCH_JSON"))
    ap.add_argument("--sampled", type=int, default=0, help="the last N points had sampled replies added")
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = len(args.point)
    points = [point(Path(t), Path(b), i >= n - args.sampled) for i, (t, b) in enumerate(args.point)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / "scaling.json", {"date": datetime.date.today().isoformat(), "gpu": args.gpu, "data_scaling": points}
    )
    plot(points, out / "scaling.png")
    print(json.dumps(points, indent=1))


if __name__ == "__main__":
    main()
