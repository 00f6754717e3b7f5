"""`draftling quickstart`: every stage on the embedded default target, in one process.

It is the same code path as the separate commands; only the config (a named YAML
profile, by default ``quickstart_cpu``) is smaller. The target is loaded once and shared.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from draftling.config import load_config, save_config
from draftling.data.prepare import check_data_dir, prepare_data
from draftling.data.sources import check_prompt_files
from draftling.draft.vocab import build_vocab_file
from draftling.engine.replies import reply_engine_for
from draftling.io import OUTPUT_MARKER, check_output_dir, write_json
from draftling.recipes.budget import BudgetPlan, plan_budget, plan_smoke

log = logging.getLogger(__name__)


def measure_and_plan(cfg, target, elapsed_s: float) -> BudgetPlan:
    """Time this machine (one training step, a plain decode) and split ``cfg.wall_minutes``."""
    from draftling.bench.simple import estimate_bench_seconds
    from draftling.train.probe import measure_step_seconds

    # A typical training row: about two thirds of the sequence cap (prompt plus reply).
    step_s = measure_step_seconds(cfg, target, seq_len=max(16, 2 * cfg.data.max_tokens // 3))
    bench = estimate_bench_seconds(cfg, target)
    plan = plan_budget(
        cfg.wall_minutes, elapsed_s, step_s, bench["per_token_s"], bench["seconds"], cfg.train.max_val_batches
    )
    log.info(
        f"budget: {cfg.wall_minutes:g} minutes; measured here: a training step {step_s:.2f} s, a decode "
        f"token {bench['per_token_s'] * 1000:.0f} ms; plan: data {plan.data_s:.0f} s, training "
        f"{plan.train_s:.0f} s, validation ~{plan.val_s:.0f} s, bench ~{plan.bench_s:.0f} s"
    )
    return plan


def _plan_smoke(cfg, target, plan: BudgetPlan, train_s: float, sequences: int) -> dict | None:
    """Turn the smoke bench on where its verdict fits the training share (recipes/budget.py
    ``plan_smoke``), unless the config already sets ``train.smoke_every``; say which."""
    from draftling.train.convergence import load_smoke_prompts

    tc = cfg.train
    if tc.smoke_every:
        return None
    prompts = load_smoke_prompts(tc.smoke_prompts, target.tokenizer, target.config.vocab_size)
    ceiling = tc.max_steps or int(tc.epochs * math.ceil(sequences / tc.batch_size))
    tc.smoke_every, smoke = plan_smoke(plan, train_s, tc, len(prompts), ceiling)
    log.info(
        f"train: smoke checks every {tc.smoke_every} steps for a convergence verdict"
        if tc.smoke_every
        else f"train: no smoke checks: {smoke['why']}"
    )
    return smoke


def _convergence(train_result: dict, cfg, smoke: dict | None) -> dict:
    """The summary's convergence entry: the run's verdict, or why no check ran."""
    plan = {"plan": {k: v for k, v in smoke.items() if k != "why"}} if smoke else {}
    if train_result.get("convergence"):
        return {**train_result["convergence"], **plan}
    why = smoke["why"] if smoke and "why" in smoke else "train.smoke_every=0 (no budget: nothing priced the checks)"
    return {"checked": False, "why": why, **plan}


def _earlier_quickstart(out: Path) -> bool:
    """A quickstart output from before the output marker: its config beside its data."""
    return (out / "config.yaml").is_file() and (out / "data").is_dir() and not (out / OUTPUT_MARKER).exists()


def _start(out: Path, config: str, overrides: list[str] | None):
    """The run's config, with its prompt files and ``out`` checked before any work; ``out`` is
    then marked as the quickstart's."""
    cfg = load_config(config, overrides)
    check_prompt_files(cfg)  # before any output or the minutes of loading and regenerating
    # The quickstart owns its --out: it replaces its own earlier run there, nothing else.
    if not _earlier_quickstart(out):
        check_output_dir(out, "quickstart", overwrite=True)
    check_output_dir(out / "export-sglang", "export", overwrite=True)
    check_data_dir(out / "data")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / OUTPUT_MARKER, {"kind": "quickstart"})
    return cfg


def _train(
    cfg, target, plan: BudgetPlan | None, t0: float, run_dir: Path, data_dir: Path, sequences: int
) -> tuple[dict, dict | None]:
    """The training stage: with a budget, its share of the minutes left and the smoke checks
    that fit it. Returns the training result and the smoke plan (None without one)."""
    from draftling.train.trainer import train

    smoke = None
    if plan:
        train_s = plan.train_seconds(time.perf_counter() - t0)
        cfg.train.max_minutes, cfg.train.fit_schedule = round(train_s / 60, 2), True
        log.info(
            f"train: {train_s:.0f} s of the budget (planned {plan.train_s:.0f} s); the LR schedule is "
            f"fitted to it from the measured step time"
        )
        smoke = _plan_smoke(cfg, target, plan, train_s, sequences)
    train_result = train(
        cfg,
        target,
        run_dir,
        data_dir / "train.jsonl",
        data_dir / "val.jsonl",
        data_dir / "vocab.safetensors",
        overwrite=True,
    )  # the quickstart owns its --out
    return train_result, smoke


