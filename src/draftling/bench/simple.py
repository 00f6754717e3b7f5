"""`draftling bench`: greedy speculative decoding on a prompt file, against the same engine
without speculation, with an exactness check and printed caveats."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftling.bench.manifest import device_name
from draftling.config import BenchConfig, RunConfig
from draftling.data.prompts import load_conversations, prompt_messages
from draftling.data.template import render
from draftling.draft.block import BlockDraft
from draftling.dtypes import dtype_name
from draftling.errors import ConfigError, DataError
from draftling.io import write_json
from draftling.progress import Progress
from draftling.target import Target
from draftling.timing import timed

if TYPE_CHECKING:
    from draftling.engine import EngineOptions

WARMUP_TOKENS = 16
_CONFIG = re.compile(r"^(?:(chain|tree)-)?(\d+)-(\d+)-(\d+)$")


@dataclass(frozen=True)
class DecodeConfig:
    name: str
    steps: int
    topk: int
    draft_tokens: int  # counts the root, as SGLang does


def parse_decode_config(name: str) -> DecodeConfig:
    """``chain-3-1-4`` / ``tree-3-4-8`` / ``3-1-4``: steps-topk-num_draft_tokens (SGLang naming)."""
    m = _CONFIG.match(name.strip())
    if not m:
        raise ConfigError(f"decode config {name!r}: expected steps-topk-draft_tokens, e.g. chain-3-1-4")
    steps, topk, ndt = int(m.group(2)), int(m.group(3)), int(m.group(4))
    if m.group(1) == "chain" and (topk != 1 or ndt != steps + 1):
        raise ConfigError(f"decode config {name!r}: a chain has topk 1 and draft_tokens = steps + 1")
    return DecodeConfig(name, steps, topk, ndt)


def block_config(draft: BlockDraft) -> DecodeConfig:
    """A block drafter's one decode shape: a chain of its block's drafts, ``block-B``."""
    k = draft.block_size - 1
    return DecodeConfig(f"block-{draft.block_size}", k, 1, k + 1)


def decode_configs(draft, names) -> list[DecodeConfig]:
    """The configs a head decodes: ``names`` (steps-topk-draft_tokens) for an EAGLE-3 head. A
    block drafter decodes its own ``block-B`` chain, then the trees among ``names`` no deeper
    than its block (a chain of ``names`` would be a shorter copy of its own)."""
    configs = [parse_decode_config(c) for c in names]
    if not isinstance(draft, BlockDraft):
        return configs
    trees = [c for c in configs if c.topk > 1 and c.steps < draft.block_size]
    return [block_config(draft), *trees]


def load_bench_prompts(path: str | Path, target: Target, n: int) -> list[tuple[str, list[int]]]:
    """Prompts as token ids. Accepts prompt/conversation files (rendered with the chat
    template, generation prompt added) or tokenized rows from `draftling data` (cut at the
    first assistant token, so the reply is left for the engine to write)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: prompt file not found")
    with open(path) as f:
        first = next((l for l in f if l.strip()), "")
    try:
        tokenized = "input_ids" in json.loads(first)
    except json.JSONDecodeError:
        raise DataError(f"{path.name}:1: malformed JSON") from None
    out = []
    if tokenized:
        from draftling.data.tokenized import load_tokenized

        for ex in load_tokenized(path):
            start = ex.loss_mask.index(1) if 1 in ex.loss_mask else len(ex.input_ids)
            out.append((ex.id, ex.source, ex.input_ids[:start]))
    else:
        for conv in load_conversations(path):
            text = render(target.tokenizer, prompt_messages(conv), tools=conv.tools, add_generation_prompt=True)
            out.append((conv.id, conv.source, target.tokenizer(text, add_special_tokens=False)["input_ids"]))
    out = [p for p in out if p[2]]
    if not out:
        raise DataError(f"{path}: no usable prompts")
    return [(pid, ids) for pid, _, ids in sample_by_source(out, n)]


