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
        "at --concurrency (a serving load; prompts repeat to fill the rows), --repeats times each in "
        "turns, and pick the fastest by median tok/s (tau and identity with plain greedy shown); a "
        "candidate whose min-max tok/s overlaps the fastest's is a tie, and the earliest checkpoint "
        "of a tie ships. Writes selection.json and selection.md (default RUN_DIR/selection/). "
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
        default=16,
        help="requests decoded at once, a serving load (default 16)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per candidate, after one untimed warm-up, in turns across candidates; the median "
        "decides and the min-max is the spread (default 3)",
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

    if min(args.select_concurrency, args.repeats, args.shortlist, args.select_new_tokens) < 1:
        raise DraftlingError("select: --concurrency, --repeats, --shortlist and --max-new-tokens must be >= 1")
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
        repeats=args.repeats,
        max_new_tokens=args.select_new_tokens,
        base=args.base,
        out=args.out,
    )
    report = select_checkpoint(load_target_from_config(cfg), args.run_dir, opts)
    sel = report["selection"]
    tie = " (a tie: the earliest checkpoint ships)" if sel["decision"]["tie"] else ""
    print(f"winner{tie}: {sel['winner']}: {sel['reason']}")
