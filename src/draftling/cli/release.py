"""`draftling release`: a folder a model hub takes as it is."""

from __future__ import annotations

import logging

from draftling.cli.common import EPILOG_OVERRIDES, add_common, run_config

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    """`draftling release`: a folder a model hub takes as it is."""
    p = sub.add_parser(
        "release",
        help="write a hub-ready folder: the export, a model card, serving configs",
        description="Export the run's head (SGLang format, or speculators; a dflash head: speculators' dflash "
        "layout, served by vLLM): the winner of "
        "RUN/selection/selection.json where `draftling select` wrote one, else RUN/draft; "
        "--checkpoint picks another. Write a model card "
        "(README.md with the hub's YAML metadata: the target and its fingerprint, the training, "
        "the release-bench table from --bench, the vLLM and SGLang launch commands) and "
        "serving.json (vLLM speculative_config and launch commands) into --out, built aside and "
        "renamed into place. --push REPO uploads it with huggingface_hub.",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished training run (its draft/ and train_result.json)")
    p.add_argument(
        "--out", required=True, help="the release folder (new, empty, or an earlier release with --overwrite)"
    )
    p.add_argument(
        "--format",
        choices=["sglang", "speculators"],
        default=None,
        help="export format (default: sglang for an EAGLE-3 head, speculators for a dflash head, its one layout)",
    )
    p.add_argument(
        "--verifier-id",
        metavar="ORG/NAME",
        help="the target's hub id as engines load it (default: the "
        "default target's HuggingFaceTB/SmolLM2-135M-Instruct, or --target when it is a hub id)",
    )
    p.add_argument(
        "--bench",
        metavar="JSON",
        help="a release-bench results JSON: the card's speed table, and "
        "the serving config (its best mean speedup; without it, the default tree-3-4-8)",
    )
    p.add_argument(
        "--serve-check",
        metavar="JSON",
        help="a `draftling serve-check` results JSON: vLLM's acceptance beside draftling's engine in the card",
    )
    p.add_argument("--push", metavar="REPO", help="upload the folder to this hub repo (needs network)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier release in --out")
    p.add_argument(
        "--checkpoint",
        metavar="NAME",
        help="ship checkpoints/NAME, or 'final' for RUN/draft (default: the selection's winner, else the final head)",
    )
    p.add_argument(
        "--weight-fingerprint",
        action="store_true",
        help="the export's target fingerprint also hashes "
        "a fixed sample of the target's weights (sglang format), which `draftling check` compares",
    )


def run(args) -> None:
    from draftling.export.cli import verifier_hub_id
    from draftling.export.release import ReleaseSpec, push, release
    from draftling.target import load_target_from_config
    from draftling.target.load import resolve_target

    cfg = run_config(args, ("target", "dtype"), base=("device=cpu",))
    target_id = verifier_hub_id(None if args.verifier_id else resolve_target(cfg.target), args.verifier_id)
    spec = ReleaseSpec(
        args.run_dir,
        args.out,
        args.format,
        target_id,
        args.push,
        args.bench,
        args.overwrite,
        args.checkpoint,
        args.serve_check,
        args.weight_fingerprint,
    )
    out = release(spec, load_target_from_config(cfg))
    log.info(
        f"released {args.run_dir} to {out}: {', '.join(sorted(p.name for p in out.iterdir() if p.name[0] != '.'))}"
    )
    if args.push:
        log.info(f"pushed to {push(out, args.push)}")