def sample_by_source(rows: list[tuple], n: int) -> list[tuple]:
    """n rows ``(id, source, ...)`` in the proportions of their sources (largest remainder;
    file order within a source), interleaved source by source. A split of 14 gsm8k, 12 mbpp,
    11 alpaca, 9 sharegpt, 4 self-instruct and 3 oasst prompts gives 2/2/2/1/1/0 of 8: the
    sample estimates the split's tau, where one prompt per source in turn would weigh the
    3-prompt source like the 14-prompt one."""
    groups: dict[str, list] = {}
    for row in rows:
        groups.setdefault(row[1], []).append(row)
    sizes = {s: len(g) for s, g in groups.items()}
    if n >= len(rows):
        quota = sizes
    else:
        exact = {s: n * k / len(rows) for s, k in sizes.items()}
        quota = {s: int(e) for s, e in exact.items()}
        by_remainder = sorted(groups, key=lambda s: (-(exact[s] - quota[s]), -sizes[s]))
        for s in by_remainder[: n - sum(quota.values())]:
            quota[s] += 1
    out, queues = [], [groups[s][: quota[s]] for s in groups]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def build_engine(
    target: Target, draft, max_seq_len: int, options: EngineOptions | None = None, batch_size: int = 1, **engine
):
    """The decode engine for a target and a draft, both with ``options`` (resolved; default the
    plain eager engine), or its fields as keywords (see engine/options.py); ``batch_size`` rows
    for engine/generate.py's ragged batches."""
    from draftling.engine import EngineOptions, build_target

    options = EngineOptions.of(options, **engine)
    # The draft decides which layers feed it; using the target's defaults here instead would
    # be the silent off-by-one that collapses acceptance.
    ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
    engine_target = build_target(target.model, ids, max_seq_len, batch_size=batch_size, options=options)
    return engine_target, build_runner(target, draft, max_seq_len, options, batch_size)


def build_runner(target: Target, draft, max_seq_len: int, options: EngineOptions, batch_size: int = 1):
    """The draft's side of ``build_engine`` alone: another head on an engine target already
    built (the same aux layers, ``options`` and ``batch_size``, at least its cache length). A
    block drafter's runner holds its context cache; an EAGLE-3 head's, its own KV cache."""
    from draftling.engine import DraftRunner
    from draftling.engine.block_round import BlockRunner

    runner = BlockRunner if isinstance(draft, BlockDraft) else DraftRunner
    return runner(draft, target.input_embeddings(), max_seq_len, batch_size=batch_size, options=options)


class _Decoder:
    """Plain and speculative decoding on one eager engine with the bench's sampling settings;
    prompt i draws from seed + i, the same for plain and every config."""

    def __init__(self, target: Target, draft, max_len: int, bc: BenchConfig):
        from draftling.engine import EngineOptions

        self.options = EngineOptions()  # eager: this bench compares heads, bench --release times engines
        self.engine, self.runner = build_engine(target, draft, max_len, self.options)
        self.eos, self.bc, self.device = target.stop_token_ids(), bc, target.device
        self.sampled = bc.temperature > 0
        self.sampling = dict(temperature=bc.temperature, top_k=bc.top_k, top_p=bc.top_p)

    def _generator(self, i: int):
        return torch.Generator(device=self.device).manual_seed(self.bc.seed + i) if self.sampled else None

    def plain(self, ids, n: int | None = None, i: int = 0):
        from draftling.engine.generate import greedy_generate

        n = self.bc.max_new_tokens if n is None else n
        return greedy_generate(self.engine, ids, n, eos_ids=self.eos, generator=self._generator(i), **self.sampling)

    def spec(self, ids, c: DecodeConfig, n: int | None = None, i: int = 0):
        from draftling.engine.generate import speculative_generate

        n = self.bc.max_new_tokens if n is None else n
        return speculative_generate(
            self.engine,
            self.runner,
            ids,
            n,
            c.steps,
            c.topk,
            c.draft_tokens,
            eos_ids=self.eos,
            generator=self._generator(i),
            **self.sampling,
        )


@dataclass
class _Tally:
    """What the timed prompts add up to: plain totals, and per config tokens, time, acceptance."""

    configs: list[DecodeConfig]
    per_prompt: list = field(default_factory=list)
    plain_tokens: int = 0
    plain_time: float = 0.0
    natural_stops: int = 0
    totals: dict = field(init=False)

    def __post_init__(self):
        self.totals = {
            c.name: {
                "tokens": 0,
                "time": 0.0,
                "accepted": 0,
                "verifies": 0,
                "identical": 0,
                "accept_counts": [0] * c.steps,
            }
            for c in self.configs
        }

    def add_spec(self, name: str, toks: list[int], stats, seconds: float, same: bool) -> None:
        tot = self.totals[name]
        tot["tokens"] += len(toks)
        tot["time"] += seconds
        tot["accepted"] += sum(stats.accept_lengths)
        tot["verifies"] += len(stats.accept_lengths)
        tot["identical"] += int(same)
        tot["accept_counts"] = [a + b for a, b in zip(tot["accept_counts"], stats.accept_counts)]

    def taus(self) -> str:
        return ", ".join(f"{name} tau {t['accepted'] / max(1, t['verifies']):.2f}" for name, t in self.totals.items())


