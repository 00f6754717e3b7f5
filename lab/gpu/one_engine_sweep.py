"""Device call: one decode engine at every load (lab/gpu/one_engine_sweep.sh), all in one run.

1. Batch 1, the same engine settings as the sweep (graphs, compiled layers, the sweep's
   attention, unpadded): the batch-1 loop as it stood before (lab/gpu/batch1_before.py) and
   the one engine with one row (engine/generate.py), plain greedy on the first N v1 prompts,
   REPEATS times each, interleaved; medians, and whether the tokens agree.
2. The concurrency sweep (bench/concurrency.py) 1 to 64 with the draft given: plain, each
   config and the adaptive engine per level.
3. Regeneration through the engine against HF generate, as lab/gpu/serving_under_load.py does.

Writes the sweep's run folder under OUT/results and adds ``batch1`` (section 1),
``batch1_engine_tok_s_before`` and ``regen`` to its concurrency.json; the sweep itself writes
``concurrency_sweep``, ``batch1_plain_tok_s`` (its level 1 plain: the one engine at one row)
and ``adaptive_min_speedup``.
"""

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import batch1_before  # noqa: E402
from serving_under_load import regen  # noqa: E402

from draftling.bench.concurrency import RESULT, SweepOptions, run_concurrency_sweep  # noqa: E402
from draftling.bench.release import load_prompt_set  # noqa: E402
from draftling.config import AUTO  # noqa: E402
from draftling.engine import CachedTarget, greedy_generate  # noqa: E402
from draftling.io import write_json  # noqa: E402
from draftling.target import load_target  # noqa: E402
from draftling.timing import timed  # noqa: E402


def batch1(target, options: SweepOptions, n_prompts: int, max_new: int, repeats: int) -> dict:
    _, prompts = load_prompt_set("v1", target)
    ids = [torch.tensor([p.input_ids], device=target.device) for p in prompts[:n_prompts]]
    engine = options.engine.resolve(target.device, 0)
    size = max(x.shape[1] for x in ids) + max_new + 16
    eng = CachedTarget.from_hf(target.model, target.aux_layer_ids, size, options=engine)
    eos = target.stop_token_ids()
    loops = {"before": batch1_before.greedy_generate, "one_engine": greedy_generate}
    for fn in loops.values():  # compile and capture
        fn(eng, ids[0], 32, eos_ids=eos)
    runs: dict = {name: [] for name in loops}
    tokens: dict = {}
    for _ in range(repeats):
        for name, fn in loops.items():
            outs, s = timed(lambda fn=fn: [fn(eng, x, max_new, eos_ids=eos)[0].tolist() for x in ids], target.device)
            tokens[name] = outs
            runs[name].append(sum(map(len, outs)) / s)
    med = {name: statistics.median(v) for name, v in runs.items()}
    return {
        "prompts": len(ids),
        "max_new_tokens": max_new,
        "repeats": repeats,
        "engine": str(engine),
        "tok_s_runs": runs,
        "before_tok_s": med["before"],
        "one_engine_tok_s": med["one_engine"],
        "ratio": med["one_engine"] / med["before"],
        "identical": tokens["before"] == tokens["one_engine"],
    }


def goals(results: dict) -> dict:
    sweep = results["concurrency_sweep"]
    plain64 = next((r["aggregate_tok_s"] for r in sweep if r["concurrency"] == 64 and r["config"] == "plain"), None)
    low = [r["speedup"] for r in sweep if r["config"] == "adaptive" and r["concurrency"] <= 4]
    return {
        "one_engine_over_before_at_1_row": results["batch1"]["ratio"],
        "goal_ratio": 0.95,
        "plain_aggregate_at_64": plain64,
        "goal_plain_aggregate_at_64": 15000,
        "adaptive_min_speedup": results["adaptive_min_speedup"],
        "goal_adaptive_min_speedup": 1.0,
        "adaptive_min_full_batch_speedup": results.get("adaptive_min_full_batch_speedup"),  # no drain; not a goal
        "adaptive_min_speedup_at_1_to_4": min(low) if low else None,
        "goal_adaptive_at_1_to_4": 1.3,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--levels", default="1,2,4,8,16,32,64")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch1-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--regen-per-file", type=int, default=128)
    ap.add_argument("--hf-batches", default="768")
    ap.add_argument("--engine-rows", type=int, default=256)
    ap.add_argument("--skip-regen", action="store_true")
    ap.add_argument("--per-slot", type=int, default=SweepOptions.per_slot, help="requests per row at each level")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill-graphs", action="store_true", help="admissions' prefills padded and graphed")
    a = ap.parse_args()
    target = load_target(a.target, dtype="bfloat16" if a.device == "cuda" else "float32", device=a.device)
    opts = SweepOptions(
        levels=tuple(int(x) for x in a.levels.split(",")),
        out_dir=Path(a.out) / "results",
        max_new_tokens=a.max_new_tokens,
        per_slot=a.per_slot,
        engine=dataclasses.replace(SweepOptions().engine, prefill_graphs=a.prefill_graphs or AUTO),
        command="python3 lab/gpu/one_engine_sweep.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
    )
    b1 = batch1(target, opts, a.batch1_prompts, a.max_new_tokens, a.repeats)
    print("batch1", json.dumps(b1), flush=True)
    results = run_concurrency_sweep(target, a.draft, opts)
    results["batch1"] = b1
    results["batch1_engine_tok_s_before"] = b1["before_tok_s"]
    if not a.skip_regen:
        hf = [int(b) for b in a.hf_batches.split(",")]
        results["regen"] = regen(target, a.regen_per_file, a.max_new_tokens, hf, a.engine_rows)
    results["goals"] = goals(results)
    folder = next(p for p in (Path(a.out) / "results").iterdir() if (p / RESULT).is_file())
    write_json(folder / RESULT, results)
    print(json.dumps({"goals": results["goals"], "best": results["best_config_per_level"]}, indent=1))


if __name__ == "__main__":
    main()
