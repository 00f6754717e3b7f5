"""`draftling select`: the checkpoint to ship, by served speed."""

from __future__ import annotations

from pathlib import Path

from draftling.cli.common import EPILOG_OVERRIDES, add_common, run_config
from draftling.errors import DraftlingError


def add_parser(sub) -> None:
    """`draftling select`: the checkpoint to ship, by served speed."""
    p = sub.add_parser(
        "select",
        help="pick the checkpoint to ship by served speed on held-out prompts",
        description="Shortlist a run's checkpoints by validation loss (scored afresh on DATA's "
        "val.jsonl), decode held-out, task-disjoint prompts with each through the batched engine "
        "at --concurrency, and pick the fastest by measured tok/s (tau and identity with plain "
        "greedy shown). Writes selection.json and selection.md (default RUN_DIR/selection/). "
        "Keep candidates with train.keep_checkpoints=0, train.ckpt_every_epoch or "
        "train.keep_every_steps.",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (its checkpoints/ and config.yaml)")
    p.add_argument("--data", required=True, help="the run's data directory (its val.jsonl scores the loss)")
    # select's own options, not the config keys of the same flag names: dests of their own.
    p.add_argument(
        "--prompts",
        dest="select_prompts",
        metavar="PROMPTS",
        required=True,
        help="held-out prompts: a prompt-set name or jsonl (ids or messages)",
    )
    p.add_argument(
        "--concurrency",
        dest="select_concurrency",
        metavar="CONCURRENCY",
        type=int,
        default=1,
        help="requests decoded at once (default 1)",
    )
    p.add_argument(
        "--decode-config", default="tree-3-4-8", help="decode config steps-topk-draft_tokens (default tree-3-4-8)"
    )
    p.add_argument("--shortlist", type=int, default=3, help="how many lowest-loss checkpoints to measure (default 3)")
    p.add_argument(
        "--max-new-tokens",
        dest="select_new_tokens",
        metavar="MAX_NEW_TOKENS",
        type=int,
        default=128,
        help="tokens per completion (default 128)",
    )
    p.add_argument(
        "--base",
        metavar="DIR",
        help="also measure this base head on the same prompts (the adaptation report: base against the winner)",
    )
    p.add_argument("--out", help="the report's folder (default RUN_DIR/selection)")


def run(args) -> None:
    from draftling.bench.select import SelectOptions, select_checkpoint
    from draftling.target import load_target_from_config

    if args.select_concurrency < 1 or args.shortlist < 1 or args.select_new_tokens < 1:
        raise DraftlingError("select: --concurrency, --shortlist and --max-new-tokens must be >= 1")
    if not (Path(args.run_dir) / "config.yaml").is_file():
        raise DraftlingError(f"{args.run_dir}: not a training run directory (no config.yaml)")
    if not (Path(args.data) / "val.jsonl").is_file():
        raise DraftlingError(f"--data {args.data}: no val.jsonl to score the loss on")
    cfg = run_config(args)
    opts = SelectOptions(
        prompts=args.select_prompts,
        data=args.data,
        shortlist=args.shortlist,
        config=args.decode_config,
        concurrency=args.select_concurrency,
        max_new_tokens=args.select_new_tokens,
        base=args.base,
        out=args.out,
    )
    report = select_checkpoint(load_target_from_config(cfg), args.run_dir, opts)
    print(f"winner: {report['selection']['winner']}: {report['selection']['reason']}")
