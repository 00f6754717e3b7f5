"""The release bench's reports: caveats, markdown tables and report, plots, the outputs of a
run's folder, and the release section of BENCHMARKS.md. bench/release.py measures; everything
here reads its results dict (the JSON contract in release.py's docstring) and nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from draftling.bench.manifest import device_name
from draftling.config import RELEASE_BASELINES as BASELINES
from draftling.engine.spec_round import RoundTimer
from draftling.io import atomic_path, write_json

ROUND_PHASES = RoundTimer.PHASES  # draft, verify, accept, commit
MARK_START = "<!-- release-bench:start -->"
MARK_END = "<!-- release-bench:end -->"


# ----------------------------------------------------------------------------- caveats


def release_caveats(results: dict, device, requested) -> list[str]:
    """What a reader must know to read the figures, in order: protocol and engine_plain,
    baselines (``requested``: those asked for), device and configs, the prompt set."""
    ps = results["prompt_set"]
    notes = [*_plain_notes(results, device), *_baseline_notes(results, requested), *_run_notes(results, device)]
    notes += ps.get("notes", [])
    if ps.get("builtin"):
        notes.append(
            f"prompt set {ps['name']} is drawn from the shared training corpus: a draft "
            "trained on those files may have seen these prompts"
        )
    return notes


def _plain_notes(results: dict, device) -> list[str]:
    plain = results["baseline_details"]["engine_plain"]
    n, cap = plain["n"], plain["max_new_tokens"]
    per_w = results["prompt_set"]["workloads"]
    notes = [
        f"n = {n} prompts ({', '.join(f'{w} {k}' for w, k in per_w.items())}); single run, batch 1, "
        f"greedy, warm-up excluded, up to {cap} new tokens; device {device_name(device)}, "
        f"dtype {results['dtype']}, engine CUDA graphs {'on' if plain['cuda_graphs'] else 'off'}, "
        f"compiled layers {'on' if plain.get('engine', {}).get('compile') else 'off'}",
        f"engine_plain: {plain['natural_stops']} of {n} completions stopped naturally (eos) before the {cap}-token cap",
    ]
    if "padded_tok_s" in plain:
        eng = plain["engine"]
        pad, att = eng["query_pad"], eng["attention"]
        att_u = eng.get("unpadded_attention", att)
        notes.append(
            f"engine_plain: every target pass padded to {pad} queries with {att} attention (the "
            f"identity reference) ran {plain['padded_tok_s']:.1f} tok/s, unpadded with {att_u} "
            f"attention {plain['unpadded_tok_s']:.1f} tok/s; "
            f"speedups are against the faster ({plain['speedup_reference']}); unpadded output "
            f"equals padded on {plain['unpadded_identical_to_padded']:.0%} of prompts"
        )
    small = min(per_w.values())
    if small < 30:
        notes.append(
            f"small n: {small} prompt(s) per workload at the least; per-workload tau and "
            "speedup are rough, with no confidence interval"
        )
    return notes


def _baseline_notes(results: dict, requested) -> list[str]:
    d = results["baseline_details"]
    n, cap = d["engine_plain"]["n"], d["engine_plain"]["max_new_tokens"]
    notes = []
    for b in BASELINES[1:]:
        bd = d[b]
        if bd is None:
            why = "not requested" if b not in requested else "not run"
            notes.append(f"{b}: not run ({why}); null in baselines")
            continue
        notes.append(
            f"{b}: n = {bd['n']} prompts"
            + (f" ({bd['prompts_per_workload']} per workload)" if bd["prompts_per_workload"] else "")
            + f", {bd['natural_stops']} of {bd['n']} stopped naturally before {cap} tokens; "
            f"engine_plain on the same prompts: {bd['engine_plain_tok_s_same_prompts']:.1f} tok/s; "
            f"output identical to engine_plain on {bd['identical_to_engine_plain']:.0%}"
            + (f"; a subset of the {n}: compare with that same-prompt figure" if bd["n"] < n else "")
        )
    return notes


def _run_notes(results: dict, device) -> list[str]:
    n = results["baseline_details"]["engine_plain"]["n"]
    cuda = torch.device(device).type == "cuda"
    notes = []
    if not cuda:
        notes.append(
            "CPU run: eager engine without CUDA graphs, and transformers does not compile "
            "hf_static on CPU; speedups here do not predict GPU speedups"
        )
    for c in results["configs"]:
        if c["identical_fraction"] < 1.0:
            k = round((1 - c["identical_fraction"]) * n)
            notes.append(
                f"{c['name']}: {k} of {n} outputs differ from engine_plain (low-precision "
                "near-ties can flip a greedy argmax; reported, not asserted)"
            )
    notes.append(
        "cost account: plain and verify step times are medians of the target forward alone "
        f"(q=1 and q=draft_tokens, context ~{results['configs'][0]['cost']['context_tokens']} "
        "tokens); drafting share = 1 - measured/free-drafter speedup, which lumps draft passes "
        "with tree building, acceptance and KV compaction"
    )
    split = next((c["round_split_ms"] for c in results["configs"] if c.get("round_split_ms")), None)
    if split:
        notes.append(
            f"round split: mean ms per round by phase from a separate pass with "
            f"{'CUDA events' if cuda else 'wall-clock marks'} "
            f"({split['prompts']} prompts per config); draft and verify replay there as "
            "two graphs instead of one, and acceptance runs on the host (accept = "
            "device->host read + Python acceptance; commit = move_kv + draft extend, up to the "
            "next round's start). The timed runs instead accept and commit on the device and "
            "queue rounds (engine.accept.RUN_AHEAD_ROUNDS), as engine_plain queues steps"
        )
    return notes


# ----------------------------------------------------------------------------- reports


def _fmt_cell(speedup: float, tau: float) -> str:
    return f"{speedup:.2f}x ({tau:.1f})"


def format_speedup_table(results: dict) -> str:
    """Markdown: rows = workloads + mean, columns = configs, cells 'speedup x (tau)'."""
    cfgs = results["configs"]
    per_w = results["prompt_set"]["workloads"]
    lines = ["| workload | n | " + " | ".join(c["name"] for c in cfgs) + " |", "|---|---:|" + "---:|" * len(cfgs)]
    for w, n in per_w.items():
        cells = [_fmt_cell(c["per_workload"][w]["speedup"], c["per_workload"][w]["tau"]) for c in cfgs]
        lines.append(f"| {w} | {n} | " + " | ".join(cells) + " |")
    cells = [f"**{_fmt_cell(c['mean_speedup'], c['mean_tau'])}**" for c in cfgs]
    lines.append(f"| **mean** | {sum(per_w.values())} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_baselines_table(results: dict) -> str:
    lines = [
        "| baseline | tok/s | n prompts | tokens | stopped before cap | engine_plain tok/s, same prompts |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for b in BASELINES:
        d = results["baseline_details"][b]
        if d is None:
            lines.append(f"| {b} | not run | 0 | - | - | - |")
            continue
        same = d.get("engine_plain_tok_s_same_prompts", results["baselines"]["engine_plain"])
        lines.append(
            f"| {b} | {results['baselines'][b]:.1f} | {d['n']} | {d['tokens']} | {d['natural_stops']} | {same:.1f} |"
        )
    return "\n".join(lines)


def format_acceptance_table(results: dict) -> str:
    depth = max(len(c["accept_rate_by_depth"]) for c in results["configs"])
    lines = ["| config | " + " | ".join(f"d{d + 1}" for d in range(depth)) + " |", "|---|" + "---:|" * depth]
    for c in results["configs"]:
        rates = c["accept_rate_by_depth"]
        cells = [f"{rates[d]:.1%}" if d < len(rates) else "" for d in range(depth)]
        lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_cost_table(results: dict) -> str:
    lines = [
        "| config | q | mean tau | plain step ms | verify step ms | round ms | free-drafter speedup "
        "| measured speedup | drafting share | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in results["configs"]:
        k = c["cost"]
        lines.append(
            f"| {c['name']} | {k['verify_q']} | {c['mean_tau']:.2f} | {k['plain_step_ms']:.2f} | "
            f"{k['verify_step_ms']:.2f} | {k['round_ms']:.2f} | {k['free_speedup']:.2f}x | "
            f"{c['mean_speedup']:.2f}x | {k['drafting_share']:.0%} | "
            f"{c['identical_fraction']:.0%} |"
        )
    return "\n".join(lines)


def format_round_split_table(results: dict) -> str:
    """Markdown: mean ms per speculative round by phase, or "" when not measured."""
    cfgs = [c for c in results["configs"] if c.get("round_split_ms")]
    if not cfgs:
        return ""
    lines = [
        "| config | rounds | " + " | ".join(f"{p} ms" for p in ROUND_PHASES) + " | round ms |",
        "|---|---:|" + "---:|" * (len(ROUND_PHASES) + 1),
    ]
    for c in cfgs:
        k = c["round_split_ms"]
        lines.append(
            f"| {c['name']} | {k['rounds']} | "
            + " | ".join(f"{k[p]:.2f}" for p in ROUND_PHASES)
            + f" | {k['total']:.2f} |"
        )
    return "\n".join(lines)


def format_sampled_table(results: dict) -> str:
    sampled = results.get("sampled") or {}
    if not sampled:
        return ""
    first = next(iter(sampled.values()))
    workloads = list(next(iter(first.values()))["per_workload"])
    lines = [
        "| temperature | config | " + " | ".join(workloads) + " | mean |",
        "|---|---|" + "---|" * (len(workloads) + 1),
    ]
    for temp, configs in sampled.items():
        for name, c in configs.items():
            cells = [f"{v['speedup']:.2f}x ({v['tau']:.2f})" for v in c["per_workload"].values()]
            lines.append(
                f"| {temp} | {name} | " + " | ".join(cells) + f" | {c['mean_speedup']:.2f}x ({c['mean_tau']:.2f}) |"
            )
    return "\n".join(lines)


def format_report(results: dict, stem_name: str | None = None) -> str:
    ps = results["prompt_set"]
    cap = results["baseline_details"]["engine_plain"]["max_new_tokens"]
    out = [
        f"# Release bench: {results['target']} with {results['draft']}",
        "",
        f"- date: {results['date']}; GPU: {results['gpu']}; dtype: {results['dtype']}",
        f"- prompt set: {ps['name']} ({ps['num_prompts']} prompts, sha256 {ps['sha256'][:12]}); "
        f"up to {cap} new tokens, batch 1, greedy",
        f"- configs: {', '.join(c['name'] for c in results['configs'])}",
        f"- command: `{results['command']}`",
        "",
        "## Speedup against engine_plain (tau in parentheses)",
        "",
        format_speedup_table(results),
        "",
        "## Baselines (tok/s)",
        "",
        format_baselines_table(results),
        "",
        "## Acceptance rate by depth (verify steps that accepted at least d draft tokens)",
        "",
        format_acceptance_table(results),
        "",
        "## Cost account",
        "",
        "Free-drafter speedup = mean tau x (plain step / verify step): the speedup if drafting cost "
        "nothing. Drafting share = 1 - measured / free.",
        "",
        format_cost_table(results),
        "",
    ]
    sampled = format_sampled_table(results)
    if sampled:
        out += [
            "## Sampled decoding: speedup against plain sampling (tau in parentheses)",
            "",
            "Lossless verification: the output follows the target's law at that temperature, "
            "but tokens differ from run to run, so only rates compare.",
            "",
            sampled,
            "",
        ]
    split = format_round_split_table(results)
    if split:
        out += [
            "## Round split (mean ms per speculative round)",
            "",
            "Where a round's time goes: draft = tree drafting, verify = target pass on the tree, "
            "accept = reading the tree back + acceptance on the host, commit = KV compaction + "
            "draft extend.",
            "",
            split,
            "",
        ]
    out += ["## Caveats", ""]
    out += [f"- {n}" for n in results["caveats"]]
    if stem_name:
        out += ["", f"![speedup grid]({stem_name}-grid.png)", "", f"![tau vs speedup]({stem_name}-tau-vs-speedup.png)"]
    return "\n".join(out) + "\n"


def _save_fig(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")


def plot_release(results: dict, stem: Path) -> list[Path]:
    """``<stem>-grid.png`` (speedup per workload x config) and ``<stem>-tau-vs-speedup.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [Path(f"{stem}-grid.png"), Path(f"{stem}-tau-vs-speedup.png")]
    for draw, path in zip((_plot_grid, _plot_tau_vs_speedup), paths):
        fig = draw(plt, results)
        _save_fig(fig, path)
        plt.close(fig)
    return paths


