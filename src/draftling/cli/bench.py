"""`draftling bench`: the simple bench, or the release bench with --release."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from draftling.cli.common import BENCH_FLAGS, EPILOG_OVERRIDES, RELEASE_FLAGS, TARGET_FLAGS, add_common, run_config
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
    p.add_argument(
        "--prompts", help="jsonl of prompts or tokenized rows (e.g. <data>/val.jsonl); required unless --release"
    )
    p.add_argument(
        "--configs", help="comma-separated decode configs steps-topk-draft_tokens, e.g. chain-3-1-4,tree-3-4-8"
    )
    p.add_argument("--max-new-tokens", type=int, help="tokens per completion (default: config; --release: 256)")
    s = p.add_argument_group("simple bench", "a prompt file, greedy or sampled (not with --release)")
    simple = [
        s.add_argument("--num-prompts", type=int, help="how many prompts (default: config bench.num_prompts)"),
        s.add_argument(
            "--temperature",
            type=float,
            help="sample at this temperature (default: config "
            "bench.temperature, 0 = greedy); speculative verification stays lossless, and only "
            "greedy runs check identity",
        ),
        s.add_argument("--top-k", type=int, help="with --temperature: keep the k likeliest tokens (0 = off)"),
        s.add_argument("--top-p", type=float, help="with --temperature: nucleus sampling mass (1 = off)"),
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
        r.add_argument("--prompt-set", help="built-in prompt set name (v1, the default) or a jsonl path"),
        r.add_argument(
            "--baselines", help="comma list of engine_plain,hf_static,hf_prompt_lookup,hf_eager (default: all four)"
        ),
        r.add_argument(
            "--baseline-prompts-per-workload",
            type=int,
            metavar="N",
            help="run the slow HF baselines on the first N prompts of each workload (default: all)",
        ),
        r.add_argument(
            "--engine-compile",
            choices=["auto", "on", "off"],
            help="compile the target's and draft's layers (default auto: on with CUDA)",
        ),
        r.add_argument(
            "--query-pad",
            metavar="N",
            help="pad every target pass to N queries so plain and "
            "verify passes share kernels (default auto: the largest config's draft tokens on "
            "CUDA, 0 = off on CPU)",
        ),
        r.add_argument(
            "--attention",
            choices=BENCH_CHOICES["attention"],
            help="engine attention: sdpa, matmul (bf16), or exact (float64 sums: tree output equals "
            "plain output). Default auto: exact on CUDA (the unpadded plain reference: matmul), "
            "sdpa on CPU",
        ),
    ]


def _release_output_flags(r) -> list[argparse.Action]:
    """The concurrency sweep and where the results go."""
    return [
        r.add_argument(
            "--concurrency",
            metavar="LEVELS",
            help="the concurrency sweep (bench/concurrency.py) at "
            "these levels, e.g. 1,2,4,8,16,32,64: per level and config aggregate and per-stream tok/s, "
            "tau, speedup over plain at that level, the cost account, and the crossover where plain "
            "wins; alone or before the release bench with --release",
        ),
        r.add_argument(
            "--results-dir",
            help="where each run's folder <date>-release-<commit>-<machine>[-<tag>] "
            "goes (default: the working directory)",
        ),
        r.add_argument("--tag", help="suffix for the run's folder and file names"),
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
    if not args.prompts:
        raise DraftlingError("bench needs --prompts FILE (or --release to run the release bench on a fixed prompt set)")
    # Checked as their config keys are: --num-prompts 0 is refused, not read as "unset".
    cfg = run_config(args, (*TARGET_FLAGS, *BENCH_FLAGS))
    if args.out and Path(args.out).is_dir():  # found now, not after the whole bench
        raise DraftlingError(f"--out {args.out}: is a directory; name the results file, e.g. {args.out}/bench.json")
    run_bench(cfg, load_target_from_config(cfg), args.draft, args.prompts, out=args.out)


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
    if args.prompts and args.prompt_set:
        raise DraftlingError("bench --release/--concurrency: give --prompt-set or --prompts, not both")
    args.prompt_set = args.prompt_set or args.prompts  # here --prompts names the prompt set
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
