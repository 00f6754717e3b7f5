"""`draftling report RUN_DIR`: one training run as markdown with PNG plots, from its files only.

Reads RUN_DIR/metrics.jsonl (and train_result.json when the run finished) and writes, into
RUN_DIR/report or ``out``: report.md, loss.png (train and validation loss over steps),
accuracy.png (the accuracy of each TTT step over steps), smoke_tau.png (the smoke bench's tau
per workload against the epoch fraction, train.smoke_every) and the convergence verdict, plus
wall time and tok/s per segment (the start, then each resume: train records carry the step
their segment started from). Each file is written to a temporary name and renamed.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftling.errors import DraftlingError
from draftling.io import atomic_path, read_metrics
from draftling.train.convergence import SMOKE_CONFIG, epoch_phrase, verdict_line

PLOTS = ("loss.png", "accuracy.png", "smoke_tau.png")


def load_run_records(run_dir: Path) -> tuple[list[dict], dict | None]:
    """(metrics records, train_result or None); a one-line error naming what is missing."""
    if not run_dir.is_dir():
        raise DraftlingError(f"{run_dir}: no such run directory")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise DraftlingError(f"{run_dir}: not a training run: no metrics.jsonl (written by `draftling train`)")
    records = read_metrics(metrics)
    if not any(r.get("split") == "train" for r in records):
        raise DraftlingError(f"{metrics}: no training steps logged yet")
    result_path = run_dir / "train_result.json"
    try:
        result = json.loads(result_path.read_text()) if result_path.is_file() else None
    except ValueError:
        raise DraftlingError(f"{result_path}: not valid JSON") from None
    return records, result


def segments(records: list[dict]) -> list[dict]:
    """Per segment: the step it started from, its first and last logged step, wall seconds (to
    its last logged step) and training tok/s (tokens over the time of its logged windows)."""
    groups: dict[int, list[dict]] = {}
    for r in records:
        if r.get("split") == "train":
            groups.setdefault(r.get("segment", 0), []).append(r)  # runs from before segments: one
    rows = []
    for start, train in groups.items():
        tokens = sum(r.get("window_tokens", 0) for r in train)  # what tok_s counted (runs before it: none)
        seconds = sum(r["window_tokens"] / r["tok_s"] for r in train if r.get("window_tokens") and r.get("tok_s"))
        rows.append(
            {
                "from_step": start,
                "first_step": train[0]["step"],
                "last_step": train[-1]["step"],
                "wall_s": train[-1].get("wall_s"),
                "tok_s": tokens / seconds if seconds else sum(r["tok_s"] for r in train) / len(train),
            }
        )
    return rows


def verdict_text(records: list[dict], result: dict | None) -> str:
    """The convergence verdict in one line, and why the run stopped."""
    smoke = [r for r in records if r.get("split") == "smoke"]
    found = [r for r in records if r.get("split") == "convergence"]
    if found:
        text = verdict_line(found[-1]) + "."
    elif smoke:
        text = f"not converged: {len(smoke)} smoke checks, the last at {epoch_phrase(smoke[-1]['epoch_fraction'])}."
    else:
        text = "no smoke checks in this run (train.smoke_every=0), so no convergence verdict."
    if result is None:
        return text + " The run has not finished (no train_result.json)."
    return text + f" Stopped after {result['steps']} steps: {result.get('stop_reason', 'completed')}."


def write_report(run_dir, out=None) -> Path:
    """Write report.md and the plots; returns the report's folder."""
    run_dir = Path(run_dir)
    records, result = load_run_records(run_dir)
    out = Path(out) if out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = draw_plots(records, out)
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(report_markdown(run_dir, records, result, plots), encoding="utf-8")
    return out


def report_markdown(run_dir: Path, records: list[dict], result: dict | None, plots: list[str]) -> str:
    train = [r for r in records if r.get("split") == "train"]
    lines = [
        f"# Training report: {run_dir.name}",
        "",
        f"{train[-1]['step']} steps logged, last loss {train[-1]['loss']:.3f}, "
        f"step accuracy {' '.join(f'{a:.2f}' for a in train[-1]['acc'])}.",
        "",
        "## Convergence",
        "",
        verdict_text(records, result),
        "",
    ]
    lines += smoke_section(records, plots)
    lines += ["## Training", ""] + [f"![{p[:-4]}]({p})" for p in plots if p != "smoke_tau.png"] + [""]
    lines += segment_section(records)
    return "\n".join(lines) + "\n"


