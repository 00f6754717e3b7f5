"""Device script: where a speculative round's time goes at many rows (issue 46: at 64 rows a
chain-3 round cost 2.3x a plain step, drafting about half of it).

At each row count, the engine the concurrency sweep builds (CUDA graphs, compiled, unpadded)
decodes 2 x rows v1 prompts (256 new tokens) plain and with each config, after a warm-up; then
one more run of each under torch.profiler. Per row count and config: tok/s, the engine's own
phase timer (SpecOptions(timing=True)), and the top kernels by their own device time and the top
host ops by their own CPU time (host-side work and syncs show there), per generated token.

    python3 lab/gpu/round_profile.py --target T --draft D --out FILE [--rows 1,64]
        [--configs chain-3-1-4,tree-3-4-8] [--max-new 256] [--device cpu]
"""

import argparse
import json

from torch.profiler import ProfilerActivity, profile

from draftling.bench.concurrency import timed_after_warmup
from draftling.bench.release import load_prompt_set
from draftling.bench.simple import build_engine, decode_configs
from draftling.engine import EngineOptions, batch_generate
from draftling.export.formats import load_any_draft
from draftling.target import load_target


def own_times(prof, device: bool) -> list[tuple[str, float, int]]:
    """(name, microseconds, calls) per profiled event, longest first: a kernel's own device
    time, or an op's own CPU time (self times: an op's children are not counted again)."""
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) if device else e.self_cpu_time_total
        rows.append((e.key[:120], us, e.count))
    return sorted(rows, key=lambda r: -r[1])


def top(prof, device: bool, tokens: int, n: int = 15) -> list:
    rows = [r for r in own_times(prof, device) if r[1]][:n]
    return [{"name": name, "us_per_token": us / tokens, "calls": calls} for name, us, calls in rows]


def one(tgt, runner, ids, max_new, tree) -> dict:
    kw = {"draft": runner, "tree": tree} if tree else {}
    level = tgt.batch_size
    out, s = timed_after_warmup(
        tgt, lambda: batch_generate(tgt, ids, max_new, **kw), lambda: batch_generate(tgt, ids[:level], 4, **kw)
    )
    tokens = sum(len(r.tokens) for r in out)
    timed = batch_generate(tgt, ids, max_new, timing=True, **kw) if tree else None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tgt.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        batch_generate(tgt, ids, max_new, **kw)
    return {
        "tok_s": tokens / s,
        "tokens": tokens,
        "timing": timed[0].stats.timing if timed else None,
        "device_kernels": top(prof, True, tokens) if tgt.device.type == "cuda" else [],
        "host_ops": top(prof, False, tokens),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--configs", default="chain-3-1-4,tree-3-4-8")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    target = load_target(a.target, dtype="bfloat16" if a.device == "cuda" else "float32", device=a.device)
    draft = load_any_draft(a.draft, target.device, next(target.model.parameters()).dtype)
    configs = decode_configs(draft, a.configs.split(","))
    engine = EngineOptions.auto().resolve(target.device, 0)
    _, prompts = load_prompt_set("v1", target)
    results = {"command": "python3 lab/gpu/round_profile.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items())}
    for rows in (int(x) for x in a.rows.split(",")):
        ids = [prompts[i % len(prompts)].input_ids for i in range(2 * rows)]
        size = max(map(len, ids)) + a.max_new + max(c.draft_tokens for c in configs) + 8
        tgt, runner = build_engine(target, draft, size, engine, batch_size=rows)
        level = {"plain": one(tgt, runner, ids, a.max_new, None)}
        for c in configs:
            level[c.name] = one(tgt, runner, ids, a.max_new, (c.steps, c.topk, c.draft_tokens))
        results[str(rows)] = level
        print(rows, {k: round(v["tok_s"]) for k, v in level.items()}, flush=True)
        with open(a.out, "w") as f:  # after every row count: a cut run keeps what it measured
            json.dump(results, f, indent=1)
        del tgt, runner


if __name__ == "__main__":
    main()