def _plot_grid(plt, results: dict):
    cfgs = results["configs"]
    workloads = list(results["prompt_set"]["workloads"])
    grid = [[c["per_workload"][w]["speedup"] for c in cfgs] for w in workloads]
    grid.append([c["mean_speedup"] for c in cfgs])
    taus = [[c["per_workload"][w]["tau"] for c in cfgs] for w in workloads]
    taus.append([c["mean_tau"] for c in cfgs])
    rows = workloads + ["mean"]

    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(cfgs), 1.0 + 0.5 * len(rows)))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cfgs)), [c["name"] for c in cfgs])
    ax.set_yticks(range(len(rows)), rows)
    flat = [v for r in grid for v in r]
    mid = (min(flat) + max(flat)) / 2
    for i, r in enumerate(grid):
        for j, v in enumerate(r):
            ax.text(
                j,
                i,
                f"{v:.2f}x\n(tau {taus[i][j]:.1f})",
                ha="center",
                va="center",
                fontsize=8,
                color="black" if v > mid else "white",
            )
    fig.colorbar(im, ax=ax, label="speedup vs engine_plain")
    ax.set_title(f"{results['target']} / {results['gpu']} / {results['prompt_set']['name']}")
    return fig


def _plot_tau_vs_speedup(plt, results: dict):
    cfgs = results["configs"]
    workloads = list(results["prompt_set"]["workloads"])
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    tmax = max([c["per_workload"][w]["tau"] for c in cfgs for w in workloads] + [c["mean_tau"] for c in cfgs])
    for k, c in enumerate(cfgs):
        color = f"C{k}"
        xs = [c["per_workload"][w]["tau"] for w in workloads]
        ys = [c["per_workload"][w]["speedup"] for w in workloads]
        ax.scatter(xs, ys, color=color, label=c["name"])
        for x, y, w in zip(xs, ys, workloads):
            ax.annotate(w, (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ratio = c["cost"]["plain_step_ms"] / c["cost"]["verify_step_ms"]
        x1 = max(tmax * 1.05, 1.5)
        ax.plot(
            [1.0, x1],
            [ratio, ratio * x1],
            color=color,
            ls="--",
            lw=1,
            label=f"{c['name']} free drafter (tau x {ratio:.2f})",
        )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("tau (tokens per verify step, bonus counted)")
    ax.set_ylabel("speedup vs engine_plain")
    ax.legend(fontsize=7)
    ax.set_title("tau vs speedup, one point per workload x config")
    return fig


def write_release_outputs(results: dict, stem: Path, rows: list[dict] | None = None) -> dict:
    """Write <stem>.json, .md, -grid.png, -tau-vs-speedup.png (and -per-prompt.jsonl)."""
    stem = Path(stem)
    paths = {"json": stem.with_name(stem.name + ".json"), "md": stem.with_name(stem.name + ".md")}
    write_json(paths["json"], results)
    with atomic_path(paths["md"]) as tmp:
        tmp.write_text(format_report(results, stem.name))
    paths["grid"], paths["scatter"] = plot_release(results, stem)
    if rows is not None:
        paths["per_prompt"] = stem.with_name(stem.name + "-per-prompt.jsonl")
        with atomic_path(paths["per_prompt"]) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for p in paths.values():
        _readable(p)
    return paths


def _readable(path: Path) -> None:
    # atomic_path's temp files are 0600; results are meant to be shared and committed.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def update_benchmarks_md(results_json_path: str | Path, benchmarks_md: str | Path) -> Path:
    """Rewrite the section between the release-bench markers of the markdown file ``benchmarks_md``
    (e.g. a repository's BENCHMARKS.md) with the latest
    results (table, command, date, GPU, n, configs); everything else in the file is kept.
    Creates the file, or appends the section, when missing. The results link is relative to
    the file, e.g. ``bench/results/<run folder>/<name>.json`` for this repository's BENCHMARKS.md."""
    results_json_path = Path(results_json_path)
    results = json.loads(results_json_path.read_text())
    md = Path(benchmarks_md)
    try:
        link = results_json_path.resolve().relative_to(md.resolve().parent).as_posix()
    except ValueError:
        link = str(results_json_path)
    section = _benchmarks_section(results, f"[{results_json_path.name}]({link})")
    if md.is_file():
        text = md.read_text()
        a, b = text.find(MARK_START), text.find(MARK_END)
        if a >= 0 and b > a:
            text = text[:a] + section + text[b + len(MARK_END) :]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
    else:
        text = "# Benchmarks\n\n" + section + "\n"
    with atomic_path(md) as tmp:
        tmp.write_text(text)
    _readable(md)
    return md


def _benchmarks_section(results: dict, link: str) -> str:
    ps = results["prompt_set"]
    bd = results["baseline_details"]
    base = ", ".join(
        f"{b} {results['baselines'][b]:.1f} (n {bd[b]['n']})" if results["baselines"][b] is not None else f"{b} not run"
        for b in BASELINES
    )
    return "\n".join(
        [
            MARK_START,
            "## Release bench (latest)",
            "",
            f"- date: {results['date']}; GPU: {results['gpu']}; dtype: {results['dtype']}",
            f"- target: {results['target']}; draft: {results['draft']}",
            f"- prompt set: {ps['name']}, n = {ps['num_prompts']} "
            f"({', '.join(f'{w} {k}' for w, k in ps['workloads'].items())})",
            f"- configs: {', '.join(c['name'] for c in results['configs'])}; "
            f"up to {bd['engine_plain']['max_new_tokens']} new tokens, batch 1, greedy",
            f"- command: `{results['command']}`",
            f"- results: {link}",
            "",
            "Speedup against draftling's engine without speculation, tau in parentheses:",
            "",
            format_speedup_table(results),
            "",
            f"Baselines (tok/s): {base}.",
            "",
            "Caveats:",
            "",
            *[f"- {n}" for n in results["caveats"]],
            MARK_END,
        ]
    )
