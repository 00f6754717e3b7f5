"""The release bench: a fixed, versioned prompt set, per-workload tau and speedup for several
decode configs, four baselines in the same run, a cost account, and a results contract. This
module runs it (timing, orchestration; prompt sets are read in data/prompt_sets.py, its options
and output stem are in bench/release_options.py, its results dict in bench/release_results.py);
bench/report.py writes what it found.

Protocol: batch 1, greedy, one warm-up generation per engine/config/baseline excluded from the
timings (CUDA graphs are captured and HF's static-cache compile happens there), completions of up
to ``max_new_tokens`` that may stop at eos. Speedup is against ``engine_plain``: draftling's own
engine without speculation (CUDA-graphed on a GPU), on the same workload's prompts.

Outputs: one folder per run in ``out_dir``, ``<date>-release-<commit>-<machine>[-<tag>]/``
(bench/manifest.py), holding ``<date>-<gpu>[-tag].json`` (the contract below), ``.md`` (report
tables), ``-grid.png`` and ``-tau-vs-speedup.png`` (plots), ``-per-prompt.jsonl`` (one row per
prompt, for audits) and ``manifest.json`` (commit, command, config, machine, date).

JSON contract (top-level keys, exactly): date, gpu, target, draft, prompt_set, dtype, command,
baselines ({engine_plain, hf_static, hf_prompt_lookup, hf_eager} -> tok/s or null when not run),
baseline_details (same keys -> {n, tokens, ...} or null), configs (list of {name, steps, topk,
draft_tokens, per_workload: {workload: {tau, tok_s, speedup}}, mean_speedup, mean_tau,
identical_fraction, accept_rate_by_depth, cost: {free_speedup, drafting_share, ...},
round_split_ms: {draft, verify, accept, commit, total, rounds, prompts} or null}), caveats.
``round_split_ms`` (on CUDA by default) is the mean ms per speculative round by phase, from a
separate instrumented pass (see ``engine.spec_round.RoundTimer``), so the timed runs stay
uninstrumented.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftling.bench.manifest import device_slug, write_manifest
from draftling.bench.release_options import ReleaseOptions, check_results_free, release_stem
from draftling.bench.release_results import Measured, assemble_results, pool_round_split, sampled_config
from draftling.bench.report import (  # noqa: F401 (release.X for callers)
    MARK_END,
    MARK_START,
    ROUND_PHASES,
    format_speedup_table,
    release_caveats,
    update_benchmarks_md,
    write_release_outputs,
)
from draftling.bench.simple import DecodeConfig, build_engine, decode_configs
from draftling.data.prompt_sets import BenchPrompt, read_prompt_set, tokenize_prompt_set
from draftling.engine import CachedTarget, DraftRunner, build_target, causal_mask, greedy_generate, speculative_generate
from draftling.errors import DataError
from draftling.export.formats import load_any_draft
from draftling.progress import Progress
from draftling.target import Target
from draftling.timing import timed

logger = logging.getLogger(__name__)

PROMPT_LOOKUP_TOKENS = 10
ROUND_TIMING_PROMPTS = 2  # per workload, for the per-round phase split

# ----------------------------------------------------------------------------- prompt sets


def load_prompt_set(prompt_set: str | Path, target: Target) -> tuple[dict, list[BenchPrompt]]:
    """A prompt set (data/prompt_sets.py) in the target's tokens; ``info`` adds the notes and
    counts the results record."""
    info, records = read_prompt_set(prompt_set)
    notes: list[str] = []
    prompts = tokenize_prompt_set(records, target.tokenizer, notes)
    info["notes"] = notes
    info["num_prompts"] = len(prompts)
    info["workloads"] = {w: sum(p.workload == w for p in prompts) for w in _workloads(prompts)}
    return info, prompts


def _workloads(prompts) -> list[str]:
    return list(dict.fromkeys(p.workload for p in prompts))  # file order


# ----------------------------------------------------------------------------- measuring


class _Clock:
    def __init__(self, device):
        self.device, self.cuda = device, torch.device(device).type == "cuda"

    def timed(self, fn):
        return timed(fn, self.device)


def _step_time(engine_target, q: int, ctx: int, token: int, clock: _Clock, reps: int) -> float:
    """Median seconds of one ``CachedTarget.fast`` call with q query tokens at context ``ctx``.

    Same argument shapes and dtypes as the engine's own calls (q=1: greedy decode; q=draft
    tokens: tree verify), so on a GPU this replays the CUDA graph captured in the warm-up.
    It writes K/V to slots ctx..ctx+q-1, which every generation overwrites before reading."""
    dev, size = engine_target.device, engine_target.max_seq_len
    ctx = max(0, min(ctx, size - q))
    ids = torch.full((1, q), token, dtype=torch.long, device=dev)
    pos = ctx + torch.arange(q, device=dev)
    mask = causal_mask(ctx, q, size, dev)
    for _ in range(3):
        engine_target.fast(ids, pos, pos, mask)
    times = [clock.timed(lambda: engine_target.fast(ids, pos, pos, mask))[1] for _ in range(reps)]
    return statistics.median(times)


def _hf_kwargs(name: str, max_new_tokens: int, eos: list[int], pad: int) -> dict:
    kw = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=pad,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    if name == "hf_static":
        kw["cache_implementation"] = "static"  # transformers auto-compiles the decode step on GPU
    elif name == "hf_prompt_lookup":
        kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    return kw


def _pad_id(target: Target, eos: list[int]) -> int:
    pad = getattr(target.tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(target.model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return int(pad)


def first_per_workload(prompts: list[BenchPrompt], k: int | None) -> list[BenchPrompt]:
    if k is None:
        return list(prompts)
    return [p for w in _workloads(prompts) for p in [q for q in prompts if q.workload == w][:k]]


@dataclass
class _Run:
    """A release run as fixed before any timing: what it decodes, on which engines."""

    target: Target
    draft_path: str | Path
    opts: ReleaseOptions
    date: str
    info: dict  # the prompt set's provenance
    prompts: list[BenchPrompt]
    configs: list[DecodeConfig]
    engine: dict  # the resolved EngineOptions as they ran (+ the unpadded reference's attention)
    main: CachedTarget
    runner: DraftRunner
    unpadded: CachedTarget | None  # plain decoding without padding, beside a padded engine
    log: Callable[[str], None]
    clock: _Clock = field(init=False)
    eos: list[int] = field(init=False)

    def __post_init__(self):
        self.clock, self.eos = _Clock(self.device), self.target.stop_token_ids()

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.model.parameters()).dtype

    @property
    def workloads(self) -> list[str]:
        return _workloads(self.prompts)

    @property
    def timed_rounds(self) -> bool:
        rt = self.opts.round_timing
        return self.device.type == "cuda" if rt == "auto" else bool(rt)

    def tensor(self, p: BenchPrompt) -> torch.Tensor:
        return torch.tensor([p.input_ids], device=self.device)

    def plain(self, x, unpadded: bool = False, **sampling):
        return greedy_generate(
            self.unpadded if unpadded else self.main, x, self.opts.max_new_tokens, eos_ids=self.eos, **sampling
        )

    def spec(self, x, c: DecodeConfig, timing: bool = False, **sampling):
        return speculative_generate(
            self.main,
            self.runner,
            x,
            self.opts.max_new_tokens,
            c.steps,
            c.topk,
            c.draft_tokens,
            eos_ids=self.eos,
            timing=timing,
            **sampling,
        )


def run_release_bench(target: Target, draft_path, options: ReleaseOptions | None = None, **fields) -> dict:
    """Run the release bench and write its run folder (see the module docstring). ``options``
    (default: the protocol), with ReleaseOptions or EngineOptions fields as keywords over it.
    Returns the results dict as written to ``<release_stem(out_dir, date, gpu, tag)>.json``."""
    t_start = time.perf_counter()
    opts = ReleaseOptions.of(options, **fields)
    date = datetime.date.today().isoformat()
    stem = release_stem(opts.out_dir, date, device_slug(target.device), opts.tag)
    check_results_free(stem, opts.overwrite)

    def log(msg):
        if not opts.quiet:
            logger.info(f"[release-bench {time.perf_counter() - t_start:7.1f}s] {msg}")

    run = _start(target, draft_path, opts, date, log)
    _warm_up(run)
    rows, refs = _time_engine(run)
    splits = _time_rounds(run)
    subset = _time_hf_baselines(run, rows, refs)
    ctx, step_s = _time_steps(run)
    sampled = _time_sampled(run)
    results = assemble_results(run, Measured(rows, [p.id for p in subset], step_s, ctx, splits, sampled))
    paths = write_release_outputs(results, stem, rows)
    config = {
        "target": results["target"],
        "draft": results["draft"],
        "dtype": results["dtype"],
        "device": str(run.device),
        **opts.record(run.engine, run.timed_rounds),
    }
    write_manifest(
        stem.parent,
        opts.command,
        config,
        run.device,
        date,
        what="release bench",
        files=sorted(p.name for p in paths.values()),
    )
    log(f"wrote {stem.parent}/: {stem.name}.json/.md/-grid.png/-tau-vs-speedup.png, manifest.json")
    if not opts.quiet:
        print(format_speedup_table(results))
    return results


def _start(target: Target, draft_path, opts: ReleaseOptions, date: str, log) -> _Run:
    """Everything before the first timing: engine options, prompts, the draft and the engines."""
    device = target.device
    draft = load_any_draft(draft_path, device, next(target.model.parameters()).dtype)
    configs = decode_configs(draft, opts.configs)
    max_draft = max(c.draft_tokens for c in configs)
    engine = opts.engine.resolve(device, max_draft)
    info, prompts = load_prompt_set(opts.prompt_set, target)
    longest = max(len(p.input_ids) for p in prompts)
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit and longest + opts.max_new_tokens > limit:
        raise DataError(
            f"the longest prompt ({longest} tokens) + {opts.max_new_tokens} new tokens exceeds "
            f"the target's max_position_embeddings {limit}"
        )
    max_len = longest + opts.max_new_tokens + max_draft + 8 + engine.query_pad
    main, runner = build_engine(target, draft, max_len, engine)
    record, unpadded = dataclasses.asdict(engine), None
    if engine.query_pad:
        # Unpadded plain decoding on its own cache (same weights): the honest speedup reference
        # when padding costs the plain engine time.
        reference = opts.engine.unpadded(device)
        unpadded = build_target(target.model, main.aux_layer_ids, max_len, options=reference)
        record["unpadded_attention"] = reference.attention
    return _Run(target, draft_path, opts, date, info, prompts, configs, record, main, runner, unpadded, log)


def _warm_up(run: _Run) -> None:
    """Allocator, lazy init, CUDA-graph capture per shape: excluded from every timing."""
    warm = run.tensor(run.prompts[0])
    run.plain(warm)
    if run.unpadded is not None:
        run.plain(warm, unpadded=True)
    for c in run.configs:
        run.spec(warm, c)
    run.log(f"warm-up done; {len(run.prompts)} prompts x (engine_plain + {len(run.configs)} configs)")


def _time_engine(run: _Run) -> tuple[list[dict], dict[str, list[int]]]:
    """One row per prompt: engine_plain (and unpadded), then each config; and plain's tokens."""
    rows, refs, cap = [], {}, run.opts.max_new_tokens
    progress = Progress(len(run.prompts), "engine", emit=run.log, bar=False)
    for i, p in enumerate(run.prompts):
        x = run.tensor(p)
        ref, t = run.clock.timed(lambda: run.plain(x))
        ref = refs[p.id] = ref[0].tolist()
        row = {
            "id": p.id,
            "workload": p.workload,
            "prompt_tokens": len(p.input_ids),
            "engine_plain": {"tokens": len(ref), "s": t, "natural_stop": len(ref) < cap},
        }
        if run.unpadded is not None:
            out, t = run.clock.timed(lambda: run.plain(x, unpadded=True))
            out = out[0].tolist()
            row["engine_plain_unpadded"] = {
                "tokens": len(out),
                "s": t,
                "identical": out == ref,
                "natural_stop": len(out) < cap,
            }
        for c in run.configs:
            (toks, stats), t = run.clock.timed(lambda: run.spec(x, c))
            toks = toks[0].tolist()
            row[c.name] = {
                "tokens": len(toks),
                "s": t,
                "identical": toks == ref,
                "accepted": sum(stats.accept_lengths),
                "verifies": len(stats.accept_lengths),
                "accept_counts": list(stats.accept_counts),
            }
        rows.append(row)
        last = (i + 1) % 8 == 0 or i + 1 == len(run.prompts)
        progress.update(1, f"engine: {i + 1}/{len(run.prompts)} prompts" if last else None)
    return rows, refs


