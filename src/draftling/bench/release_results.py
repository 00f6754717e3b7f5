"""The release bench's results: the JSON contract (see bench/release.py's docstring) assembled
from what a run measured, with the cost account and the per-round phase split. ``run`` is
bench/release.py's _Run (not imported here: release.py imports this module)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from draftling import __version__
from draftling.bench.manifest import command_line, device_slug, draft_label
from draftling.bench.release_options import BASELINES
from draftling.bench.report import ROUND_PHASES, release_caveats
from draftling.bench.simple import DecodeConfig
from draftling.dtypes import dtype_name

RESULT_KEYS = (
    "date",
    "gpu",
    "engine",
    "target",
    "draft",
    "prompt_set",
    "dtype",
    "command",
    "baselines",
    "baseline_details",
    "configs",
    "sampled",
    "caveats",
)


@dataclass
class Measured:
    rows: list[dict]  # per prompt: each decode's tokens, seconds, identity, acceptance
    baseline_ids: list[str]  # the prompts the HF baselines ran on
    step_s: dict  # the target forward alone, median seconds by query count (cost account)
    context_tokens: int  # the context of those steps
    round_split: dict  # config name -> mean ms per round by phase, or None
    sampled: dict = field(default_factory=dict)  # temperature -> config -> per-workload figures


def sampled_config(run, rows: list[dict], name: str) -> dict:
    per_w = {}
    for w in run.workloads:
        rs = [r for r in rows if r["workload"] == w]
        tok_s = _tok_s(rs, name)
        per_w[w] = {
            "tau": sum(r[name]["accepted"] for r in rs) / max(1, sum(r[name]["verifies"] for r in rs)),
            "tok_s": tok_s,
            "plain_tok_s": _tok_s(rs, "plain"),
            "speedup": tok_s / _tok_s(rs, "plain"),
        }
    return {
        "per_workload": per_w,
        "mean_speedup": statistics.fmean(v["speedup"] for v in per_w.values()),
        "mean_tau": statistics.fmean(v["tau"] for v in per_w.values()),
    }


def pool_round_split(timings: list[dict]) -> dict | None:
    """Pool ``SpecStats.timing`` of several generations: mean ms per round by phase."""
    rounds = sum(t["rounds"] for t in timings)
    if not rounds:
        return None
    out = {p: sum(t[f"{p}_ms"] * t["rounds"] for t in timings) / rounds for p in ROUND_PHASES}
    out["total"] = sum(out[p] for p in ROUND_PHASES)
    out.update(rounds=rounds, prompts=len(timings))
    return out


# ----------------------------------------------------------------------------- results


def _agg(rows: list[dict], key: str) -> tuple[int, float]:
    return sum(r[key]["tokens"] for r in rows), sum(r[key]["s"] for r in rows)


def _tok_s(rows: list[dict], key: str) -> float:
    tokens, secs = _agg(rows, key)
    return tokens / secs


def assemble_results(run, m: Measured) -> dict:
    """The results dict (the JSON contract) of a run and what it measured."""
    # Speedups are against the faster plain engine: padded (the identity reference) or not.
    both = "engine_plain_unpadded" in m.rows[0]
    faster = both and _tok_s(m.rows, "engine_plain_unpadded") > _tok_s(m.rows, "engine_plain")
    ref = "engine_plain_unpadded" if faster else "engine_plain"
    base, details = _baselines(run, m, ref)
    plain_tok_s = details["engine_plain"]["per_workload_tok_s"]
    results = {
        "date": run.date,
        "gpu": device_slug(run.device),
        "engine": f"draftling {__version__}",  # the engine that measured every speed here
        "target": run.target.spec.label,
        "draft": draft_label(run.draft_path),
        "prompt_set": run.info,
        "dtype": dtype_name(run.dtype),
        "command": run.opts.command if run.opts.command is not None else command_line(),
        "baselines": base,
        "baseline_details": details,
        "configs": [_config_results(run, m, c, ref, plain_tok_s) for c in run.configs],
        "sampled": m.sampled,
        "caveats": [],
    }
    results["caveats"] = release_caveats(results, run.device, run.opts.baselines)
    assert tuple(results) == RESULT_KEYS
    return results


def _baselines(run, m: Measured, ref: str) -> tuple[dict, dict]:
    """tok/s and details per baseline; None for those not run."""
    rows, cap = m.rows, run.opts.max_new_tokens
    base, details = dict.fromkeys(BASELINES), dict.fromkeys(BASELINES)
    tokens, secs = _agg(rows, ref)
    plain = details["engine_plain"] = {
        "n": len(rows),
        "tokens": tokens,
        "seconds": secs,
        "natural_stops": sum(r[ref]["natural_stop"] for r in rows),
        "max_new_tokens": cap,
        "cuda_graphs": run.engine["cuda_graphs"],
        "engine": run.engine,
        "speedup_reference": ref,
        "per_workload_tok_s": {w: _tok_s([r for r in rows if r["workload"] == w], ref) for w in run.workloads},
    }
    if "engine_plain_unpadded" in rows[0]:
        plain.update(
            padded_tok_s=_tok_s(rows, "engine_plain"),
            unpadded_tok_s=_tok_s(rows, "engine_plain_unpadded"),
            unpadded_identical_to_padded=sum(r["engine_plain_unpadded"]["identical"] for r in rows) / len(rows),
        )
    base["engine_plain"] = plain["tokens"] / plain["seconds"]
    ids = set(m.baseline_ids)
    sub = [r for r in rows if r["id"] in ids]
    for name in run.opts.hf_runs:
        tokens, secs = _agg(sub, name)
        base[name] = tokens / secs
        details[name] = {
            "n": len(sub),
            "prompts_per_workload": run.opts.baseline_prompts_per_workload,
            "tokens": tokens,
            "seconds": secs,
            "natural_stops": sum(r[name]["natural_stop"] for r in sub),
            "max_new_tokens": cap,
            "identical_to_engine_plain": sum(r[name]["identical"] for r in sub) / len(sub),
            "engine_plain_tok_s_same_prompts": _tok_s(sub, ref),
            "prompt_ids": [r["id"] for r in sub],
        }
    return base, details


def _config_results(run, m: Measured, c: DecodeConfig, ref: str, plain_tok_s: dict) -> dict:
    rows, name = m.rows, c.name
    per_w = {}
    for w in run.workloads:
        rs = [r for r in rows if r["workload"] == w]
        tok_s = _tok_s(rs, name)
        per_w[w] = {
            "tau": sum(r[name]["accepted"] for r in rs) / max(1, sum(r[name]["verifies"] for r in rs)),
            "tok_s": tok_s,
            "speedup": tok_s / plain_tok_s[w],
        }
    verifies = sum(r[name]["verifies"] for r in rows)
    counts = [sum(r[name]["accept_counts"][d] for r in rows) for d in range(c.steps)]
    mean_speedup = statistics.fmean(v["speedup"] for v in per_w.values())
    mean_tau = statistics.fmean(v["tau"] for v in per_w.values())
    t1 = m.step_s["1_unpadded"] if ref == "engine_plain_unpadded" else m.step_s[1]
    tq = m.step_s[c.draft_tokens]
    # A drafter that cost nothing would leave one verify pass per round: tau tokens for the
    # price of tq, against t1 per token for plain decoding. Everything the measured speedup
    # loses against that (draft passes, tree building, acceptance, KV compaction, Python
    # overhead) is counted as the drafting share.
    free = mean_tau * t1 / tq
    return {
        "name": name,
        "steps": c.steps,
        "topk": c.topk,
        "draft_tokens": c.draft_tokens,
        "per_workload": per_w,
        "mean_speedup": mean_speedup,
        "mean_tau": mean_tau,
        "identical_fraction": sum(r[name]["identical"] for r in rows) / len(rows),
        "accept_rate_by_depth": [n / max(1, verifies) for n in counts],
        "cost": {
            "free_speedup": free,
            "drafting_share": 1.0 - mean_speedup / free,
            "verify_q": c.draft_tokens,
            "plain_step_ms": t1 * 1e3,
            "verify_step_ms": tq * 1e3,
            "round_ms": sum(r[name]["s"] for r in rows) / max(1, verifies) * 1e3,
            "context_tokens": m.context_tokens,
        },
        "round_split_ms": m.round_split.get(name),
    }