def run_bench(
    cfg: RunConfig, target: Target, draft_path, prompts_path, out: str | Path | None = None, quiet: bool = False
) -> dict:
    """Greedy (or sampled) speculative decoding of ``cfg.bench.num_prompts`` prompts of a file
    against the same engine without speculation; writes the results JSON to ``out`` if given,
    with the run's manifest fields inside it under "manifest"."""
    from draftling.bench.manifest import draft_label, manifest_fields
    from draftling.config import to_dict
    from draftling.export.formats import load_any_draft

    bc = cfg.bench
    device = target.device
    dtype = next(target.model.parameters()).dtype
    draft = load_any_draft(draft_path, device, dtype)
    configs = decode_configs(draft, bc.configs)
    prompts = load_bench_prompts(prompts_path, target, bc.num_prompts)
    max_draft = max(c.draft_tokens for c in configs)
    dec = _Decoder(target, draft, max(len(p) for _, p in prompts) + bc.max_new_tokens + max_draft + 8, bc)
    # Warm-up (allocator, lazy init) is excluded from every timing. This engine is eager, so
    # a few tokens exercise every shape; a whole completion would cost as much as a prompt.
    warm = torch.tensor([prompts[0][1]], device=device)
    dec.plain(warm, WARMUP_TOKENS)
    for c in configs:
        dec.spec(warm, c, WARMUP_TOKENS)
    tally = _time_prompts(dec, prompts, configs, quiet)

    plain_tok_s = tally.plain_tokens / tally.plain_time
    results = {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "dtype": dtype_name(dtype),
        "target": target.spec.label,
        "draft": draft_label(draft_path),
        "prompts": str(prompts_path),
        "num_prompts": len(prompts),
        "max_new_tokens": bc.max_new_tokens,
        "sampling": {**dec.sampling, "seed": bc.seed} if dec.sampled else None,
        "plain_tok_s": plain_tok_s,
        "configs": [_config_summary(c, tally.totals[c.name], plain_tok_s, len(prompts), dec.sampled) for c in configs],
        "per_prompt": tally.per_prompt,
    }
    results["caveats"] = caveats(results, tally.natural_stops)
    config = {
        "target": cfg.target,
        "dtype": results["dtype"],
        "device": str(device),
        "draft": draft_label(draft_path),
        "prompts": str(prompts_path),
        "bench": to_dict(bc),
        "engine": dataclasses.asdict(dec.options),
    }
    results["manifest"] = manifest_fields(None, config, device, results["date"])
    if not quiet:
        print(format_table(results))
    if out:
        write_json(out, results)
    return results


def _time_prompts(dec: _Decoder, prompts: list, configs: list[DecodeConfig], quiet: bool) -> _Tally:
    """Each prompt plain, then with each config, timed alone; one progress line per prompt."""
    bar = Progress(len(prompts), "bench", enabled=not quiet)
    started = time.perf_counter()
    tally = _Tally(configs)
    for i, (pid, ids) in enumerate(prompts):
        x = torch.tensor([ids], device=dec.device)
        ref, t_plain = timed(lambda: dec.plain(x, i=i), dec.device)
        ref = ref[0].tolist()
        tally.plain_tokens += len(ref)
        tally.plain_time += t_plain
        tally.natural_stops += int(len(ref) < dec.bc.max_new_tokens)
        row = {"id": pid, "prompt_tokens": len(ids), "plain_tokens": len(ref), "plain_s": t_plain}
        for c in configs:
            (toks, stats), t_spec = timed(lambda: dec.spec(x, c, i=i), dec.device)
            toks = toks[0].tolist()
            tally.add_spec(c.name, toks, stats, t_spec, toks == ref)
            row[c.name] = {
                "tau": stats.tau,
                "tokens": len(toks),
                "s": t_spec,
                "identical": None if dec.sampled else toks == ref,
            }
        tally.per_prompt.append(row)
        bar.update(
            1,
            f"bench: {len(tally.per_prompt)}/{len(prompts)} prompts, "
            f"{time.perf_counter() - started:.0f}s, {tally.taus()}",
        )
    bar.close()
    return tally


