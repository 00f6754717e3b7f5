"""The release bench: a fixed, versioned prompt set, per-workload tau and speedup for several
decode configs, four baselines in the same run, a cost account, and a results contract.

Protocol: batch 1, greedy, one warm-up generation per engine/config/baseline excluded from the
timings (CUDA graphs are captured and HF's static-cache compile happens there), completions of up
to ``max_new_tokens`` that may stop at eos. Speedup is against ``engine_plain``: draftling's own
engine without speculation (CUDA-graphed on a GPU), on the same workload's prompts.

Outputs, beside each other in ``out_dir``: ``<date>-<gpu>[-tag].json`` (the contract below),
``.md`` (report tables), ``-grid.png`` and ``-tau-vs-speedup.png`` (plots), and
``-per-prompt.jsonl`` (one row per prompt, for audits).

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

import datetime
import hashlib
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftling.bench.simple import build_engine, device_name, parse_decode_config
from draftling.data.sources import prompt_sets_dir
from draftling.errors import ConfigError, DataError
from draftling.export.formats import load_any_draft
from draftling.io import atomic_path, write_json
from draftling.target import Target

BASELINES = ("engine_plain", "hf_static", "hf_prompt_lookup", "hf_eager")
DEFAULT_CONFIGS = ("chain-3-1-4", "tree-3-4-8", "tree-5-8-16")
DEFAULT_WORKLOAD = "default"
PROMPT_LOOKUP_TOKENS = 10
ROUND_TIMING_PROMPTS = 2  # per workload, for the per-round phase split
ROUND_PHASES = ("draft", "verify", "accept", "commit")
# The engine's attention on CUDA: "exact" for the speculative engine and its padded plain
# twin (the identity reference); the unpadded plain reference takes the faster bf16 "matmul"
# (bench/engine_profile.py measured both), so speedups are against the fastest plain engine.
GPU_ATTENTION, GPU_UNPADDED_ATTENTION = "exact", "matmul"
MARK_START = "<!-- release-bench:start -->"
MARK_END = "<!-- release-bench:end -->"
RESULT_KEYS = ("date", "gpu", "target", "draft", "prompt_set", "dtype", "command", "baselines",
               "baseline_details", "configs", "caveats")
_BUILTIN = re.compile(r"^v\d+$")


# ----------------------------------------------------------------------------- prompt sets

@dataclass
class BenchPrompt:
    id: str
    workload: str
    input_ids: list[int]


# The sha256 of each shipped set as first published. Sets are never edited in place (figures on
# v1 must stay comparable); a changed selection is a new version with its own line here.
PUBLISHED_PROMPT_SETS = {
    "v1": "46ca02dccc810c4ba760f5dfe2cf7e137e383c57c19421dc8e6a2f6d788a3948",
}


def builtin_prompt_sets() -> list[str]:
    root = prompt_sets_dir()
    return sorted(p.name[:-len(".jsonl")] for p in root.iterdir() if p.name.endswith(".jsonl"))


def resolve_prompt_set(prompt_set: str | Path) -> tuple[str, Path]:
    """(name, path): ``"v1"`` names a set shipped in the package; anything else is a jsonl path."""
    s = str(prompt_set)
    if _BUILTIN.match(s) and not Path(s).exists():
        res = prompt_sets_dir() / f"{s}.jsonl"
        if not res.is_file():
            raise DataError(f"prompt set {s!r} is not shipped (have: {', '.join(builtin_prompt_sets())})")
        return s, res
    path = Path(s).expanduser()
    if not path.is_file():
        raise DataError(f"prompt set {s}: not a built-in set name (v1, ...) nor a jsonl file")
    return str(path), path


def read_prompt_set(prompt_set: str | Path = "v1") -> tuple[dict, list[dict]]:
    """The set's provenance (name, path, sha256) and its raw records, each with a ``workload``
    (missing -> "default"). Records are project/ShareGPT/OpenAI prompts or pre-tokenized rows
    with ``input_ids`` (a ``loss_mask``, if present, cuts the prompt at the first reply token)."""
    name, path = resolve_prompt_set(prompt_set)
    raw = path.read_bytes()
    records = []
    for lineno, line in enumerate(raw.decode("utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path.name}:{lineno}: malformed JSON: {e.msg}") from None
        if not isinstance(rec, dict):
            raise DataError(f"{path.name}:{lineno}: expected a JSON object")
        rec.setdefault("id", f"{path.stem}:{lineno}")
        rec["workload"] = str(rec.get("workload") or DEFAULT_WORKLOAD)
        rec["_where"] = f"{path.name}:{lineno}"
        records.append(rec)
    if not records:
        raise DataError(f"{path}: empty prompt set")
    ids = [str(r["id"]) for r in records]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise DataError(f"{path}: duplicate prompt ids {dup[:5]}")
    info = {"name": name, "builtin": name != str(path), "path": str(path),
            "sha256": hashlib.sha256(raw).hexdigest()}
    if info["builtin"]:
        published = PUBLISHED_PROMPT_SETS.get(name)
        if published is None:
            raise DataError(f"prompt set {name} ({path}) has no published sha256 in "
                            "release.PUBLISHED_PROMPT_SETS: add it when the set is first released")
        if info["sha256"] != published:
            raise DataError(f"prompt set {name} ({path}) was edited in place: sha256 "
                            f"{info['sha256'][:12]} != published {published[:12]}; "
                            "restore it and put the change in a new version")
    return info, records


def tokenize_prompt_set(records: list[dict], target: Target, notes: list[str] | None = None
                        ) -> list[BenchPrompt]:
    """Token ids per record (chat template with the generation prompt for message records).
    Appends to ``notes`` what the caller should report (e.g. a template that drops tools)."""
    from draftling.data.prompts import _parse_record, prompt_messages
    from draftling.data.template import render

    out, tools_dropped, with_tools = [], 0, 0
    for rec in records:
        where = rec["_where"]
        if "input_ids" in rec:
            ids = [int(t) for t in rec["input_ids"]]
            mask = rec.get("loss_mask")
            if mask and 1 in mask:
                ids = ids[:mask.index(1)]
        else:
            body = {k: v for k, v in rec.items() if k != "_where"}
            fname, lineno = where.rsplit(":", 1)
            conv = _parse_record(body, Path(fname).stem, int(lineno), where)
            text = render(target.tokenizer, prompt_messages(conv), tools=conv.tools,
                          add_generation_prompt=True)
            if conv.tools:
                with_tools += 1
                tools_dropped += text == render(target.tokenizer, prompt_messages(conv),
                                                add_generation_prompt=True)
            ids = list(target.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise DataError(f"{where}: prompt {rec['id']} is empty after tokenization")
        out.append(BenchPrompt(str(rec["id"]), rec["workload"], ids))
    if tools_dropped and notes is not None:
        notes.append(f"the target's chat template ignores `tools`: {tools_dropped} of {with_tools} "
                     "prompts with tool schemas were rendered without them")
    return out


def load_prompt_set(prompt_set: str | Path, target: Target) -> tuple[dict, list[BenchPrompt]]:
    info, records = read_prompt_set(prompt_set)
    notes: list[str] = []
    prompts = tokenize_prompt_set(records, target, notes)
    info["notes"] = notes
    info["num_prompts"] = len(prompts)
    info["workloads"] = {w: sum(p.workload == w for p in prompts) for w in _workloads(prompts)}
    return info, prompts


def _workloads(prompts) -> list[str]:
    return list(dict.fromkeys(p.workload for p in prompts))  # file order


# ----------------------------------------------------------------------------- measuring

def gpu_slug(device) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def release_stem(out_dir: str | Path, date: str, gpu: str, tag: str | None = None) -> Path:
    """``<out_dir>/<date>-<gpu>[-<tag>]``: the common stem of every output file."""
    name = f"{date}-{gpu}"
    if tag:
        name += "-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", tag).strip("-")
    return Path(out_dir) / name


def check_results_free(stem: Path, overwrite: bool) -> None:
    if stem.parent.exists() and not stem.parent.is_dir():
        raise ConfigError(f"--results-dir {stem.parent}: is a file, not a directory")
    if stem.with_name(stem.name + ".json").exists() and not overwrite:
        raise ConfigError(f"{stem}.json: results of this date, machine and tag exist; pass --tag NAME to keep "
                          "both, or --overwrite to replace them")


class _Clock:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0


def _step_time(engine_target, q: int, ctx: int, token: int, clock: _Clock, reps: int) -> float:
    """Median seconds of one ``CachedTarget.fast`` call with q query tokens at context ``ctx``.

    Same argument shapes and dtypes as the engine's own calls (q=1: greedy decode; q=draft
    tokens: tree verify), so on a GPU this replays the CUDA graph captured in the warm-up.
    It writes K/V to slots ctx..ctx+q-1, which every generation overwrites before reading."""
    from draftling.engine.target_model import causal_mask

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
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos,
              pad_token_id=pad, temperature=None, top_p=None, top_k=None)
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


def run_release_bench(target: Target, draft_path, prompt_set: str | Path = "v1",
                      configs=DEFAULT_CONFIGS, max_new_tokens: int = 256,
                      baselines=BASELINES, baseline_prompts_per_workload: int | None = None,
                      cuda_graphs: bool | str = "auto", out_dir: str | Path = "bench/results",
                      tag: str | None = None, command: str | None = None,
                      quiet: bool = False, round_timing: bool | str = "auto",
                      compile: bool | str = "auto", query_pad: int | str = "auto",
                      attention: str = "auto", overwrite: bool = False) -> dict:
    """Run the release bench and write its outputs (see the module docstring). Returns the
    results dict as written to ``<release_stem(out_dir, date, gpu, tag)>.json``.

    ``baselines``: any of BASELINES; engine_plain always runs (speedups need it); the others
    left out are null in the results, with a caveat. ``baseline_prompts_per_workload``: run the
    HF baselines on the first N prompts of each workload only (they are slow); None = all.
    ``round_timing``: also measure the per-round phase split (``round_split_ms``) on the first
    ROUND_TIMING_PROMPTS prompts of each workload; "auto" = on CUDA.

    Engine options ("auto" = the GPU settings on CUDA, plain eager on CPU): ``compile`` the
    decoder layers; ``query_pad`` every target pass to that many rows (auto: the largest
    config's draft tokens), so plain and verify passes share kernels and a token's logits do
    not depend on the tree beside it; ``attention`` one of engine.target_model.ATTENTION_KINDS.
    With padding on, plain decoding also runs unpadded (auto: with the faster "matmul"
    attention on CUDA), and speedups are against the faster of the two. Results of the same
    date, machine and tag are refused before any work unless ``overwrite``."""
    from draftling.engine.generate import greedy_generate, speculative_generate

    t_start = time.perf_counter()
    if isinstance(configs, str):
        configs = configs.split(",")
    configs = [c.strip() for item in configs for c in str(item).split(",") if c.strip()]
    if isinstance(baselines, str):
        baselines = [b for b in baselines.split(",") if b]
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ConfigError(f"unknown baselines {unknown}; expected some of {', '.join(BASELINES)}")
    if not configs:
        raise ConfigError("the release bench needs at least one decode config")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if baseline_prompts_per_workload is not None and baseline_prompts_per_workload < 1:
        raise ConfigError("baseline_prompts_per_workload must be >= 1 (or None for all)")
    cfgs = [parse_decode_config(c) for c in configs]
    hf_runs = [b for b in BASELINES if b in baselines and b != "engine_plain"]

    device = target.device
    check_results_free(release_stem(out_dir, datetime.date.today().isoformat(), gpu_slug(device), tag), overwrite)
    dtype = next(target.model.parameters()).dtype
    on_gpu = device.type == "cuda"
    graphs = on_gpu if cuda_graphs in ("auto", None) else bool(cuda_graphs)
    compile = on_gpu if compile in ("auto", None) else bool(compile)
    auto_attention = attention in ("auto", None)
    attention = (GPU_ATTENTION if on_gpu else "sdpa") if auto_attention else attention
    unpadded_attention = GPU_UNPADDED_ATTENTION if auto_attention and on_gpu else attention
    timed_rounds = device.type == "cuda" if round_timing in ("auto", None) else bool(round_timing)
    clock = _Clock(device)
    info, prompts = load_prompt_set(prompt_set, target)
    workloads = _workloads(prompts)
    draft = load_any_draft(draft_path, device, dtype)
    max_draft = max(c.draft_tokens for c in cfgs)
    longest = max(len(p.input_ids) for p in prompts)
    max_len = longest + max_new_tokens + max_draft + 8
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit and longest + max_new_tokens > limit:
        raise DataError(f"the longest prompt ({longest} tokens) + {max_new_tokens} new tokens exceeds "
                        f"the target's max_position_embeddings {limit}")
    query_pad = (max_draft if on_gpu else 0) if query_pad in ("auto", None) else int(query_pad)
    if query_pad and query_pad < max_draft:
        raise ConfigError(f"query_pad {query_pad} is below the largest config's {max_draft} draft tokens")
    max_len += query_pad
    engine = dict(cuda_graphs=graphs, compile=compile, query_pad=query_pad, attention=attention)
    engine_target, runner = build_engine(target, draft, max_len, **engine)
    # Unpadded plain decoding on its own cache (same weights): the honest speedup reference
    # when padding costs the plain engine time.
    unpadded = None
    if query_pad:
        from draftling.engine.target_model import CachedTarget

        unpadded = CachedTarget.from_hf(target.model, engine_target.aux_layer_ids, max_len,
                                        **{**engine, "query_pad": 0, "attention": unpadded_attention})
        engine["unpadded_attention"] = unpadded_attention
    eos = target.stop_token_ids()

    def log(msg):
        if not quiet:
            print(f"[release-bench {time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    def plain(x, engine_target=engine_target):
        return greedy_generate(engine_target, x, max_new_tokens, eos_ids=eos)

    def spec(x, c, timing=False):
        return speculative_generate(engine_target, runner, x, max_new_tokens, c.steps, c.topk,
                                    c.draft_tokens, eos_ids=eos, timing=timing)

    def tensor(p):
        return torch.tensor([p.input_ids], device=device)

    # Warm-up, excluded from every timing: allocator, lazy init, CUDA-graph capture per shape.
    warm = tensor(prompts[0])
    plain(warm)
    if unpadded is not None:
        plain(warm, unpadded)
    for c in cfgs:
        spec(warm, c)
    log(f"warm-up done; {len(prompts)} prompts x (engine_plain + {len(cfgs)} configs)")

    rows = []
    refs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        x = tensor(p)
        ref, t = clock.timed(lambda: plain(x))
        ref = ref[0].tolist()
        refs[p.id] = ref
        row = {"id": p.id, "workload": p.workload, "prompt_tokens": len(p.input_ids),
               "engine_plain": {"tokens": len(ref), "s": t, "natural_stop": len(ref) < max_new_tokens}}
        if unpadded is not None:
            out, t = clock.timed(lambda: plain(x, unpadded))
            out = out[0].tolist()
            row["engine_plain_unpadded"] = {"tokens": len(out), "s": t, "identical": out == ref,
                                            "natural_stop": len(out) < max_new_tokens}
        for c in cfgs:
            (toks, stats), t = clock.timed(lambda: spec(x, c))
            toks = toks[0].tolist()
            row[c.name] = {"tokens": len(toks), "s": t, "identical": toks == ref,
                           "accepted": sum(stats.accept_lengths), "verifies": len(stats.accept_lengths),
                           "accept_counts": list(stats.accept_counts)}
        rows.append(row)
        if (i + 1) % 8 == 0 or i + 1 == len(prompts):
            log(f"engine: {i + 1}/{len(prompts)} prompts")

    # Per-round phase split: a separate pass with CUDA events, so the runs above stay
    # uninstrumented. Its warm-up captures the two graphs that timing replays instead of one.
    splits = {c.name: None for c in cfgs}
    if timed_rounds:
        timing_prompts = [p for w in workloads
                          for p in [q for q in prompts if q.workload == w][:ROUND_TIMING_PROMPTS]]
        for c in cfgs:
            spec(warm, c, timing=True)
            runs = [spec(tensor(p), c, timing=True)[1].timing for p in timing_prompts]
            splits[c.name] = _round_split([t for t in runs if t])
        log(f"round timing: {len(timing_prompts)} prompts x {len(cfgs)} configs")

    # HF baselines: the first N prompts of each workload; warm-up on the longest of them, so
    # the static cache is allocated (and the compiled decode step traced) at its largest size.
    subset = prompts
    if baseline_prompts_per_workload is not None:
        subset = [p for w in workloads
                  for p in [q for q in prompts if q.workload == w][:baseline_prompts_per_workload]]
    by_id = {r["id"]: r for r in rows}
    pad = _pad_id(target, eos)
    for name in hf_runs:
        kw = _hf_kwargs(name, max_new_tokens, eos, pad)

        def hf(x, kw=kw):
            return target.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)

        hf(tensor(max(subset, key=lambda p: len(p.input_ids))))
        for p in subset:
            x = tensor(p)
            out, t = clock.timed(lambda: hf(x))
            toks = out[0, x.shape[1]:].tolist()
            by_id[p.id][name] = {"tokens": len(toks), "s": t, "natural_stop": len(toks) < max_new_tokens,
                                 "identical": toks == refs[p.id]}
        log(f"{name}: {len(subset)} prompts")

    # Cost account: time the target forward alone at q=1 (a plain decode step) and at
    # q=draft_tokens (a verify pass), same shapes as the engine's calls.
    ctx = int(statistics.median(len(p.input_ids) for p in prompts)) + max_new_tokens // 2
    reps = 30 if clock.cuda else 7
    tok0 = int(prompts[0].input_ids[-1])
    step_s = {q: _step_time(engine_target, q, ctx, tok0, clock, reps)
              for q in sorted({1} | {c.draft_tokens for c in cfgs})}
    if unpadded is not None:
        step_s["1_unpadded"] = _step_time(unpadded, 1, ctx, tok0, clock, reps)

    results = _assemble(target, draft_path, info, dtype, device, cfgs, workloads, rows, baselines,
                        hf_runs, subset, baseline_prompts_per_workload, max_new_tokens, step_s, ctx,
                        engine, command, splits)
    stem = release_stem(out_dir, results["date"], results["gpu"], tag)
    write_release_outputs(results, stem, rows)
    log(f"wrote {stem}.json/.md/-grid.png/-tau-vs-speedup.png")
    if not quiet:
        print(format_speedup_table(results))
    return results


def _assemble(target, draft_path, info, dtype, device, cfgs, workloads, rows, baselines, hf_runs,
              subset, per_workload_n, max_new_tokens, step_s, ctx, engine, command,
              splits=None) -> dict:
    def agg(rs, key):
        tokens = sum(r[key]["tokens"] for r in rs)
        secs = sum(r[key]["s"] for r in rs)
        return tokens, secs

    def tok_s(key):
        tokens, secs = agg(rows, key)
        return tokens / secs

    # Speedups are against the faster plain engine: padded (the identity reference) or not.
    both = "engine_plain_unpadded" in rows[0]
    padded_tok_s = tok_s("engine_plain")
    unpadded_tok_s = tok_s("engine_plain_unpadded") if both else None
    ref = "engine_plain_unpadded" if both and unpadded_tok_s > padded_tok_s else "engine_plain"
    by_w = {w: [r for r in rows if r["workload"] == w] for w in workloads}
    plain_w = {w: agg(by_w[w], ref) for w in workloads}
    plain_tokens, plain_secs = agg(rows, ref)
    plain_tok_s = {w: t / s for w, (t, s) in plain_w.items()}

    base = {b: None for b in BASELINES}
    details = {b: None for b in BASELINES}
    base["engine_plain"] = plain_tokens / plain_secs
    details["engine_plain"] = {
        "n": len(rows), "tokens": plain_tokens, "seconds": plain_secs,
        "natural_stops": sum(r[ref]["natural_stop"] for r in rows),
        "max_new_tokens": max_new_tokens, "cuda_graphs": engine["cuda_graphs"], "engine": engine,
        "speedup_reference": ref, "per_workload_tok_s": plain_tok_s}
    if both:
        details["engine_plain"].update(
            padded_tok_s=padded_tok_s, unpadded_tok_s=unpadded_tok_s,
            unpadded_identical_to_padded=sum(r["engine_plain_unpadded"]["identical"] for r in rows) / len(rows))
    subset_ids = {p.id for p in subset}
    sub_rows = [r for r in rows if r["id"] in subset_ids]
    for name in hf_runs:
        tokens, secs = agg(sub_rows, name)
        pt, ps = agg(sub_rows, ref)
        base[name] = tokens / secs
        details[name] = {
            "n": len(sub_rows), "prompts_per_workload": per_workload_n, "tokens": tokens,
            "seconds": secs, "natural_stops": sum(r[name]["natural_stop"] for r in sub_rows),
            "max_new_tokens": max_new_tokens,
            "identical_to_engine_plain": sum(r[name]["identical"] for r in sub_rows) / len(sub_rows),
            "engine_plain_tok_s_same_prompts": pt / ps,
            "prompt_ids": [r["id"] for r in sub_rows]}

    t1 = step_s["1_unpadded"] if ref == "engine_plain_unpadded" else step_s[1]
    out_cfgs = []
    for c in cfgs:
        per_w = {}
        for w in workloads:
            rs = by_w[w]
            tokens, secs = agg(rs, c.name)
            verifies = sum(r[c.name]["verifies"] for r in rs)
            tok_s = tokens / secs
            per_w[w] = {"tau": sum(r[c.name]["accepted"] for r in rs) / max(1, verifies),
                        "tok_s": tok_s, "speedup": tok_s / plain_tok_s[w]}
        verifies = sum(r[c.name]["verifies"] for r in rows)
        counts = [sum(r[c.name]["accept_counts"][d] for r in rows) for d in range(c.steps)]
        mean_speedup = statistics.fmean(v["speedup"] for v in per_w.values())
        mean_tau = statistics.fmean(v["tau"] for v in per_w.values())
        tq = step_s[c.draft_tokens]
        # A drafter that cost nothing would leave one verify pass per round: tau tokens for the
        # price of tq, against t1 per token for plain decoding. Everything the measured speedup
        # loses against that (draft passes, tree building, acceptance, KV compaction, Python
        # overhead) is counted as the drafting share.
        free = mean_tau * t1 / tq
        out_cfgs.append({
            "name": c.name, "steps": c.steps, "topk": c.topk, "draft_tokens": c.draft_tokens,
            "per_workload": per_w, "mean_speedup": mean_speedup, "mean_tau": mean_tau,
            "identical_fraction": sum(r[c.name]["identical"] for r in rows) / len(rows),
            "accept_rate_by_depth": [n / max(1, verifies) for n in counts],
            "cost": {"free_speedup": free, "drafting_share": 1.0 - mean_speedup / free,
                     "verify_q": c.draft_tokens, "plain_step_ms": t1 * 1e3, "verify_step_ms": tq * 1e3,
                     "round_ms": sum(r[c.name]["s"] for r in rows) / max(1, verifies) * 1e3,
                     "context_tokens": ctx},
            "round_split_ms": (splits or {}).get(c.name)})

    results = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu_slug(device),
        "target": target.spec.name,
        "draft": str(draft_path),
        "prompt_set": info,
        "dtype": str(dtype).replace("torch.", ""),
        "command": command if command is not None else " ".join(sys.argv),
        "baselines": base,
        "baseline_details": details,
        "configs": out_cfgs,
        "caveats": [],
    }
    results["caveats"] = release_caveats(results, device, engine["cuda_graphs"], baselines)
    assert tuple(results) == RESULT_KEYS
    return results


def _round_split(timings: list[dict]) -> dict | None:
    """Pool ``SpecStats.timing`` of several generations: mean ms per round by phase."""
    rounds = sum(t["rounds"] for t in timings)
    if not rounds:
        return None
    out = {p: sum(t[f"{p}_ms"] * t["rounds"] for t in timings) / rounds for p in ROUND_PHASES}
    out["total"] = sum(out[p] for p in ROUND_PHASES)
    out.update(rounds=rounds, prompts=len(timings))
    return out


def release_caveats(results: dict, device, graphs: bool, requested) -> list[str]:
    ps = results["prompt_set"]
    d = results["baseline_details"]
    plain = d["engine_plain"]
    n, cap = plain["n"], plain["max_new_tokens"]
    per_w = ps["workloads"]
    notes = [
        f"n = {n} prompts ({', '.join(f'{w} {k}' for w, k in per_w.items())}); single run, batch 1, "
        f"greedy, warm-up excluded, up to {cap} new tokens; device {device_name(device)}, "
        f"dtype {results['dtype']}, engine CUDA graphs {'on' if graphs else 'off'}, "
        f"compiled layers {'on' if plain.get('engine', {}).get('compile') else 'off'}",
        f"engine_plain: {plain['natural_stops']} of {n} completions stopped naturally (eos) before "
        f"the {cap}-token cap",
    ]
    if "padded_tok_s" in plain:
        eng = plain["engine"]
        pad, att = eng["query_pad"], eng["attention"]
        att_u = eng.get("unpadded_attention", att)
        notes.append(f"engine_plain: every target pass padded to {pad} queries with {att} attention (the "
                     f"identity reference) ran {plain['padded_tok_s']:.1f} tok/s, unpadded with {att_u} "
                     f"attention {plain['unpadded_tok_s']:.1f} tok/s; "
                     f"speedups are against the faster ({plain['speedup_reference']}); unpadded output "
                     f"equals padded on {plain['unpadded_identical_to_padded']:.0%} of prompts")
    small = min(per_w.values())
    if small < 30:
        notes.append(f"small n: {small} prompt(s) per workload at the least; per-workload tau and "
                     "speedup are rough, with no confidence interval")
    for b in BASELINES[1:]:
        bd = d[b]
        if bd is None:
            why = "not requested" if b not in requested else "not run"
            notes.append(f"{b}: not run ({why}); null in baselines")
            continue
        notes.append(f"{b}: n = {bd['n']} prompts"
                     + (f" ({bd['prompts_per_workload']} per workload)" if bd["prompts_per_workload"] else "")
                     + f", {bd['natural_stops']} of {bd['n']} stopped naturally before {cap} tokens; "
                     f"engine_plain on the same prompts: {bd['engine_plain_tok_s_same_prompts']:.1f} tok/s; "
                     f"output identical to engine_plain on {bd['identical_to_engine_plain']:.0%}"
                     + (f"; a subset of the {n}: compare with that same-prompt figure" if bd["n"] < n else ""))
    if torch.device(device).type != "cuda":
        notes.append("CPU run: eager engine without CUDA graphs, and transformers does not compile "
                     "hf_static on CPU; speedups here do not predict GPU speedups")
    for c in results["configs"]:
        if c["identical_fraction"] < 1.0:
            k = round((1 - c["identical_fraction"]) * n)
            notes.append(f"{c['name']}: {k} of {n} outputs differ from engine_plain (low-precision "
                         "near-ties can flip a greedy argmax; reported, not asserted)")
    notes.append("cost account: plain and verify step times are medians of the target forward alone "
                 f"(q=1 and q=draft_tokens, context ~{results['configs'][0]['cost']['context_tokens']} "
                 "tokens); drafting share = 1 - measured/free-drafter speedup, which lumps draft passes "
                 "with tree building, acceptance and KV compaction")
    split = next((c["round_split_ms"] for c in results["configs"] if c.get("round_split_ms")), None)
    if split:
        notes.append(f"round split: mean ms per round by phase from a separate pass with "
                     f"{'CUDA events' if torch.device(device).type == 'cuda' else 'wall-clock marks'} "
                     f"({split['prompts']} prompts per config); draft and verify replay there as "
                     "two graphs instead of one, and acceptance runs on the host (accept = "
                     "device->host read + Python acceptance; commit = move_kv + draft extend, up to the "
                     "next round's start). The timed runs instead accept and commit on the device and "
                     "queue rounds (engine.generate.RUN_AHEAD_ROUNDS), as engine_plain queues steps")
    notes += ps.get("notes", [])
    if ps.get("builtin"):
        notes.append(f"prompt set {ps['name']} is drawn from the shared training corpus: a draft "
                     "trained on those files may have seen these prompts")
    return notes


# ----------------------------------------------------------------------------- reports

def _fmt_cell(speedup: float, tau: float) -> str:
    return f"{speedup:.2f}x ({tau:.1f})"


def format_speedup_table(results: dict) -> str:
    """Markdown: rows = workloads + mean, columns = configs, cells 'speedup x (tau)'."""
    cfgs = results["configs"]
    per_w = results["prompt_set"]["workloads"]
    lines = ["| workload | n | " + " | ".join(c["name"] for c in cfgs) + " |",
             "|---|---:|" + "---:|" * len(cfgs)]
    for w, n in per_w.items():
        cells = [_fmt_cell(c["per_workload"][w]["speedup"], c["per_workload"][w]["tau"]) for c in cfgs]
        lines.append(f"| {w} | {n} | " + " | ".join(cells) + " |")
    cells = [f"**{_fmt_cell(c['mean_speedup'], c['mean_tau'])}**" for c in cfgs]
    lines.append(f"| **mean** | {sum(per_w.values())} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_baselines_table(results: dict) -> str:
    lines = ["| baseline | tok/s | n prompts | tokens | stopped before cap | engine_plain tok/s, same prompts |",
             "|---|---:|---:|---:|---:|---:|"]
    for b in BASELINES:
        d = results["baseline_details"][b]
        if d is None:
            lines.append(f"| {b} | not run | 0 | - | - | - |")
            continue
        same = d.get("engine_plain_tok_s_same_prompts", results["baselines"]["engine_plain"])
        lines.append(f"| {b} | {results['baselines'][b]:.1f} | {d['n']} | {d['tokens']} | "
                     f"{d['natural_stops']} | {same:.1f} |")
    return "\n".join(lines)


def format_acceptance_table(results: dict) -> str:
    depth = max(len(c["accept_rate_by_depth"]) for c in results["configs"])
    lines = ["| config | " + " | ".join(f"d{d + 1}" for d in range(depth)) + " |",
             "|---|" + "---:|" * depth]
    for c in results["configs"]:
        rates = c["accept_rate_by_depth"]
        cells = [f"{rates[d]:.1%}" if d < len(rates) else "" for d in range(depth)]
        lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_cost_table(results: dict) -> str:
    lines = ["| config | q | mean tau | plain step ms | verify step ms | round ms | free-drafter speedup "
             "| measured speedup | drafting share | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in results["configs"]:
        k = c["cost"]
        lines.append(f"| {c['name']} | {k['verify_q']} | {c['mean_tau']:.2f} | {k['plain_step_ms']:.2f} | "
                     f"{k['verify_step_ms']:.2f} | {k['round_ms']:.2f} | {k['free_speedup']:.2f}x | "
                     f"{c['mean_speedup']:.2f}x | {k['drafting_share']:.0%} | "
                     f"{c['identical_fraction']:.0%} |")
    return "\n".join(lines)


def format_round_split_table(results: dict) -> str:
    """Markdown: mean ms per speculative round by phase, or "" when not measured."""
    cfgs = [c for c in results["configs"] if c.get("round_split_ms")]
    if not cfgs:
        return ""
    lines = ["| config | rounds | " + " | ".join(f"{p} ms" for p in ROUND_PHASES) + " | round ms |",
             "|---|---:|" + "---:|" * (len(ROUND_PHASES) + 1)]
    for c in cfgs:
        k = c["round_split_ms"]
        lines.append(f"| {c['name']} | {k['rounds']} | " + " | ".join(f"{k[p]:.2f}" for p in ROUND_PHASES)
                     + f" | {k['total']:.2f} |")
    return "\n".join(lines)


def format_report(results: dict, stem_name: str | None = None) -> str:
    ps = results["prompt_set"]
    cap = results["baseline_details"]["engine_plain"]["max_new_tokens"]
    out = [f"# Release bench: {results['target']} with {results['draft']}", "",
           f"- date: {results['date']}; GPU: {results['gpu']}; dtype: {results['dtype']}",
           f"- prompt set: {ps['name']} ({ps['num_prompts']} prompts, sha256 {ps['sha256'][:12]}); "
           f"up to {cap} new tokens, batch 1, greedy",
           f"- configs: {', '.join(c['name'] for c in results['configs'])}",
           f"- command: `{results['command']}`", "",
           "## Speedup against engine_plain (tau in parentheses)", "", format_speedup_table(results), "",
           "## Baselines (tok/s)", "", format_baselines_table(results), "",
           "## Acceptance rate by depth (verify steps that accepted at least d draft tokens)", "",
           format_acceptance_table(results), "",
           "## Cost account", "",
           "Free-drafter speedup = mean tau x (plain step / verify step): the speedup if drafting cost "
           "nothing. Drafting share = 1 - measured / free.", "",
           format_cost_table(results), ""]
    split = format_round_split_table(results)
    if split:
        out += ["## Round split (mean ms per speculative round)", "",
                "Where a round's time goes: draft = tree drafting, verify = target pass on the tree, "
                "accept = reading the tree back + acceptance on the host, commit = KV compaction + "
                "draft extend.", "", split, ""]
    out += ["## Caveats", ""]
    out += [f"- {n}" for n in results["caveats"]]
    if stem_name:
        out += ["", f"![speedup grid]({stem_name}-grid.png)", "",
                f"![tau vs speedup]({stem_name}-tau-vs-speedup.png)"]
    return "\n".join(out) + "\n"


def _save_fig(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")


def plot_release(results: dict, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
            ax.text(j, i, f"{v:.2f}x\n(tau {taus[i][j]:.1f})", ha="center", va="center", fontsize=8,
                    color="black" if v > mid else "white")
    fig.colorbar(im, ax=ax, label="speedup vs engine_plain")
    ax.set_title(f"{results['target']} / {results['gpu']} / {results['prompt_set']['name']}")
    grid_path = Path(f"{stem}-grid.png")
    _save_fig(fig, grid_path)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    tmax = max(max(r) for r in taus)
    for k, c in enumerate(cfgs):
        color = f"C{k}"
        xs = [c["per_workload"][w]["tau"] for w in workloads]
        ys = [c["per_workload"][w]["speedup"] for w in workloads]
        ax.scatter(xs, ys, color=color, label=c["name"])
        for x, y, w in zip(xs, ys, workloads):
            ax.annotate(w, (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ratio = c["cost"]["plain_step_ms"] / c["cost"]["verify_step_ms"]
        x1 = max(tmax * 1.05, 1.5)
        ax.plot([1.0, x1], [ratio, ratio * x1], color=color, ls="--", lw=1,
                label=f"{c['name']} free drafter (tau x {ratio:.2f})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("tau (tokens per verify step, bonus counted)")
    ax.set_ylabel("speedup vs engine_plain")
    ax.legend(fontsize=7)
    ax.set_title("tau vs speedup, one point per workload x config")
    scatter_path = Path(f"{stem}-tau-vs-speedup.png")
    _save_fig(fig, scatter_path)
    plt.close(fig)
    return [grid_path, scatter_path]


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


def update_benchmarks_md(results_json_path: str | Path, benchmarks_md: str | Path = "BENCHMARKS.md") -> Path:
    """Rewrite the section between the release-bench markers of BENCHMARKS.md with the latest
    results (table, command, date, GPU, n, configs); everything else in the file is kept.
    Creates the file, or appends the section, when missing."""
    results_json_path = Path(results_json_path)
    results = json.loads(results_json_path.read_text())
    md = Path(benchmarks_md)
    try:
        link = results_json_path.resolve().relative_to(md.resolve().parent).as_posix()
    except ValueError:
        link = str(results_json_path)
    ps = results["prompt_set"]
    bd = results["baseline_details"]
    base = ", ".join(
        f"{b} {results['baselines'][b]:.1f} (n {bd[b]['n']})" if results["baselines"][b] is not None
        else f"{b} not run" for b in BASELINES)
    section = "\n".join([
        MARK_START,
        "## Release bench (latest)", "",
        f"- date: {results['date']}; GPU: {results['gpu']}; dtype: {results['dtype']}",
        f"- target: {results['target']}; draft: {results['draft']}",
        f"- prompt set: {ps['name']}, n = {ps['num_prompts']} "
        f"({', '.join(f'{w} {k}' for w, k in ps['workloads'].items())})",
        f"- configs: {', '.join(c['name'] for c in results['configs'])}; "
        f"up to {bd['engine_plain']['max_new_tokens']} new tokens, batch 1, greedy",
        f"- command: `{results['command']}`",
        f"- results: [{results_json_path.name}]({link})", "",
        "Speedup against draftling's engine without speculation, tau in parentheses:", "",
        format_speedup_table(results), "",
        f"Baselines (tok/s): {base}.", "",
        "Caveats:", "",
        *[f"- {n}" for n in results["caveats"]],
        MARK_END,
    ])
    if md.is_file():
        text = md.read_text()
        a, b = text.find(MARK_START), text.find(MARK_END)
        if a >= 0 and b > a:
            text = text[:a] + section + text[b + len(MARK_END):]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
    else:
        text = "# Benchmarks\n\n" + section + "\n"
    with atomic_path(md) as tmp:
        tmp.write_text(text)
    _readable(md)
    return md
