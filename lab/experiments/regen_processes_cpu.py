"""Regeneration on a 2-core CPU: one process with 2 threads against two processes with one
thread each, on the same prompts (the quickstart profile's settings, batch 64).

    python lab/experiments/regen_processes_cpu.py OUT.json [N_PROMPTS]

Each mode regenerates the same N prompts (default 128: the first N/4 of each quickstart file,
sorted by length as the data stage does, then split in halves for the two processes).
Writes wall times, reply tokens and whether both modes produced the same replies.
"""

import json
import multiprocessing as mp
import os
import platform
import sys
import time


def load(n):
    from draftling.config import load_config
    from draftling.data.prompts import load_conversations
    from draftling.data.sources import find_shared_prompts

    cfg = load_config("quickstart_cpu", [])
    root = find_shared_prompts()
    convs = []
    for spec in cfg.data.prompts:
        convs += load_conversations(root / spec.split(":", 1)[1])[: n // len(cfg.data.prompts)]
    return cfg, convs


def regen(convs, threads, out_q=None):
    import torch

    torch.set_num_threads(threads)
    from draftling.config import load_config
    from draftling.data.regen import regenerate
    from draftling.target import load_target

    cfg = load_config("quickstart_cpu", [])
    t = load_target(cfg.target, dtype=cfg.dtype, device="cpu", aux_layer_ids=cfg.aux_layer_ids)
    t0 = time.perf_counter()
    rows = list(regenerate(t, convs, cfg.data.regen, max_prompt_tokens=288, progress=False))
    result = {
        "s": time.perf_counter() - t0,
        "replies": [r["messages"][-1]["content"] for r in rows],
        "reply_tokens": sum(r["provenance"]["reply_tokens"] for r in rows),
    }
    if out_q is None:
        return result
    out_q.put(result)


def main():
    out, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128
    _, convs = load(n)
    convs.sort(key=lambda c: len(json.dumps(c.messages)))  # roughly the data stage's length order
    t0 = time.perf_counter()
    one = regen(convs, 2)
    one_wall = time.perf_counter() - t0
    halves = [convs[0::2], convs[1::2]]  # both halves get short and long prompts alike
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=regen, args=(h, 1, q)) for h in halves]
    for p in procs:
        p.start()
    parts = [q.get() for _ in procs]
    for p in procs:
        p.join()
    two_wall = time.perf_counter() - t0
    res = {
        "what": "regeneration of the same prompts: 1 process x 2 threads vs 2 processes x 1 thread",
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "prompts": len(convs),
        "batch_size": 64,
        "max_new_tokens": 96,
        "one_process": {
            "wall_s": round(one_wall, 1),
            "regen_s": round(one["s"], 1),
            "reply_tokens": one["reply_tokens"],
            "reply_tok_s": round(one["reply_tokens"] / one["s"], 1),
        },
        "two_processes": {
            "wall_s": round(two_wall, 1),
            "regen_s": [round(p["s"], 1) for p in parts],
            "reply_tokens": sum(p["reply_tokens"] for p in parts),
            "reply_tok_s": round(sum(p["reply_tokens"] for p in parts) / max(p["s"] for p in parts), 1),
        },
        "note": "wall_s includes loading the target (once per process); a half's batches differ "
        "from the single process's, so replies may differ where padding changes numerics",
    }
    print(json.dumps(res, indent=1))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
