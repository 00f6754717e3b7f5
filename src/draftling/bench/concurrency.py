"""`draftling bench --concurrency 1,2,4,...`: where speculation stops paying under load.

At each concurrency level C the decode loop (engine/generate.py) decodes the same requests,
C at a time with continuous batching, once without speculation and once per decode config,
on one engine per level (the same weights, caches and graphs for all of them). Per level and
config it reports aggregate tok/s, per-stream tok/s (aggregate / C), tau (bonus included),
the speedup over plain decoding at the same level, and the cost account at that level: the
measured plain-step and verify-pass times of a C-row batch, and what a free drafter would
give at this tau. Speculation pays while the verify pass costs less than tau plain steps;
a batch fills the device, so verify passes get dearer as C grows. With ``adaptive`` each
level also runs the adaptive engine (engine/adaptive.py: per group of rounds the config or
plain decoding with the best measured rate), reported as config ``adaptive`` with its choices.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftling.bench.manifest import (
    code_commit,
    device_slug,
    draft_label,
    machine_slug,
    run_folder_name,
    write_manifest,
)
from draftling.bench.release import load_prompt_set
from draftling.bench.simple import build_engine, decode_configs, parse_decode_config
from draftling.config import CONCURRENCY_LEVELS, RELEASE_CONFIGS, BenchConfig
from draftling.dtypes import dtype_name
from draftling.engine import EngineOptions
from draftling.engine.adaptive import AdaptivePolicy
from draftling.engine.generate import batch_generate
from draftling.errors import ConfigError
from draftling.export.formats import load_any_draft
from draftling.io import write_json
from draftling.progress import Progress
from draftling.target import Target
from draftling.timing import timed

_DEFAULTS = BenchConfig()  # the bench section's defaults: prompt set, new tokens, results folder
RESULT = "concurrency.json"


@dataclass(frozen=True)
class SweepOptions:
    """``requests``: requests per level, at least ``min_requests`` and ``per_slot`` per slot,
    so every level refills slots (continuous batching) and the batch stays full most of the
    run. ``engine``: graphs and compiled layers on CUDA (several rows compile with dynamic
    shapes, so the levels share their graphs), unpadded: every config's own verify size.
    ``adaptive``: also run the adaptive engine over ``configs`` at each level."""

    levels: tuple[int, ...] = CONCURRENCY_LEVELS
    configs: tuple[str, ...] = RELEASE_CONFIGS
    prompt_set: str = _DEFAULTS.prompt_set
    max_new_tokens: int = _DEFAULTS.max_new_tokens
    min_requests: int = 16
    per_slot: int = 2
    engine: EngineOptions = field(
        default_factory=lambda: EngineOptions(cuda_graphs="auto", compile="auto", query_pad=0, attention="auto")
    )
    adaptive: bool = True
    out_dir: str | Path = _DEFAULTS.results_dir
    command: str | None = None

    def __post_init__(self):
        if not self.levels or min(self.levels) < 1:
            raise ConfigError(f"concurrency levels must be integers >= 1, got {list(self.levels)}")
        for c in self.configs:
            parse_decode_config(c)

    @classmethod
    def from_config(cls, bench, command: str | None = None) -> SweepOptions:
        """The sweep of a run config's bench section (bench.concurrency and the release keys)."""
        return cls(
            levels=tuple(bench.concurrency),
            configs=tuple(bench.configs),
            prompt_set=str(bench.prompt_set),
            max_new_tokens=bench.max_new_tokens,
            out_dir=bench.results_dir,
            command=command,
        )

    def requests(self, level: int) -> int:
        return max(self.min_requests, self.per_slot * level)


