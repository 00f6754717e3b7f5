"""`draftling export`: a trained head in a serving format."""

from __future__ import annotations

from draftling.cli.common import add_key_flag, run_config


def add_parser(sub) -> None:
    """`draftling export`: a trained head in a serving format."""
    p = sub.add_parser(
        "export",
        help="write the head in SGLang (EAGLE) or vLLM speculators format",
        description="Export a trained head for serving. By default embedding-free, with "
        "the d2t/t2d vocab maps, and with the aux layer ids translated to the engine's "
        "convention (omitted when they are the defaults).",
    )
    p.add_argument("--draft", required=True, help="draft directory written by `draftling train`")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["sglang", "speculators"], default="sglang")
    p.add_argument("--with-embedding", action="store_true", help="include the target's embedding")
    add_key_flag(
        p,
        "target",
        note="Needed for --with-embedding and for --format speculators, whose config names the verifier's hub id "
        "and architectures.",
    )
    p.add_argument(
        "--verifier-id",
        metavar="ORG/NAME",
        help="--format speculators: the verifier's Hugging "
        "Face hub id written into the config (default: from --target; the default target is "
        "HuggingFaceTB/SmolLM2-135M-Instruct; needed when --target is a local path)",
    )
    # The export's own dtype, not the target's (config key `dtype`): its own dest keeps it apart.
    p.add_argument(
        "--dtype", dest="export_dtype", metavar="DTYPE", default="bfloat16", help="bfloat16 | float16 | float32 | keep"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in --out (only "
        "the files draftling wrote there; other files stay). Without it --out must be new or "
        "empty; a directory draftling did not write is always refused",
    )
    p.add_argument(
        "--weight-fingerprint",
        action="store_true",
        help="also record a hash of a fixed sample of "
        "the target's weights (needs --target; sglang format), which `draftling check` compares",
    )


def run(args) -> None:
    from draftling.export.cli import export_from_cli

    # The target is read only for its embedding and names: on the CPU, in the config's default dtype.
    export_from_cli(args, run_config(args, ("target",), base=("device=cpu",)))
