"""Device script: deferred admissions (engine/generate.py ``Admissions``) against admitting as
soon as a row frees, per row count, in one process on one engine per level.

Per level: plain, each fixed config and the adaptive engine, each with ``defer_admissions``
on and off, interleaved over ``--repeats``, on the sweep's requests (max(16, per-slot x rows) v1
prompts, per-slot 2 by default, 256 new tokens, greedy) and its engine (graphs, compiled, unpadded, "auto"
attention). Reports the median tok/s of each, the ratio on/off, each config's speedup over
plain with deferral on and off, the prefills each run made, and whether the tokens agree.

    python3 lab/gpu/admissions_ab.py --target T --draft D --out FILE [--levels 8,16,32,64] [--repeats 2]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from draftling.bench.concurrency import SweepOptions, level_engine
from draftling.bench.release import load_prompt_set
from draftling.bench.simple import decode_configs
from draftling.engine import generate as gen
from draftling.engine.adaptive import AdaptivePolicy
from draftling.export.formats import load_any_draft
from draftling.io import write_json
from draftling.target import load_target
from draftling.timing import timed


def runs_for(tgt, runner, ids, configs, max_new):
    """name -> a function of ``defer`` that decodes the level's requests."""
    out = {"plain": lambda defer: gen.batch_generate(tgt, ids, max_new, defer_admissions=defer)}
    for c in configs:
        tree = (c.steps, c.topk, c.draft_tokens)
        out[c.name] = lambda defer, tree=tree: gen.batch_generate(
            tgt, ids, max_new, draft=runner, tree=tree, defer_admissions=defer
        )
    trees = tuple((c.steps, c.topk, c.draft_tokens) for c in configs)
    out["adaptive"] = lambda defer: gen.batch_generate(
        tgt, ids, max_new, draft=runner, adaptive=AdaptivePolicy(trees), defer_admissions=defer
    )
    return out


def level(target, draft, configs, prompts, rows: int, max_new: int, repeats: int, opts: SweepOptions) -> dict:
    ids = [prompts[i % len(prompts)].input_ids for i in range(opts.requests(rows))]
    tgt, runner = level_engine(target, draft, ids, configs, max_new, opts.engine.resolve(target.device, 0), rows)
    fns = runs_for(tgt, runner, ids, configs, max_new)
    short = runs_for(tgt, runner, ids[:rows], configs, 4)
    for name in fns:  # capture and compile every shape first
        short[name](True)
    tok_s: dict = {(n, d): [] for n in fns for d in (True, False)}
    prefills, tokens = {}, {}
    for _ in range(repeats):
        for name, fn in fns.items():
            for defer in (True, False):
                out, s = timed(lambda fn=fn, defer=defer: fn(defer), target.device)
                tok_s[(name, defer)].append(sum(len(r.tokens) for r in out) / s)
                prefills[(name, defer)] = out[0].stats.usage["prefills"]
                tokens[(name, defer)] = [r.tokens for r in out]
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    plain_on, plain_off = med[("plain", True)], med[("plain", False)]
    rows_out = [
        {
            "config": name,
            "deferred_tok_s": med[(name, True)],
            "at_once_tok_s": med[(name, False)],
            "deferred_over_at_once": med[(name, True)] / med[(name, False)],
            "speedup_deferred": med[(name, True)] / plain_on,
            "speedup_at_once": med[(name, False)] / plain_off,
            "prefills_deferred": prefills[(name, True)],
            "prefills_at_once": prefills[(name, False)],
            "tok_s_runs": {"deferred": tok_s[(name, True)], "at_once": tok_s[(name, False)]},
            "same_tokens": tokens[(name, True)] == tokens[(name, False)],
        }
        for name in fns
    ]
    del tgt, runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"rows": rows, "requests": len(ids), "configs": rows_out}


def parser(doc: str, levels: str) -> argparse.ArgumentParser:
    """The arguments this A/B and lab/gpu/prefill_ab.py share."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for name in ("--target", "--draft", "--out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--levels", default=levels)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--per-slot", type=int, default=SweepOptions.per_slot, help="requests per row at each level")
    return ap


def setup(a):
    """(target, draft, the sweep's options and configs, the v1 prompts) for parsed arguments ``a``."""
    target = load_target(a.target, dtype="bfloat16" if a.device == "cuda" else "float32", device=a.device)
    draft = load_any_draft(a.draft, target.device, next(target.model.parameters()).dtype)
    opts = SweepOptions(per_slot=a.per_slot)
    _, prompts = load_prompt_set("v1", target)
    return target, draft, opts, decode_configs(draft, opts.configs), prompts


def main():
    a = parser(__doc__, "8,16,32,64").parse_args()
    target, draft, opts, configs, prompts = setup(a)
    results = {
        "command": "python3 lab/gpu/admissions_ab.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
        "levels": [],
    }
    for rows in (int(x) for x in a.levels.split(",")):
        results["levels"].append(level(target, draft, configs, prompts, rows, a.max_new_tokens, a.repeats, opts))
        print(json.dumps(results["levels"][-1]), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, results)


if __name__ == "__main__":
    main()