def run_concurrency_sweep(target: Target, draft_path, options: SweepOptions, log=print) -> dict:
    """The sweep's results (see RESULT_KEYS in the module doc); writes them with a plot and a
    manifest into one run folder under ``options.out_dir``."""
    draft = load_any_draft(draft_path, target.device, next(target.model.parameters()).dtype)
    configs = decode_configs(draft, options.configs)
    engine = options.engine.resolve(target.device, 0)
    info, prompts = load_prompt_set(options.prompt_set, target)
    rows = []
    # Requests decoded (plain and every config at each level): a level's cost grows with them.
    progress = Progress(sum(options.requests(v) for v in options.levels), "concurrency", emit=log, bar=False)
    for level in options.levels:
        ids = [prompts[i % len(prompts)].input_ids for i in range(options.requests(level))]
        tgt, runner = level_engine(target, draft, ids, configs, options.max_new_tokens, engine, level)
        level_rows, plain = _level(tgt, runner, ids, configs, options.max_new_tokens)
        if options.adaptive:
            level_rows.append(_adaptive(tgt, runner, ids, configs, options.max_new_tokens, level_rows[0], plain))
        rows += level_rows
        progress.update(len(ids), _level_line(level_rows))
        del tgt, runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    results = _assemble(target, draft_path, info, options, engine, rows)
    _write(results, options, engine)
    return results


def level_engine(target: Target, draft, ids, configs, max_new: int, engine: EngineOptions, rows: int):
    """One level's engine (target, draft runner) of ``rows`` rows, its cache long enough for
    the longest prompt of ``ids``, ``max_new`` tokens and the largest config's verify pass."""
    max_len = max(map(len, ids)) + max_new + max(c.draft_tokens for c in configs) + 8
    return build_engine(target, draft, max_len, engine, batch_size=rows)


def _level(tgt, runner, ids, configs, max_new) -> tuple[list[dict], list]:
    """Plain then each config at one level, each timed after a warm-up on the same engine.
    Returns (the rows, plain decoding's outputs)."""
    level = tgt.batch_size
    plain, plain_s = timed_after_warmup(
        tgt, lambda: batch_generate(tgt, ids, max_new), lambda: batch_generate(tgt, ids[:level], 4)
    )
    step_ms = {1: _step_ms(tgt, 1)}
    rows = [_row(level, "plain", plain, plain_s, None, step_ms)]
    for c in configs:
        tree = (c.steps, c.topk, c.draft_tokens)
        out, s = timed_after_warmup(
            tgt,
            lambda: batch_generate(tgt, ids, max_new, draft=runner, tree=tree),
            lambda: batch_generate(tgt, ids[:level], 4, draft=runner, tree=tree),
        )
        step_ms[c.draft_tokens] = _step_ms(tgt, c.draft_tokens)
        row = _row(level, c.name, out, s, rows[0], step_ms, c.draft_tokens)
        row["identical_fraction"] = _identical(out, plain)
        rows.append(row)
    return rows, plain


def _identical(out, plain) -> float:
    return sum(a.tokens == b.tokens for a, b in zip(out, plain)) / len(out)


def _adaptive(tgt, runner, ids, configs, max_new, plain_row, plain) -> dict:
    """The adaptive engine at one level over the same requests, after a warm-up; its row
    carries the policy's choices and the estimates they came from."""
    trees = tuple((c.steps, c.topk, c.draft_tokens) for c in configs)
    policy = AdaptivePolicy(trees)
    out, s = timed_after_warmup(
        tgt,
        lambda: batch_generate(tgt, ids, max_new, draft=runner, adaptive=policy),
        lambda: batch_generate(tgt, ids[: tgt.batch_size], 4, draft=runner, adaptive=AdaptivePolicy(trees)),
    )
    row = _row(tgt.batch_size, "adaptive", out, s, plain_row, {1: plain_row["cost"]["plain_step_ms"]}, 1)
    row.pop("cost")
    return {**row, "identical_fraction": _identical(out, plain), "policy": policy.report()}


def timed_after_warmup(tgt, run, warm):
    """(run's result, its seconds), after ``warm`` (graph capture, allocator growth) untimed."""
    warm()
    return timed(run, tgt.device)