def smoke_section(records: list[dict], plots: list[str]) -> list[str]:
    smoke = [r for r in records if r.get("split") == "smoke"]
    if not smoke:
        return []
    workloads = list(dict.fromkeys(w for r in smoke for w in r["tau"]))
    lines = [
        "## Smoke tau",
        "",
        f"{SMOKE_CONFIG}, greedy, on {smoke[-1]['prompt_set']}: a trend of this run, "
        "not a release number. The change is against the check before, with its noise band.",
        "",
    ]
    lines += ["![smoke tau](smoke_tau.png)", ""] if "smoke_tau.png" in plots else []
    lines += [
        "| step | epoch | tau | " + " | ".join(workloads) + " | change ± band |",
        "|---" * (len(workloads) + 4) + "|",
    ]
    for r in smoke:
        change = f"{r['delta']:+.3f} ± {r['band']:.3f}" if r.get("band") is not None else ""
        cells = " | ".join(f"{r['tau'][w]:.2f}" if w in r["tau"] else "" for w in workloads)
        lines.append(
            f"| {r['step']} | {epoch_phrase(r['epoch_fraction'])} | {r['mean_tau']:.2f} | {cells} | {change} |"
        )
    return lines + [""]


def segment_section(records: list[dict]) -> list[str]:
    lines = [
        "## Segments",
        "",
        "The run's start, then each resume. Wall time runs to the segment's last logged "
        "step (smoke and validation included); tok/s is training throughput.",
        "",
        "| # | steps | started as | wall | tok/s |",
        "|---|---|---|---|---|",
    ]
    for i, s in enumerate(segments(records), start=1):
        started = f"resume from step {s['from_step']}" if s["from_step"] else "new run"
        wall = f"{s['wall_s']:.1f} s" if s["wall_s"] is not None else ""
        lines.append(f"| {i} | {s['first_step']}-{s['last_step']} | {started} | {wall} | {s['tok_s']:.0f} |")
    return lines


def draw_plots(records: list[dict], out: Path) -> list[str]:
    """The PNGs this run has data for, written into ``out``; their names."""
    try:
        import matplotlib
    except ImportError:
        raise DraftlingError(
            "draftling report draws its plots with matplotlib: pip install 'draftling[plots]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for name, draw in zip(PLOTS, (_plot_loss, _plot_accuracy, _plot_smoke)):
        fig = draw(plt, records)
        if fig is None:
            continue
        with atomic_path(out / name) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def _plot_loss(plt, records):
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for split, style in (("train", "-"), ("val", "o--")):
        rs = [r for r in records if r.get("split") == split and "loss" in r]
        if rs:
            ax.plot([r["step"] for r in rs], [r["loss"] for r in rs], style, label=split)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    return fig


def _plot_accuracy(plt, records):
    rs = [r for r in records if r.get("split") == "train" and r.get("acc")]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for j in range(len(rs[-1]["acc"])):
        ax.plot([r["step"] for r in rs], [r["acc"][j] for r in rs], label=f"TTT step {j}")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy (train)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    return fig


def _plot_smoke(plt, records):
    smoke = [r for r in records if r.get("split") == "smoke"]
    if not smoke:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    x = [r["epoch_fraction"] for r in smoke]
    for w in dict.fromkeys(w for r in smoke for w in r["tau"]):
        ax.plot(x, [r["tau"].get(w, float("nan")) for r in smoke], lw=1, label=w)
    ax.plot(x, [r["mean_tau"] for r in smoke], "k-o", lw=2, ms=3, label="mean")
    for v in (r for r in records if r.get("split") == "convergence"):
        ax.axvline(v["epoch_fraction"], color="gray", ls="--", lw=1, label="converged")
    ax.set_xlabel("epochs")
    ax.set_ylabel(f"smoke tau ({SMOKE_CONFIG})")
    ax.legend(fontsize=7)
    return fig
