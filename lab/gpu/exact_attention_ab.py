"""Device script: plain decoding with exact attention in the engine's matmul form (the cache
copied to fp32 and fp64 each pass) against a fused form written here (both products as broadcast
sums that inductor lowers to reductions over the cache as stored), a form whose scores come
from the bf16 cache on tensor cores (bmm with fp32 output; no fp32 copy of K), and bf16 matmul
attention for scale (``matmul_bf16_unfused``: without the engine's fused q/k/v and gate/up),
at several row counts. The other forms are patched in for their variant
only; the engine does not use them (BENCHMARKS.md: the fused form is faster at one row, much
slower at 64).

Each variant runs in a subprocess of its own (compiled code is per process). Per variant and
row count: the engine (CUDA graphs, compiled, unpadded) decodes max(16, 2 x rows) v1 prompts
plain and greedy, 256 new tokens, after a warm-up; the aggregate tok/s, the median ms of one
whole-batch pass at 1 and 16 queries per row (the sweep's _step_ms), and a hash of the tokens.

    python3 lab/gpu/exact_attention_ab.py --target T --out FILE [--rows 1,16,64] [--repeats 2] [--variants exact_fused,exact_matmul]
        [--device cpu] [--profile]
"""

import argparse
import hashlib
import json
import subprocess
import sys

VARIANTS = {
    "exact_fused": ("exact", "fused"),
    "exact_matmul": ("exact", None),
    "exact_bf16qk": ("exact", "bf16qk"),
    "matmul_bf16": ("matmul", None),
    "matmul_bf16_unfused": ("matmul", None),  # without the engine's fused projections
}


ENGINE_ATTENTION: list = []  # the engine's matmul_attention, once patched


def fused_exact_attention(q, k, v, mask, scale, exact: bool = False, sinks=None, softcap=None):
    """engine/target_model.matmul_attention's exact form, when compiled, with both products as
    broadcast sums (reductions reading the bf16 cache, no fp32 / fp64 copy); eager passes (the
    prefills) and everything else go to the engine's own function."""
    import torch

    if not (exact and torch.compiler.is_compiling()) or sinks is not None or softcap is not None:
        return ENGINE_ATTENTION[0](q, k, v, mask, scale, exact, sinks, softcap)
    b, h, t, d = q.shape
    nkv, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = h // nkv
    qg = q.reshape(b, nkv, rep * t, d)
    scores = (qg.float()[:, :, :, None] * k.float()[:, :, None]).sum(-1) * scale
    mask = mask[:, None, None] if mask.dim() == 3 else mask
    scores = scores.view(b, nkv, rep, t, s).masked_fill(~mask, float("-inf"))
    e = (scores - scores.amax(-1, keepdim=True)).exp().double()
    probs = (e / e.sum(-1, keepdim=True)).reshape(b, nkv, rep * t, s)
    return (probs[..., None] * v.double()[:, :, None]).sum(-2).to(v.dtype).view(b, h, t, dv)


def bf16qk_exact_attention(q, k, v, mask, scale, exact: bool = False, sinks=None, softcap=None):
    """The engine's exact form with the scores from the bf16 q and cache on tensor cores with
    fp32 output (bmm's out_dtype, CUDA only): no fp32 copy of K and no fp32 FMA GEMM. The bf16
    products are exact in fp32 and each score sums over the head dimension only, so a padded
    pass still gives a (query, key) pair the same score wherever its key sits; probs @ V stays
    in float64 as in the engine."""
    import torch

    if not exact or q.device.type != "cuda" or sinks is not None or softcap is not None:
        return ENGINE_ATTENTION[0](q, k, v, mask, scale, exact, sinks, softcap)
    b, h, t, d = q.shape
    nkv, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = h // nkv
    qg = q.reshape(b * nkv, rep * t, d)
    scores = torch.bmm(qg, k.reshape(b * nkv, s, d).transpose(1, 2), out_dtype=torch.float32) * scale
    mask = mask[:, None, None] if mask.dim() == 3 else mask
    scores = scores.view(b, nkv, rep, t, s).masked_fill(~mask, float("-inf"))
    e = (scores - scores.amax(-1, keepdim=True)).exp().double()
    probs = (e / e.sum(-1, keepdim=True)).reshape(b, nkv, rep * t, s)
    return torch.matmul(probs, v.double()).to(v.dtype).view(b, h, t, dv)