def _step_ms(tgt, q: int, reps: int = 10) -> float:
    """Median ms of one target pass of the whole batch with q queries per row, at a context of
    half the cache: the plain step (q=1) or a verify pass (q = draft tokens), in the shapes
    and through the graphs the engine uses."""
    b, size, dev = tgt.batch_size, tgt.max_seq_len, tgt.device
    ctx = size // 2
    slots = (ctx + torch.arange(q, device=dev)).expand(b, q).contiguous()
    ids = torch.zeros(b, q, dtype=torch.long, device=dev)
    mask = tgt.cols[None, None] <= slots[:, :, None]
    times = []
    for i in range(reps + 3):
        _, seconds = timed(lambda: tgt.fast(ids, slots, slots, mask), dev)
        if i >= 3:
            times.append(seconds)
    return statistics.median(times) * 1e3


def _row(level, name, out, seconds, plain_row, step_ms, q=1) -> dict:
    tokens = sum(len(r.tokens) for r in out)
    agg = tokens / seconds
    full = out[0].stats.full_batch
    row = {
        "concurrency": level,
        "config": name,
        "requests": len(out),
        "tokens": tokens,
        "seconds": seconds,
        "aggregate_tok_s": agg,
        "per_stream_tok_s": agg / level,
        "full_batch_tok_s": full[1] / full[0] if full and full[0] > 0 else None,
        "usage": out[0].stats.usage,
    }
    if plain_row is None:
        return {**row, "tau": 1.0, "speedup": 1.0, "cost": {"plain_step_ms": step_ms[1]}}
    base = plain_row["full_batch_tok_s"]
    row["full_batch_speedup"] = row["full_batch_tok_s"] / base if row["full_batch_tok_s"] and base else None
    verifies = sum(len(r.stats.accept_lengths) for r in out)
    tau = sum(sum(r.stats.accept_lengths) for r in out) / max(1, verifies)
    speedup = agg / plain_row["aggregate_tok_s"]
    free = tau * step_ms[1] / step_ms[q]  # one verify pass per round and nothing else
    return {
        **row,
        "tau": tau,
        "speedup": speedup,
        "cost": {
            "plain_step_ms": step_ms[1],
            "verify_step_ms": step_ms[q],
            "verify_q": q,
            "free_speedup": free,
            "drafting_share": 1.0 - speedup / free,
        },
    }


def _level_line(rows: list[dict]) -> str:
    parts = [
        f"{r['config']} {r['aggregate_tok_s']:.0f} tok/s"
        + ("" if r["config"] == "plain" else f" (tau {r['tau']:.2f}, {r['speedup']:.2f}x)")
        + _busy(r)
        + _choices(r)
        for r in rows
    ]
    return f"concurrency {rows[0]['concurrency']}: " + "; ".join(parts)


def _busy(row: dict) -> str:
    """The share of rows x passes that decoded, e.g. " busy 0.93"; empty without a usage account."""
    fraction = (row.get("usage") or {}).get("busy_row_fraction")
    return "" if fraction is None else f" busy {fraction:.2f}"


def _choices(row: dict) -> str:
    """The adaptive engine's groups per choice, e.g. " [groups: tree-3-4-8 60, plain 8]"."""
    if "policy" not in row:
        return ""
    counts = row["policy"]["groups_by_choice"]
    return " [groups: " + ", ".join(f"{name} {n}" for name, n in counts.items()) + "]"


def summarize(rows: list[dict]) -> dict:
    """The best fixed config per level (plain when nothing beats it), the crossover: the
    lowest level from which on plain decoding wins at every level measured, and the adaptive
    engine's lowest speedup over plain across levels."""
    adaptive = [r["speedup"] for r in rows if r["config"] == "adaptive"]
    full = [r["full_batch_speedup"] for r in rows if r["config"] == "adaptive" and r.get("full_batch_speedup")]
    rows = [r for r in rows if r["config"] != "adaptive"]
    levels = sorted({r["concurrency"] for r in rows})
    best = {}
    for level in levels:
        at = [r for r in rows if r["concurrency"] == level]
        best[str(level)] = max(at, key=lambda r: r["aggregate_tok_s"])["config"]
    plain_from = [lv for lv in levels if all(best[str(x)] == "plain" for x in levels if x >= lv)]
    return {
        "best_config_per_level": best,
        "crossover_concurrency": plain_from[0] if plain_from else None,
        "adaptive_min_speedup": min(adaptive) if adaptive else None,
        "adaptive_min_full_batch_speedup": min(full) if full else None,
    }


