"""`draftling plan`: the memory estimate of train/memory.py and train/memory_fit.py for a run, without weights."""

from __future__ import annotations

import argparse

from draftling.cli.common import add_device_map_flag, add_key_flag, run_config
from draftling.errors import ConfigError


def add_parser(sub) -> argparse.ArgumentParser:
    """`draftling plan`: the memory estimate of train/memory.py and train/memory_fit.py for a run, without weights."""
    p = sub.add_parser(
        "plan",
        help="will a training run fit on this GPU? (reads only the target's config)",
        description="Estimate the peak GPU memory of `draftling train` from the target's config and "
        "the run config, without loading weights: teacher weights, draft params, grads and optimizer "
        "state, the teacher's outputs, activations and the largest transient. Prints a table and a "
        "verdict; exit code 0 if it fits, 1 if not. The memory options are resolved as the trainer "
        "resolves them on CUDA (train.optimizer_offload, train.grad_checkpoint, train.attention, "
        "train.loss_chunk_tokens, train.compile, train.embedding_on_host, train.draft_dtype). The "
        "estimate is for one process; under torchrun every rank holds its own teacher, so pass the "
        "per-rank share of the batch as --batch-size.",
        epilog="Config overrides: trailing KEY=VALUE pairs, e.g. train.batch_size=4 "
        "train.optimizer_offload=false vocab.size=16000.",
    )
    add_key_flag(p, "target")
    add_device_map_flag(p)
    p.add_argument(
        "--gpu-mem",
        required=True,
        metavar="SIZE",
        help="memory of one GPU, e.g. 80GiB, 24GB, 141 (a bare number is GiB)",
    )
    p.add_argument("--config", default=None, help="YAML config file or built-in name")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    # Not extract's --batch-size (config extract.batch_size): a dest of its own.
    p.add_argument(
        "--batch-size",
        dest="step_batch",
        type=int,
        default=None,
        metavar="N",
        help="sequences per step (default: train.batch_size)",
    )
    add_key_flag(p, "dtype")
    p.add_argument(
        "--offline",
        action="store_true",
        help="plan for `train --offline` (no teacher forward; the target is still loaded)",
    )
    p.add_argument(
        "--teacher-bits",
        type=float,
        default=None,
        metavar="BITS",
        help="bits per teacher decoder weight, e.g. 4.5 for a 4-bit quantized teacher "
        "(default: the dtype, or the config's quantization)",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    return p


def cmd_plan(args) -> int:
    """`draftling plan`: prints the table and verdict; returns 0 if it fits, 1 if not."""
    from draftling.cli.plan_text import format_plan
    from draftling.config import parse_size
    from draftling.target.load import load_target_config
    from draftling.train.memory_fit import largest_fitting_batch, plan_run

    cfg = run_config(args, ("target", "dtype", "device_map"))
    try:
        gpu_bytes = parse_size(args.gpu_mem)
    except ValueError as e:
        raise ConfigError(f"--gpu-mem: {e}") from None
    if args.seq < 1 or (args.step_batch is not None and args.step_batch < 1):
        raise ConfigError("--seq and --batch-size must be positive")
    batch = args.step_batch or cfg.train.batch_size
    target_config = load_target_config(cfg.target)
    try:
        plan = plan_run(
            cfg, target_config, gpu_bytes, args.seq, batch, offline=args.offline, teacher_bits=args.teacher_bits
        )
        max_batch = largest_fitting_batch(cfg, target_config, gpu_bytes, args.seq, args.offline, args.teacher_bits)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(format_plan(plan, cfg.target, max_batch), flush=True)
    return 0 if plan["fits"] else 1


run = cmd_plan  # the name every command module has; cmd_plan keeps its own for the plan rework's merge
