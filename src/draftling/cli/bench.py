"""`draftling bench`: the simple bench, or the release bench with --release."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from draftling.cli.common import (
    BENCH_FLAGS,
    EPILOG_OVERRIDES,
    RELEASE_FLAGS,
    TARGET_FLAGS,
    add_common,
    add_key_flag,
    run_config,
)
from draftling.errors import DraftlingError

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    """`draftling bench`: the simple bench, or the release bench with --release. The group a
    flag is declared in says which of the two it belongs to; run refuses it in the other."""
    p = sub.add_parser(
        "bench",
        help="speculative decoding: acceptance length, speed, exactness",
        description="Greedy speculative decoding with the draft against the same engine "
        "without speculation. Reports tau (tokens per verify step, bonus token counted), "
        "tokens/s for both, and checks the output equals plain greedy token for token. "
        "--temperature samples instead (lossless verification; tau and speed only).",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    p.add_argument("--draft", required=True, help="draft directory (<run>/draft, a checkpoint, or an SGLang export)")
    # Not data.prompts: bench's own prompt file (with --release: the prompt set), its own dest.
    p.add_argument(
        "--prompts",
        dest="prompt_file",
        metavar="PROMPTS",
        help="jsonl of prompts or tokenized rows (e.g. <data>/val.jsonl); required unless --release",
    )
    add_key_flag(p, "configs", note="Comma-separated.")
    add_key_flag(p, "max_new_tokens", type=int, note="--release: 256 unless given.")
    s = p.add_argument_group("simple bench", "a prompt file, greedy or sampled (not with --release)")
    simple = [
        add_key_flag(s, "num_prompts", type=int),
        add_key_flag(s, "temperature", type=float),
        add_key_flag(s, "top_k", type=int, context="With --temperature:"),
        add_key_flag(s, "top_p", type=float, context="With --temperature:"),
        s.add_argument("--out", help="write the results JSON here (with the run's manifest inside)"),
    ]
    release = _release_group(p)
    p.set_defaults(
        simple_only=[(a.option_strings[0], a.dest) for a in simple],
        release_only=[(a.option_strings[0], a.dest) for a in release],
    )


def _release_group(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The release bench's flags, --release first; returns those that apply only with it."""
    r = p.add_argument_group(
        "release bench",
        "per-workload speedup on a fixed prompt set, with HF "
        "baselines, a cost account, JSON + markdown + plots and a manifest.json in a "
        "folder per run (bench/release.py); each flag sets the config key bench.<name>",
    )
    r.add_argument(
        "--release",
        action="store_true",
        help="run the release bench instead of the simple "
        "one (default configs chain-3-1-4,tree-3-4-8,tree-5-8-16; 256 new tokens)",
    )
    return [*_release_run_flags(r), *_release_output_flags(r)]


def _release_run_flags(r) -> list[argparse.Action]:
    """What the release bench runs: the prompt set, the baselines and the engine."""
    from draftling.config import BENCH_CHOICES

    return [
        add_key_flag(r, "prompt_set"),
        add_key_flag(r, "baselines", note="Comma-separated."),
        add_key_flag(r, "baseline_prompts_per_workload", type=int, metavar="N"),
        add_key_flag(r, "engine_compile", choices=["auto", "on", "off"]),
        add_key_flag(r, "query_pad", metavar="N"),
        add_key_flag(r, "attention", choices=BENCH_CHOICES["attention"]),
    ]


def _release_output_flags(r) -> list[argparse.Action]:
    """The concurrency sweep and where the results go."""
    return [
        add_key_flag(
            r,
            "concurrency",
            metavar="LEVELS",
            note="Comma-separated; alone, or before the release bench with --release.",
        ),
        add_key_flag(r, "results_dir"),
        add_key_flag(r, "tag"),
        r.add_argument(
            "--overwrite",
            action="store_true",
            help="replace results of the same date, commit, "
            "machine and tag (without it they are refused before the bench runs)",
        ),
        r.add_argument(
            "--update-benchmarks-md",
            metavar="FILE",
            help="rewrite the release-bench section of the markdown FILE (created if missing), "
            "e.g. a repository's BENCHMARKS.md",
        ),
    ]


def _given(args, flags) -> list[str]:
    """Those of ``flags`` ((flag, dest) pairs) given on the command line."""
    return [flag for flag, dest in flags if getattr(args, dest) not in (None, False)]


def run(args) -> None:
    from draftling.bench.simple import run_bench
    from draftling.target import load_target_from_config

    if args.release or args.concurrency:
        return _release_bench(args)
    release_only = _given(args, args.release_only)
    if release_only:
        raise DraftlingError(f"{', '.join(release_only)} only apply with --release")
    if not args.prompt_file:
        raise DraftlingError("bench needs --prompts FILE (or --release to run the release bench on a fixed prompt set)")
    # Checked as their config keys are: --num-prompts 0 is refused, not read as "unset".
    cfg = run_config(args, (*TARGET_FLAGS, *BENCH_FLAGS))
    if args.out and Path(args.out).is_dir():  # found now, not after the whole bench
        raise DraftlingError(f"--out {args.out}: is a directory; name the results file, e.g. {args.out}/bench.json")
    run_bench(cfg, load_target_from_config(cfg), args.draft, args.prompt_file, out=args.out)


def _release_bench(args) -> None:
    """`bench --release`: its options are config keys (bench.*), its outputs a run folder."""
    from draftling.bench import release, release_options
    from draftling.bench.report import update_benchmarks_md
    from draftling.target import load_target_from_config

    misplaced = _given(args, args.simple_only)
    if misplaced:
        mode = "--release" if args.release else "--concurrency"
        raise DraftlingError(
            f"bench {mode}: {', '.join(misplaced)} do not apply (the prompt set "
            "fixes n, outputs go to --results-dir and the protocol is greedy)"
        )
    if args.prompt_file and args.prompt_set:
        raise DraftlingError("bench --release/--concurrency: give --prompt-set or --prompts, not both")
    args.prompt_set = args.prompt_set or args.prompt_file  # here --prompts names the prompt set
    protocol = tuple(f"{key}={json.dumps(value)}" for key, value in release_options.PROTOCOL_KEYS.items())
    cfg = run_config(args, (*TARGET_FLAGS, *RELEASE_FLAGS), base=protocol)
    results_dir = Path(cfg.bench.results_dir)
    if results_dir.exists() and not results_dir.is_dir():  # found before the target loads
        raise DraftlingError(f"--results-dir {results_dir}: is a file, not a directory")
    target = load_target_from_config(cfg)
    if cfg.bench.concurrency:
        from draftling.bench.concurrency import SweepOptions, run_concurrency_sweep

        run_concurrency_sweep(target, args.draft, SweepOptions.from_config(cfg.bench))
    if not args.release:
        return
    options = release_options.ReleaseOptions.from_config(cfg.bench, overwrite=args.overwrite)
    results = release.run_release_bench(target, args.draft, options)
    if args.update_benchmarks_md:
        stem = release_options.release_stem(results_dir, results["date"], results["gpu"], cfg.bench.tag)
        log.info(f"updated {update_benchmarks_md(f'{stem}.json', args.update_benchmarks_md)}")