def _time_rounds(run: _Run) -> dict:
    """Per-round phase split: a separate pass with CUDA events, so the runs above stay
    uninstrumented. Its warm-up captures the two graphs that timing replays instead of one."""
    splits = {c.name: None for c in run.configs}
    if not run.timed_rounds:
        return splits
    prompts = first_per_workload(run.prompts, ROUND_TIMING_PROMPTS)
    for c in run.configs:
        run.spec(run.tensor(run.prompts[0]), c, timing=True)
        timings = [run.spec(run.tensor(p), c, timing=True)[1].timing for p in prompts]
        splits[c.name] = pool_round_split([t for t in timings if t])
    run.log(f"round timing: {len(prompts)} prompts x {len(run.configs)} configs")
    return splits


def _time_hf_baselines(run: _Run, rows: list[dict], refs: dict) -> list[BenchPrompt]:
    """HF baselines on the first N prompts of each workload, into ``rows``; warm-up on the
    longest of them, so the static cache is allocated (and the compiled decode step traced) at
    its largest size. Returns the prompts they ran on."""
    subset = first_per_workload(run.prompts, run.opts.baseline_prompts_per_workload)
    by_id, cap = {r["id"]: r for r in rows}, run.opts.max_new_tokens
    pad = _pad_id(run.target, run.eos)
    progress = Progress(len(subset) * len(run.opts.hf_runs), "baselines", emit=run.log, bar=False)
    for name in run.opts.hf_runs:
        kw = _hf_kwargs(name, cap, run.eos, pad)

        def hf(x, kw=kw):
            return run.target.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)

        hf(run.tensor(max(subset, key=lambda p: len(p.input_ids))))
        for p in subset:
            x = run.tensor(p)
            out, t = run.clock.timed(lambda: hf(x))
            toks = out[0, x.shape[1] :].tolist()
            by_id[p.id][name] = {
                "tokens": len(toks),
                "s": t,
                "natural_stop": len(toks) < cap,
                "identical": toks == refs[p.id],
            }
            progress.update(1)
        progress.update(0, f"{name}: {len(subset)} prompts")
    return subset


