"""Device call: the batched engine on one GPU, all in one run (lab/gpu/serving_under_load.sh).

1. Batch-1 plain decode on the v1 prompts: today's greedy_generate and the batched engine with
   one row, on the same engine (graphs, compiled layers, matmul attention: the release bench's
   unpadded plain reference).
2. The concurrency sweep (bench/concurrency.py), 1 to 64, with the draft given.
3. Regeneration: `regenerate()` (data/regen.py) with HF generate at several batch sizes, and
   with the batched plain engine (ReplyEngine), on the same starter prompts; the identical
   fraction compares the reply texts as `draftling data` writes them.

Writes the sweep's run folder under OUT/results and adds ``regen`` and ``batch1`` to its
concurrency.json (the results contract).
"""

import argparse
import json
import time
from pathlib import Path

import torch

from draftling.bench.concurrency import RESULT, SweepOptions, run_concurrency_sweep
from draftling.bench.release import load_prompt_set
from draftling.config import DataConfig, RegenConfig
from draftling.data.prompts import load_conversations
from draftling.data.regen import regenerate
from draftling.engine import CachedTarget, EngineOptions, greedy_generate
from draftling.engine.generate import batch_generate
from draftling.engine.replies import reply_engine_for
from draftling.io import write_json
from draftling.target import load_target

STARTER = Path(__file__).resolve().parents[2] / "src" / "draftling" / "data" / "starter"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def batch1(target, n_prompts: int, max_new: int) -> dict:
    _, prompts = load_prompt_set("v1", target)
    ids = [p.input_ids for p in prompts[:n_prompts]]
    gpu = target.device.type == "cuda"
    opts = EngineOptions(cuda_graphs=gpu, compile=gpu, query_pad=0, attention="matmul" if gpu else "sdpa")
    eng = CachedTarget.from_hf(target.model, target.aux_layer_ids, max(map(len, ids)) + max_new + 16, options=opts)
    eos = target.stop_token_ids()
    x = [torch.tensor([i], device=target.device) for i in ids]
    greedy_generate(eng, x[0], 32, eos_ids=eos)  # compile and capture
    batch_generate(eng, ids[:1], 32, eos_ids=eos)
    outs, s_old = timed(lambda: [greedy_generate(eng, t, max_new, eos_ids=eos)[0].tolist() for t in x])
    res, s_new = timed(lambda: batch_generate(eng, ids, max_new, eos_ids=eos))
    tokens = sum(map(len, outs))
    return {
        "prompts": len(ids),
        "max_new_tokens": max_new,
        "engine": "graphs+compile, matmul, unpadded",
        "greedy_generate_tok_s": tokens / s_old,
        "batch_generate_1_row_tok_s": sum(len(r.tokens) for r in res) / s_new,
        "identical": [r.tokens for r in res] == outs,
    }


def regen(target, per_file: int, max_new: int, hf_batches, engine_rows: int) -> dict:
    convs = [c for f in ("chat", "code", "math") for c in load_conversations(STARTER / f"{f}.jsonl")[:per_file]]
    hf = {}
    for b in hf_batches:
        cfg = RegenConfig(max_new_tokens=max_new, batch_size=b)
        recs, s = timed(lambda: list(regenerate(target, convs, cfg, progress=False)))
        toks = sum(r["provenance"]["reply_tokens"] for r in recs)
        hf[b] = {
            "seconds": s,
            "reply_tok_s": toks / s,
            "replies_s": len(recs) / s,
            "texts": {r["id"]: r["messages"][-1]["content"] for r in recs},
        }
        print(f"HF generate batch {b}: {toks / s:.0f} reply tok/s", flush=True)
    best = max(hf, key=lambda b: hf[b]["reply_tok_s"])
    cfg = RegenConfig(max_new_tokens=max_new, batch_size=engine_rows, engine="on")
    replies = reply_engine_for(DataConfig(regen=cfg), target)  # what `draftling data` resolves
    replies(target.model)([[1, 2, 3]] * engine_rows, 8, target.stop_token_ids())  # graph capture
    recs, s = timed(lambda: list(regenerate(target, convs, cfg, progress=False, replies=replies)))
    toks = sum(r["provenance"]["reply_tokens"] for r in recs)
    same = sum(r["messages"][-1]["content"] == hf[best]["texts"][r["id"]] for r in recs) / len(recs)
    print(f"engine {engine_rows} rows: {toks / s:.0f} reply tok/s; identical to HF batch {best}: {same:.3f}")
    return {
        "prompts": len(convs),
        "prompt_source": "starter chat/code/math, first per file",
        "max_new_tokens": max_new,
        "hf_batch_sizes": {str(b): {k: v for k, v in r.items() if k != "texts"} for b, r in hf.items()},
        "hf_best_batch": best,
        "hf_generate_reply_tok_s": hf[best]["reply_tok_s"],
        "engine_rows": engine_rows,
        "engine_seconds": s,
        "engine_reply_tok_s": toks / s,
        "engine_replies_s": len(recs) / s,
        "speedup": (toks / s) / hf[best]["reply_tok_s"],
        "identical_fraction": same,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--levels", default="1,2,4,8,16,32,64")
    ap.add_argument("--regen-per-file", type=int, default=256)
    ap.add_argument("--hf-batches", default="256,768")
    ap.add_argument("--engine-rows", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch1-prompts", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    target = load_target(a.target, dtype="bfloat16" if a.device == "cuda" else "float32", device=a.device)
    b1 = batch1(target, a.batch1_prompts, a.max_new_tokens)
    print("batch1", json.dumps(b1), flush=True)
    opts = SweepOptions(
        levels=tuple(int(x) for x in a.levels.split(",")),
        out_dir=Path(a.out) / "results",
        max_new_tokens=a.max_new_tokens,
        command="python3 lab/gpu/serving_under_load.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
    )
    results = run_concurrency_sweep(target, a.draft, opts)
    results["batch1"] = b1
    results["regen"] = regen(
        target, a.regen_per_file, a.max_new_tokens, [int(b) for b in a.hf_batches.split(",")], a.engine_rows
    )
    folder = next(p for p in (Path(a.out) / "results").iterdir() if (p / RESULT).is_file())
    write_json(folder / RESULT, results)
    print(
        json.dumps(
            {k: results[k] for k in ("batch1_plain_tok_s", "best_config_per_level", "crossover_concurrency", "regen")},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
