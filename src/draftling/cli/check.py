"""`draftling check`: a head against a target, before serving."""

from __future__ import annotations

from pathlib import Path

from draftling.cli.common import EPILOG_OVERRIDES, add_common, run_config
from draftling.errors import DraftlingError


def add_parser(sub) -> None:
    """`draftling check`: a head against a target, before serving."""
    p = sub.add_parser(
        "check",
        help="check that an exported head fits a target before serving it",
        description="Load EXPORT (an SGLang or speculators export, or a draftling draft), check its "
        "vocab maps, hidden size, vocabulary and aux layer ids against the target, and the target "
        "fingerprint the export recorded (config and tokenizer hashes, RoPE parameters, and where "
        "it carries one the weight hash, for which the target's weights are loaded). Exit 2 with "
        "every mismatch named.",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    p.add_argument("export", metavar="EXPORT", help="the export (or draft) directory")


def run(args) -> None:
    from draftling.export.check import check_export
    from draftling.target.load import load_target_config, load_target_tokenizer

    cfg = run_config(args, ("target",))
    if not Path(args.export).is_dir():
        raise DraftlingError(f"{args.export}: no such directory")
    config = load_target_config(cfg.target)
    tokenizer = load_target_tokenizer(cfg.target, cfg.chat_template).tokenizer

    def weights() -> str:  # only where the export carries a weight hash: loading the weights costs
        from draftling.target import load_target_from_config
        from draftling.target.fingerprint import weight_hash

        return weight_hash(load_target_from_config(cfg).model)

    for line in check_export(args.export, config, tokenizer, weights):
        print(f"ok: {line}")
    print(f"{args.export} fits {cfg.target or 'the default target'}")
