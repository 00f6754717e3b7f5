"""`draftling quickstart`: every stage, on the embedded default target."""

from __future__ import annotations

from draftling.cli.common import EPILOG_OVERRIDES, TARGET_FLAGS, add_common, add_key_flag, flag_overrides
from draftling.errors import DraftlingError


def add_parser(sub) -> None:
    """`draftling quickstart`: every stage, on the embedded default target."""
    p = sub.add_parser(
        "quickstart",
        help="run every stage on the embedded default target",
        description="data -> vocab -> train -> bench -> export on SmolLM2-135M-Instruct "
        "and the starter prompts shipped with draftling (starter:chat, starter:code, "
        "starter:math), with the CPU profile (configs/quickstart_cpu.yaml), inside a time "
        "budget. After loading the target it times one training step and a decode on this "
        "machine, sets the bench and validation aside, and splits the rest between "
        "regenerating replies (which stops at its share and keeps what is done) and "
        "training (whose LR schedule is fitted to what is left). Writes "
        "<out>/summary.json, with the plan and what each stage used, and prints a table.",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    p.add_argument("--out", default="runs/quickstart", help="output directory (default runs/quickstart)")
    add_key_flag(
        p,
        "minutes",
        type=float,
        note="Default: the profile's, 13.5 in quickstart_cpu. A budget too small for training on this machine is "
        "refused after the probe.",
    )


def run(args) -> None:
    from draftling.recipes.quickstart import quickstart

    if args.minutes is not None and args.minutes < 0:
        raise DraftlingError(f"--minutes {args.minutes:g}: expected a positive budget (or 0 for none)")
    overrides = [*(args.overrides or []), *flag_overrides(args, (*TARGET_FLAGS, "minutes"))]
    quickstart(args.out, config=args.config or "quickstart_cpu", overrides=overrides)
