"""The `draftling` command. Each subcommand is one pipeline stage; `quickstart` runs them all.

Errors in user input are printed as one line (`draftling: error: ...`) with exit code 2.

Each command is a module here with its parser beside it: ``add_parser(sub)`` declares it,
``run(args)`` runs it. What they share (the flags that stand for config keys, the run config,
the common options, the error line) is in common.py. The modules import only the standard
library and common at the top; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from draftling.cli import (
    bench,
    check,
    data,
    export,
    extract,
    plan,
    quickstart,
    release,
    report,
    select,
    serve_check,
    train,
    vocab,
)
from draftling.cli.common import run_command, run_config
from draftling.cli.plan import cmd_plan
from draftling.logs import setup_logging
from draftling.progress import quiet_libraries

__all__ = ["COMMANDS", "add_plan_parser", "build_parser", "cmd_plan", "main", "run_config"]

add_plan_parser = plan.add_parser

# Each command's module, in the order `draftling --help` lists them.
MODULES = {
    "data": data,
    "vocab": vocab,
    "train": train,
    "plan": plan,
    "extract": extract,
    "bench": bench,
    "select": select,
    "export": export,
    "check": check,
    "release": release,
    "serve-check": serve_check,
    "report": report,
    "quickstart": quickstart,
}
COMMANDS = {name: module.run for name, module in MODULES.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftling",
        description="Train, measure and ship EAGLE-3 speculative-decoding draft heads for any "
        "Hugging Face causal LM. Stages: data -> vocab -> train -> bench -> export.",
        epilog="Run `draftling quickstart` to do everything on the embedded default target.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-file",
        metavar="PATH",
        default=None,
        help="also write every log line of this process, with time and level, to PATH "
        "(or set DRAFTLING_LOG_FILE); under torchrun each rank's lines are marked",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in MODULES.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may also come after options (`train a=1 --run-dir R b=2`).
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    args.argv = argv
    setup_logging(logging.DEBUG if args.verbose else logging.INFO, log_file=args.log_file)
    quiet_libraries()
    return run_command(COMMANDS[args.command], args)
