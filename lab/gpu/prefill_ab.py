"""Device script: admissions' prefill eager, compiled for any shape (EngineOptions.compile_prefill)
and padded and graphed (EngineOptions.prefill_graphs), per row count, in one process on one
engine per level.

1. The prefill alone: target ``prefill_rows`` and the draft's ``extend_rows`` for g of the
   level's v1 prompts at once, each way, median ms of 5 after 2 warm-ups, and the fixed part
   ``Admissions`` would weigh from them (its line's intercept, clamped as it does).
2. End to end, the sweep's requests and engine (lab/gpu/admissions_ab.py's ``runs_for``):
   plain, each fixed config and the adaptive engine, under three variants interleaved over
   ``--repeats``: eager prefill with deferred admissions (the engine's default), graphed with
   deferral, graphed admitting at once. Median tok/s, each config's speedup over plain in
   the same variant, prefills per run, and whether the tokens equal the first variant's.

    python3 lab/gpu/prefill_ab.py --target T --draft D --out FILE [--levels 16,64] [--repeats 2] [--prefill-only]
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from admissions_ab import parser, runs_for, setup  # noqa: E402

from draftling.bench.concurrency import SweepOptions, level_engine  # noqa: E402
from draftling.engine.generate import Admissions  # noqa: E402
from draftling.io import write_json  # noqa: E402
from draftling.timing import timed  # noqa: E402

MODES = ("eager", "compiled", "graphed")
VARIANTS = {"eager_defer": ("eager", True), "graphed_defer": ("graphed", True), "graphed_at_once": ("graphed", False)}


def set_prefill(tgt, runner, mode: str) -> None:
    """An admission's prefill "eager", "compiled" (compile_prefill) or "graphed" (prefill_graphs)."""
    compiled, graphed = mode == "compiled", mode == "graphed"
    tgt.options = dataclasses.replace(tgt.options, compile_prefill=compiled, prefill_graphs=graphed)
    runner.compile_prefill, runner.prefill_graphs = compiled, graphed


def prefill_ms(tgt, runner, ids, g: int) -> float:
    ps = [torch.as_tensor(p, device=tgt.device) for p in ids[:g]]
    x = pad_sequence(ps, batch_first=True)
    lengths = torch.tensor([len(p) for p in ps], device=tgt.device)
    rows = torch.arange(g, device=tgt.device)

    def once():
        _, aux = tgt.prefill_rows(rows, x, lengths)
        runner.extend_rows(rows, x, aux, lengths)

    for _ in range(2):
        once()
    return statistics.median(timed(once, tgt.device)[1] * 1e3 for _ in range(5))


def prefill_costs(tgt, runner, ids) -> dict:
    sizes = [g for g in (1, 2, 4, 8, 16, 32, 64) if g <= tgt.batch_size]
    out = {}
    for name in MODES:
        set_prefill(tgt, runner, name)
        fit = Admissions()
        for g in sizes:
            fit.record(g, prefill_ms(tgt, runner, ids, g))
        out[name] = {"ms_by_prompts": dict(fit.history), "fixed_ms": fit.fixed_ms()}
    return out


def level(target, draft, configs, prompts, rows: int, max_new: int, repeats: int, opts: SweepOptions, e2e=True):
    ids = [prompts[i % len(prompts)].input_ids for i in range(opts.requests(rows))]
    tgt, runner = level_engine(target, draft, ids, configs, max_new, opts.engine.resolve(target.device, 0), rows)
    costs = prefill_costs(tgt, runner, ids)
    if not e2e:
        return {"rows": rows, "prefill_ms": costs}
    fns, short = runs_for(tgt, runner, ids, configs, max_new), runs_for(tgt, runner, ids[:rows], configs, 4)
    for mode, defer in VARIANTS.values():  # capture and compile every shape first
        set_prefill(tgt, runner, mode)
        for name in fns:
            short[name](defer)
    tok_s: dict = {(n, v): [] for n in fns for v in VARIANTS}
    prefills, tokens = {}, {}
    for _ in range(repeats):
        for name, fn in fns.items():
            for v, (mode, defer) in VARIANTS.items():
                set_prefill(tgt, runner, mode)
                out, s = timed(lambda fn=fn, defer=defer: fn(defer), target.device)
                tok_s[(name, v)].append(sum(len(r.tokens) for r in out) / s)
                prefills[(name, v)], tokens[(name, v)] = out[0].stats.usage["prefills"], [r.tokens for r in out]
    med = {k: statistics.median(x) for k, x in tok_s.items()}
    first = next(iter(VARIANTS))
    configs_out = [
        {
            "config": name,
            **{f"{v}_tok_s": med[(name, v)] for v in VARIANTS},
            **{f"speedup_{v}": med[(name, v)] / med[("plain", v)] for v in VARIANTS},
            **{f"{v}_over_{first}": med[(name, v)] / med[(name, first)] for v in VARIANTS if v != first},
            "prefills": {v: prefills[(name, v)] for v in VARIANTS},
            "tok_s_runs": {v: tok_s[(name, v)] for v in VARIANTS},
            "same_tokens_as_first": {v: tokens[(name, v)] == tokens[(name, first)] for v in VARIANTS},
        }
        for name in fns
    ]
    del tgt, runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"rows": rows, "requests": len(ids), "prefill_ms": costs, "configs": configs_out}


def main():
    ap = parser(__doc__, "16,64")
    ap.add_argument("--prefill-only", action="store_true", help="section 1 alone (no decode compiles)")
    a = ap.parse_args()
    target, draft, opts, configs, prompts = setup(a)
    results = {
        "command": "python3 lab/gpu/prefill_ab.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
        "variants": {v: {"prefill": m, "defer_admissions": d} for v, (m, d) in VARIANTS.items()},
        "levels": [],
    }
    for rows in (int(x) for x in a.levels.split(",")):
        args = (target, draft, configs, prompts, rows, a.max_new_tokens, a.repeats, opts, not a.prefill_only)
        results["levels"].append(level(*args))
        print(json.dumps(results["levels"][-1]), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, results)


if __name__ == "__main__":
    main()