def quickstart(out: str | Path, config: str = "quickstart_cpu", overrides: list[str] | None = None) -> dict:
    from draftling.bench.simple import run_bench
    from draftling.export.cli import export_draft
    from draftling.target import load_target_from_config

    t0 = time.perf_counter()
    out = Path(out)
    cfg = _start(out, config, overrides)
    timings = {}

    def stage(name):
        log.info(f"\n== {name} ==")
        timings[name] = time.perf_counter()

    def done(name):
        timings[name] = round(time.perf_counter() - timings[name], 1)

    stage("load target")
    target = load_target_from_config(cfg)
    log.info(f"target: {target.describe()}")
    done("load target")

    plan = None
    if cfg.wall_minutes > 0:
        stage("measure")
        plan = measure_and_plan(cfg, target, time.perf_counter() - t0)
        done("measure")
    save_config(cfg, out / "config.yaml")

    stage("data")
    data_dir, run_dir = out / "data", out / "run"
    data_summary = prepare_data(
        cfg, target, data_dir, regen_seconds=plan.data_s if plan else None, replies=reply_engine_for(cfg.data, target)
    )
    done("data")

    stage("vocab")
    _vocab(cfg, target, data_dir)
    done("vocab")

    stage("train")
    train_result, smoke = _train(cfg, target, plan, t0, run_dir, data_dir, data_summary["train_sequences"])
    done("train")

    stage("bench")
    # Bench prompts come from the validation split: tasks the head never trained on.
    bench = run_bench(cfg, target, run_dir / "draft", data_dir / "val.jsonl", out=out / "bench.json")
    done("bench")

    stage("export")
    # The quickstart owns its --out: a rerun replaces its own earlier export.
    export_dir = export_draft(run_dir / "draft", out / "export-sglang", "sglang", target=target, overwrite=True)
    done("export")

    summary = _summary(cfg, config, bench, train_result, data_summary, smoke, plan, export_dir, timings, t0)
    write_json(out / "summary.json", summary)
    print("\n" + "\n".join(f"{k:<20} {v}" for k, v in summary.items() if k not in ("caveats",)))
    return summary


def _vocab(cfg, target, data_dir: Path) -> None:
    """The draft vocab from the training split, written beside the data."""
    vocab = build_vocab_file(
        data_dir / "train.jsonl",
        target.config.vocab_size,
        cfg.vocab.size,
        data_dir / "vocab.safetensors",
        prompt_weight=cfg.vocab.prompt_weight,
    )
    log.info(f"vocab: {vocab.size} tokens, coverage {vocab.coverage:.1%} of loss tokens")


def _summary(
    cfg,
    config: str,
    bench: dict,
    train_result: dict,
    data_summary: dict,
    smoke: dict | None,
    plan: BudgetPlan | None,
    export_dir: Path,
    timings: dict,
    t0: float,
) -> dict:
    """summary.json: the chain-3 bench figures, validation, training, the budget and the stages."""
    chain3 = next((c for c in bench["configs"] if (c["steps"], c["topk"]) == (3, 1)), bench["configs"][0])
    val = train_result.get("val", {})
    return {
        "tau_chain3": round(chain3["tau"], 4),
        "identical_to_greedy": chain3["identical_to_greedy"],
        "speedup_chain3": round(chain3["speedup"], 4),
        "plain_tok_s": round(bench["plain_tok_s"], 2),
        "spec_tok_s": round(chain3["tok_s"], 2),
        "bench_prompts": bench["num_prompts"],
        "val_sim_tau": round(val.get("sim_tau", 0.0), 4),
        # A chain-(train.ttt_steps) decode walked over every validation sequence under teacher
        # forcing: what benching them all would measure (1.4639 against the engine's 1.4639
        # over 53 SmolLM2 sequences, lab/experiments/chain_walk.py).
        "val_chain_tau": round(val.get("chain_tau", 0.0), 4),
        "val_acc": [round(a, 4) for a in val.get("acc", [])],
        # The share of validation reply positions whose target token the draft vocab holds:
        # the ceiling on step-0 acceptance.
        "val_vocab_coverage": round(val.get("vocab_coverage", 0.0), 4),
        "train_steps": train_result["steps"],
        # The smoke bench's convergence verdict where the budget had time for its checks.
        "convergence": _convergence(train_result, cfg, smoke),
        "train_sequences": data_summary["train_sequences"],
        # Where the profile lets the CPU pick bf16 (data.regen.dtype, train.compute_dtype):
        # what it picked. The bench always runs the target in its own dtype.
        "dtypes": {
            "target": cfg.dtype,
            "regen": data_summary.get("regen_dtypes"),
            "train_compute": train_result.get("compute_dtype"),
        },
        "export_dir": str(export_dir),
        "stage_seconds": timings,
        "wall_s": round(time.perf_counter() - t0, 1),
        # What the budget planned from this machine's measurements, against what was used.
        **({"budget": _budget(cfg, plan, data_summary, train_result)} if plan else {}),
        "config": config,
        "caveats": bench["caveats"],
    }


def _budget(cfg, plan: BudgetPlan, data_summary: dict, train_result: dict) -> dict:
    return {
        "minutes": cfg.wall_minutes,
        "plan": plan.as_dict(),
        "regen": data_summary.get("regen_budget"),
        "train_max_s": round(60 * cfg.train.max_minutes, 1),
        "train_used_s": round(train_result["train_wall_s"], 1),
        "train_steps_ceiling": train_result.get("steps_ceiling"),
    }