def _assemble(target, draft_path, info, options, engine, rows) -> dict:
    plain1 = next((r for r in rows if r["concurrency"] == 1 and r["config"] == "plain"), None)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": device_slug(target.device),
        "target": target.spec.label,
        "draft": draft_label(draft_path),
        "prompt_set": info["name"],
        "dtype": dtype_name(next(target.model.parameters()).dtype),
        "max_new_tokens": options.max_new_tokens,
        "engine": dataclasses.asdict(engine),
        "batch1_plain_tok_s": plain1["aggregate_tok_s"] if plain1 else None,
        "concurrency_sweep": rows,
        **summarize(rows),
        "caveats": caveats(options),
    }


def _prefill_mode(engine: EngineOptions) -> str:
    if engine.prefill_graphed:
        return "padded and graphed"
    return "compiled for any shape" if engine.prefill_compiled else "eager"


def caveats(options: SweepOptions) -> list[str]:
    return [
        "per_stream_tok_s is aggregate_tok_s / concurrency: the rate one stream sees while the batch is full",
        "aggregate_tok_s covers the whole run, the batch draining at its end included (rows run out of requests "
        "one by one, sooner where speculation's rows finish unevenly); full_batch_tok_s covers only the stretch "
        "from the first admissions until a row first finds no request waiting, as a server under steady load runs",
        f"requests per level: max({options.min_requests}, {options.per_slot} x concurrency), prompts of the "
        "set in order and repeated; the levels are not the same requests, compare configs within a level",
        "the engine runs CUDA graphs and compiled layers (dynamic shapes from 2 rows on), unpadded: each "
        "config verifies its own draft tokens; batch-1 figures of the release bench use padded passes; "
        f"admissions' prefills run {_prefill_mode(options.engine)} (EngineOptions.compile_prefill, prefill_graphs)",
        "adaptive: the policy measures plain steps and each config's rounds while it decodes, so its "
        "figure includes the rounds it spent trying configs that lost",
        "step times for the cost account are medians of the target pass alone at a context of half the cache",
        "usage: busy_row_fraction is the share of rows x batch passes that decoded an unfinished request (the "
        "rest stepped free, waiting or finished rows: the drain, deferred admissions, groups read back late); "
        "admit_share is the share of the run's wall time spent admitting (prefills)",
        "in bf16 a batch and a single request can round differently: identical_fraction counts requests "
        "whose tokens equal plain decoding's at the same level",
    ]


def _write(results: dict, options: SweepOptions, engine) -> Path:
    folder = Path(options.out_dir) / run_folder_name(
        results["date"], "concurrency", code_commit(), machine_slug(results["gpu"])
    )
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / RESULT, results)
    files = [RESULT]
    if plot_sweep(results, folder / "speedup-vs-concurrency.png"):
        files.append("speedup-vs-concurrency.png")
    config = {
        k: v if isinstance(v, (int, float, tuple, type(None))) else str(v)
        for k, v in dataclasses.asdict(options).items()
        if k not in ("command", "engine")
    }
    write_manifest(
        folder,
        options.command,
        {**config, "engine": dataclasses.asdict(engine)},
        "cuda" if results["gpu"] != "cpu" else "cpu",
        results["date"],
        what="concurrency sweep",
        files=files,
    )
    return folder


def plot_sweep(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = results["concurrency_sweep"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows if r["config"] != "plain"):
        pts = sorted((r["concurrency"], r["speedup"]) for r in rows if r["config"] == name)
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.axhline(1.0, color="grey", linestyle="--", label="plain (same engine, same level)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("speedup over plain")
    ax.set_title(f"{results['target']}, {results['prompt_set']}, {results['gpu']}: speedup vs concurrency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