def _time_steps(run: _Run) -> tuple[int, dict]:
    """Cost account: the target forward alone at q=1 (a plain decode step) and at
    q=draft_tokens (a verify pass), same shapes as the engine's calls. Returns (context, s)."""
    ctx = int(statistics.median(len(p.input_ids) for p in run.prompts)) + run.opts.max_new_tokens // 2
    reps = 30 if run.clock.cuda else 7
    tok0 = int(run.prompts[0].input_ids[-1])
    step_s = {
        q: _step_time(run.main, q, ctx, tok0, run.clock, reps)
        for q in sorted({1} | {c.draft_tokens for c in run.configs})
    }
    if run.unpadded is not None:
        step_s["1_unpadded"] = _step_time(run.unpadded, 1, ctx, tok0, run.clock, reps)
    return ctx, step_s


def _time_sampled(run: _Run) -> dict:
    """Sampled decoding at each of ``sampled_temperatures``: plain (on the speedup reference's
    engine) and each config on every prompt, one generator seed per prompt. Verification is
    lossless, so both follow the target's law, but their tokens differ: only rates compare."""
    out = {}
    temps = run.opts.sampled_temperatures
    progress = Progress(len(temps) * len(run.prompts), "sampled", emit=run.log, bar=False)
    for temp in temps:
        rows = []
        for i, p in enumerate(run.prompts):
            x = run.tensor(p)

            def seeded(i=i):
                return {"temperature": temp, "generator": torch.Generator(device=run.device).manual_seed(i)}

            toks, t = run.clock.timed(lambda: run.plain(x, unpadded=run.unpadded is not None, **seeded()))
            row = {"workload": p.workload, "plain": {"tokens": toks.shape[1], "s": t}}
            for c in run.configs:
                (toks, stats), t = run.clock.timed(lambda: run.spec(x, c, **seeded()))
                row[c.name] = {
                    "tokens": toks.shape[1],
                    "s": t,
                    "accepted": sum(stats.accept_lengths),
                    "verifies": len(stats.accept_lengths),
                }
            rows.append(row)
            progress.update(
                1,
                f"sampled at temperature {temp}: {i + 1}/{len(run.prompts)} prompts"
                if (i + 1) % 8 == 0 and i + 1 < len(run.prompts)
                else None,
            )
        out[str(temp)] = {c.name: sampled_config(run, rows, c.name) for c in run.configs}
        progress.update(0, f"sampled at temperature {temp}: {len(rows)} prompts x (plain + {len(run.configs)} configs)")
    return out
