"""`draftling extract`: the teacher's outputs cached for offline training."""

from __future__ import annotations

from pathlib import Path

from draftling.cli.common import (
    EPILOG_OVERRIDES,
    EXTRACT_FLAGS,
    TARGET_FLAGS,
    add_common,
    add_device_map_flag,
    add_key_flag,
    check_data_files,
    run_config,
)


def add_parser(sub) -> None:
    """`draftling extract`: the teacher's outputs cached for offline training."""
    from draftling.config import EXTRACT_CHOICES

    p = sub.add_parser(
        "extract",
        help="run the teacher once and cache its outputs for offline training",
        description="Offline mode, step 1: run the target over <data>/train.jsonl (and "
        "val.jsonl when present) and write what the loss needs (aux hidden states, "
        "target logits at the draft-vocab ids, full-vocab argmax) to sharded safetensors "
        "under CACHE/{train,val}/shard_NNNNN.safetensors with CACHE/manifest.json. Prints a "
        "disk estimate first: draft_logits dominate (a 32000-token draft vocab in bf16 is "
        "64 KB per token). Each shard is written under a temporary name and renamed when "
        "complete, so after a kill just rerun the same command: finished shards are "
        "skipped. Then train with `draftling train --offline CACHE`.",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    add_device_map_flag(p)
    p.add_argument("--data", required=True, help="directory written by `draftling data`")
    p.add_argument("--out", required=True, metavar="CACHE", help="cache directory to write (or resume)")
    p.add_argument("--vocab", help="vocab file (default <data>/vocab.safetensors)")
    # Each sets its config key extract.<name>.
    add_key_flag(p, "shard_size", type=int, metavar="N")
    add_key_flag(p, "batch_size", type=int, metavar="N")
    add_key_flag(p, "logits_dtype", choices=EXTRACT_CHOICES["logits_dtype"])


def run(args) -> None:
    cfg = run_config(args, (*TARGET_FLAGS, *EXTRACT_FLAGS))
    check_data_files(Path(args.data))
    from draftling.target import load_target_from_config
    from draftling.train.offline import ExtractOptions, check_cache_dir, extract

    check_cache_dir(Path(args.out))  # before the target loads
    target = load_target_from_config(cfg)
    extract(target, args.data, args.out, args.vocab, ExtractOptions.from_config(cfg, target))
