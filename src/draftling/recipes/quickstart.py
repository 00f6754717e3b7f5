"""`draftling quickstart`: every stage on the embedded default target, in one process.

It is the same code path as the separate commands; only the config (a named YAML
profile, by default ``quickstart_cpu``) is smaller. The target is loaded once and shared.
"""

from __future__ import annotations

import time
from pathlib import Path

from draftling.config import check_prompt_files, load_config, save_config
from draftling.data.prepare import prepare_data
from draftling.draft.vocab import build_vocab_file
from draftling.errors import ConfigError
from draftling.io import write_json


# Kept back from training for the bench (8 prompts, plain and chain-3, 96 tokens each) and
# the export: about 70 s on the fourth session's 2-core machine, 200 s on the fifth's.
BENCH_RESERVE_MINUTES = 3.5


def training_budget_minutes(cfg, elapsed_s: float) -> float:
    """Minutes training may take so that the whole run fits ``cfg.wall_minutes``: what is
    left after ``elapsed_s`` and the bench's reserve, and never more than train.max_minutes."""
    left = cfg.wall_minutes - elapsed_s / 60 - BENCH_RESERVE_MINUTES
    if left <= 0:
        raise ConfigError(f"wall_minutes={cfg.wall_minutes:g}: {elapsed_s / 60:.1f} minutes went to loading "
                          f"and data, which leaves no time to train (reduce data.max_prompts_per_file)")
    cap = cfg.train.max_minutes
    return min(left, cap) if cap > 0 else left


def quickstart(out: str | Path, config: str = "quickstart_cpu", overrides: list[str] | None = None) -> dict:
    from draftling.bench.simple import run_bench
    from draftling.cli import resolve_device
    from draftling.export.cli import export_draft
    from draftling.target import load_target
    from draftling.train.trainer import train

    t0 = time.perf_counter()
    out = Path(out)
    cfg = load_config(config, overrides)
    check_prompt_files(cfg)  # before any output or the minutes of loading and regenerating
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    timings = {}

    def stage(name):
        print(f"\n== {name} ==", flush=True)
        timings[name] = time.perf_counter()

    def done(name):
        timings[name] = round(time.perf_counter() - timings[name], 1)

    stage("load target")
    target = load_target(cfg.target, dtype=cfg.dtype, device=resolve_device(cfg.device),
                         aux_layer_ids=cfg.aux_layer_ids, chat_template=cfg.chat_template,
                         quantization=cfg.quantization)
    print(f"target: {target.describe()}", flush=True)
    done("load target")

    stage("data")
    data_dir = out / "data"
    data_summary = prepare_data(cfg, target, data_dir)
    done("data")

    stage("vocab")
    vocab = build_vocab_file(data_dir / "train.jsonl", target.config.vocab_size, cfg.vocab.size,
                             data_dir / "vocab.safetensors", prompt_weight=cfg.vocab.prompt_weight)
    print(f"vocab: {vocab.size} tokens, coverage {vocab.coverage:.1%} of loss tokens", flush=True)
    done("vocab")

    stage("train")
    run_dir = out / "run"
    if cfg.wall_minutes > 0:
        cfg.train.max_minutes = round(training_budget_minutes(cfg, time.perf_counter() - t0), 2)
        print(f"train: {cfg.train.max_minutes:.2f} minutes of the {cfg.wall_minutes:g}-minute budget "
              f"(bench and export keep {BENCH_RESERVE_MINUTES:g})", flush=True)
    train_result = train(cfg, target, run_dir, data_dir / "train.jsonl", data_dir / "val.jsonl",
                         data_dir / "vocab.safetensors")
    done("train")

    stage("bench")
    # Bench prompts come from the validation split: tasks the head never trained on.
    bench = run_bench(cfg, target, run_dir / "draft", data_dir / "val.jsonl", out=out / "bench.json")
    done("bench")

    stage("export")
    export_dir = export_draft(run_dir / "draft", out / "export-sglang", "sglang", target=target)
    done("export")

    chain3 = next((c for c in bench["configs"] if (c["steps"], c["topk"]) == (3, 1)), bench["configs"][0])
    val = train_result.get("val", {})
    summary = {
        "tau_chain3": round(chain3["tau"], 4),
        "identical_to_greedy": chain3["identical_to_greedy"],
        "speedup_chain3": round(chain3["speedup"], 4),
        "plain_tok_s": round(bench["plain_tok_s"], 2),
        "spec_tok_s": round(chain3["tok_s"], 2),
        "bench_prompts": bench["num_prompts"],
        "val_sim_tau": round(val.get("sim_tau", 0.0), 4),
        # A chain-(train.ttt_steps) decode walked over every validation sequence under teacher
        # forcing: what benching them all would measure (1.4639 against the engine's 1.4639
        # over 53 SmolLM2 sequences, scripts/experiments/chain_walk.py).
        "val_chain_tau": round(val.get("chain_tau", 0.0), 4),
        "val_acc": [round(a, 4) for a in val.get("acc", [])],
        # The share of validation reply positions whose target token the draft vocab holds:
        # the ceiling on step-0 acceptance.
        "val_vocab_coverage": round(val.get("vocab_coverage", 0.0), 4),
        "train_steps": train_result["steps"],
        "train_sequences": data_summary["train_sequences"],
        # Where the profile lets the CPU pick bf16 (data.regen.dtype, train.compute_dtype):
        # what it picked. The bench always runs the target in its own dtype.
        "dtypes": {"target": cfg.dtype, "regen": data_summary.get("regen_dtypes"),
                   "train_compute": train_result.get("compute_dtype")},
        "export_dir": str(export_dir),
        "stage_seconds": timings,
        "wall_s": round(time.perf_counter() - t0, 1),
        "config": config,
        "caveats": bench["caveats"],
    }
    write_json(out / "summary.json", summary)
    print("\n" + "\n".join(f"{k:<20} {v}" for k, v in summary.items() if k not in ("caveats",)))
    return summary