def _config_summary(c: DecodeConfig, tot: dict, plain_tok_s: float, n: int, sampled: bool) -> dict:
    tok_s = tot["tokens"] / tot["time"]
    return {
        "name": c.name,
        "steps": c.steps,
        "topk": c.topk,
        "draft_tokens": c.draft_tokens,
        # tau counts the bonus token: tokens emitted per verify step.
        "tau": tot["accepted"] / max(1, tot["verifies"]),
        "tok_s": tok_s,
        "speedup": tok_s / plain_tok_s,
        # Sampled decodes draw differently from the first rejection on: no token-level check.
        "identical_to_greedy": None if sampled else tot["identical"] / n,
        "accept_rate_by_depth": [a / max(1, tot["verifies"]) for a in tot["accept_counts"]],
    }


# What the bench decodes, in plain-decode token times: each prompt once plain and once per
# config. On the CPU engine a chain-3 pass took 1.23x the plain one at tau 1.6 (12.19 against
# 14.99 tok/s, quickstart of 2026-12-02); 1.3 leaves a little room for a weaker head.
SPEC_TIME_RATIO = 1.3


def estimate_bench_seconds(
    cfg: RunConfig, target: Target, prompt_tokens: int = 128, tokens: int = 16, repeats: int = 3
) -> dict:
    """The bench's cost on this machine, from timed plain decodes of ``tokens`` tokens after a
    random ``prompt_tokens``-token prompt on the same engine (the fastest of ``repeats``, so a
    transient load does not count): per-token seconds times what the bench will decode
    (warm-up included)."""
    from draftling.engine.general_target import build_target
    from draftling.engine.generate import greedy_generate

    bc = cfg.bench
    engine = build_target(target.model, target.aux_layer_ids, prompt_tokens + tokens + 16)
    ids = torch.randint(0, target.config.vocab_size, (1, prompt_tokens), device=target.device)
    greedy_generate(engine, ids, 4)  # warm-up: allocator, lazy init
    per_token = (
        min(timed(lambda: greedy_generate(engine, ids, tokens), target.device)[1] for _ in range(repeats)) / tokens
    )
    n_configs = len(bc.configs)
    decoded = (bc.num_prompts * bc.max_new_tokens + WARMUP_TOKENS) * (1 + SPEC_TIME_RATIO * n_configs)
    return {"per_token_s": round(per_token, 4), "seconds": round(decoded * per_token, 2)}


def caveats(results: dict, natural_stops: int) -> list[str]:
    n = results["num_prompts"]
    s = results.get("sampling")
    decoding = (
        f"sampled (temperature {s['temperature']}, top-k {s['top_k'] or 'off'}, top-p {s['top_p']}, seed {s['seed']})"
        if s
        else "greedy"
    )
    notes = [f"n = {n} prompts, single run, batch 1, {decoding}; device {results['device']}, dtype {results['dtype']}"]
    if s:
        notes.append(
            "sampled: speculative and plain outputs differ after the first rejection, so "
            "identity is not checked here; that sampling keeps the target's distribution is "
            "tested (tests/test_engine.py::test_sampling_matches_target_distribution)"
        )
    if n < 30:
        notes.append(f"small n ({n}): treat tau and speedup as rough")
    if natural_stops:
        notes.append(
            f"{natural_stops} of {n} plain completions stopped naturally before {results['max_new_tokens']} tokens"
        )
    if results["device"].startswith("cpu"):
        notes.append("eager CPU engine: speedups here do not predict GPU speedups")
    return notes


def format_table(results: dict) -> str:
    lines = [
        f"{'config':<14} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'identical':>10}",
        f"{'plain':<14} {'1.00':>6} {results['plain_tok_s']:>8.1f} {'1.00x':>8} {'-':>10}",
    ]
    for c in results["configs"]:
        same = "n/a" if c["identical_to_greedy"] is None else f"{c['identical_to_greedy']:.0%}"
        lines.append(f"{c['name']:<14} {c['tau']:>6.2f} {c['tok_s']:>8.1f} {c['speedup']:>7.2f}x {same:>10}")
    lines += [f"note: {n}" for n in results["caveats"]]
    return "\n".join(lines)