PATCHES = {"fused": fused_exact_attention, "bf16qk": bf16qk_exact_attention}


def one(a) -> dict:
    import draftling.engine.target_model as tm
    from draftling.bench.concurrency import _step_ms, timed_after_warmup
    from draftling.bench.release import load_prompt_set
    from draftling.engine import EngineOptions, batch_generate, build_target
    from draftling.target import load_target

    attention, patch = VARIANTS[a.variant]
    if patch:  # attention_outputs looks the function up in its module at trace time
        ENGINE_ATTENTION.append(tm.matmul_attention)
        tm.matmul_attention = PATCHES[patch]
    target = load_target(a.target, dtype="bfloat16" if a.device == "cuda" else "float32", device=a.device)
    _, prompts = load_prompt_set("v1", target)
    fuse = not a.variant.endswith("_unfused")
    opts = EngineOptions(cuda_graphs=True, compile=True, query_pad=0, attention=attention, fuse=fuse)
    out = {"variant": a.variant, "levels": []}
    for rows in (int(x) for x in a.rows.split(",")):
        ids = [prompts[i % len(prompts)].input_ids for i in range(max(16, 2 * rows))]
        size = max(map(len, ids)) + a.max_new + 24
        tgt = build_target(target.model, target.aux_layer_ids, size, batch_size=rows, options=opts)
        res, s = timed_after_warmup(
            tgt, lambda: batch_generate(tgt, ids, a.max_new), lambda: batch_generate(tgt, ids[:rows], 4)
        )
        tokens = [r.tokens for r in res]
        out["levels"].append(
            {
                "rows": rows,
                "requests": len(ids),
                "cache_len": size,
                "tok_s": sum(map(len, tokens)) / s,
                "step_ms_q1": _step_ms(tgt, 1),
                "step_ms_q16": _step_ms(tgt, 16),
                "tokens_sha": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            }
        )
        if a.profile:
            out["levels"][-1]["profile_q1"] = profile_step(tgt, 1)
        print(json.dumps(out["levels"][-1]), flush=True)
    return out


def profile_step(tgt, q: int, steps: int = 5, top: int = 15) -> list:
    """The kernels of one whole-batch pass (the _step_ms shapes), by device time per pass (on the
    CPU: ops by their own CPU time), to say where a many-row step goes."""
    import torch
    from round_profile import own_times  # this folder: the script's own
    from torch.profiler import ProfilerActivity, profile

    from draftling.bench.concurrency import _step_ms

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tgt.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        _step_ms(tgt, q, reps=steps)
    if tgt.device.type == "cuda":
        torch.cuda.synchronize()
    rows = own_times(prof, tgt.device.type == "cuda")[:top]
    return [{"name": name, "ms_per_pass": us / 1e3 / (steps + 3), "calls": calls} for name, us, calls in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--variant", choices=VARIANTS)  # one, in this process
    ap.add_argument("--device", default="cuda")  # cpu: a dry run
    ap.add_argument("--profile", action="store_true")  # the kernels of a 1-query pass per row count
    a = ap.parse_args()
    if a.variant:
        print("RESULT " + json.dumps(one(a)), flush=True)
        return
    runs = []
    for rep in range(a.repeats):  # interleaved: each repeat runs every variant once
        for v in a.variants.split(","):
            cmd = [sys.executable, __file__, "--target", a.target, "--out", a.out, "--rows", a.rows]
            cmd += ["--max-new", str(a.max_new), "--variant", v, "--device", a.device] + ["--profile"] * a.profile
            p = subprocess.run(cmd, capture_output=True, text=True)
            print(p.stdout[-3000:], p.stderr[-2000:] if p.returncode else "", flush=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            runs.append({"repeat": rep, **(json.loads(line[7:]) if line else {"variant": v, "error": p.returncode})})
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
