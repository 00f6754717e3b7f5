"""`draftling vocab`: the draft vocabulary from prepared data."""

from __future__ import annotations

import logging
from pathlib import Path

from draftling.cli.common import add_key_flag, check_data_files, run_config

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    """`draftling vocab`: the draft vocabulary from prepared data."""
    p = sub.add_parser(
        "vocab",
        help="build the draft vocabulary (d2t/t2d) from prepared data",
        description="Count loss-masked tokens in <data>/train.jsonl and keep the N most "
        "frequent as the draft vocabulary. With a prompt weight W > 0 a token ranks by its "
        "share of those tokens plus W times its share of the prompt files' text (every prompt "
        "but validation's, counted by `draftling data`). Writes d2t (offsets) and t2d (mask) "
        "with a hash of the data, to <data>/vocab.safetensors unless --out is given.",
    )
    p.add_argument("--data", required=True, help="directory written by `draftling data`")
    add_key_flag(p, "size", type=int)
    add_key_flag(p, "prompt_weight", type=float, metavar="W")
    add_key_flag(p, "target", note="Only its vocab size is read.")
    p.add_argument("--config", default=None, help="YAML config or built-in name")
    p.add_argument("--out", help="output file (default <data>/vocab.safetensors)")


def run(args) -> None:
    from draftling.draft.vocab import build_vocab_file
    from draftling.target.load import load_target_config

    cfg = run_config(args, ("target", "size", "prompt_weight"))  # --size: checked with the config's bounds
    data = Path(args.data)
    check_data_files(data)
    out = Path(args.out) if args.out else data / "vocab.safetensors"
    vocab = build_vocab_file(
        data / "train.jsonl",
        load_target_config(cfg.target).vocab_size,
        cfg.vocab.size,
        out,
        prompt_weight=cfg.vocab.prompt_weight,
    )
    log.info(
        f"vocab: {vocab.size} draft tokens ({vocab.num_distinct} distinct in data), "
        f"coverage {vocab.coverage:.1%} of loss tokens -> {out}"
    )
