"""`draftling train`: online (or --offline) training of the head."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

from draftling.cli.common import (
    EPILOG_OVERRIDES,
    TARGET_FLAGS,
    add_common,
    add_device_map_flag,
    add_key_flag,
    check_data_files,
    run_config,
)
from draftling.errors import DraftlingError

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    """`draftling train`: online (or --offline) training of the head."""
    p = sub.add_parser(
        "train",
        help="train the EAGLE-3 head (teacher resident, TTT unroll)",
        description="Online training: the target stays loaded and its aux hidden states "
        "are recomputed for each batch. Logs per-step and conditional accuracy and a "
        "simulated acceptance length (sim_tau) to <run>/metrics.jsonl and stdout; "
        "validation also walks each sequence as a greedy chain decode over "
        "train.ttt_steps would (chain_tau: what benching those prompts measures); checkpoints "
        "atomically to <run>/checkpoints; writes the final head to <run>/draft.",
        epilog=EPILOG_OVERRIDES,
    )
    add_common(p)
    add_device_map_flag(p)
    _add_run_dir_flags(p)
    _add_start_flags(p)


def _add_run_dir_flags(p) -> None:
    """The data it trains on and the run directory: where, and resumed or started over."""
    p.add_argument("--data", required=True, help="directory written by `draftling data`")
    p.add_argument("--vocab", help="vocab file (default <data>/vocab.safetensors)")
    p.add_argument("--run-dir", required=True, help="run directory (config, metrics, checkpoints)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    p.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: apply this config key's new value (e.g. train.lr), recorded in "
        "config.yaml and as a config_change record in metrics.jsonl; repeat for several. "
        "Without it a resume whose config differs from the run's is refused, listing the keys",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a --run-dir that holds an earlier "
        "run (its checkpoints, draft and metrics are removed); without it, or --resume, such a "
        "directory is refused",
    )


def _add_start_flags(p) -> None:
    """What the head starts from, where the teacher's outputs come from, processes, stopping."""
    add_key_flag(
        p,
        "init_from",
        metavar="DIR",
        note="It reports its vocab map's coverage of the data; the source is never written.",
    )
    add_key_flag(p, "rebuild_vocab", action="store_true")
    p.add_argument(
        "--offline",
        metavar="CACHE",
        help="read the teacher's outputs from a cache written by "
        "`draftling extract` instead of running the teacher per batch (the target is still "
        "loaded, for its embedding and pad id); the cache must match --data and --vocab",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel over N processes on this host: relaunches this command under "
        "torchrun (same as `torchrun --nproc_per_node N -m draftling train ...`). Each rank "
        "loads the teacher on its own GPU (cuda:<local rank>); train.batch_size stays the "
        "global batch; train.parallel=ddp|fsdp picks the wrapper",
    )
    add_key_flag(p, "stop_on_convergence", action="store_true")


def run(args) -> int | None:
    from draftling.train.distributed import init_distributed, launched_by_torchrun

    cfg = run_config(args, (*TARGET_FLAGS, "init_from", "rebuild_vocab", "stop_on_convergence"))
    if cfg.device_map and (args.nproc is not None or launched_by_torchrun()):
        raise DraftlingError(
            f"device_map {cfg.device_map}: not with data-parallel ranks (--nproc, torchrun), "
            "which each load a teacher on their own GPU; use one or the other"
        )
    if args.nproc is not None:
        if args.nproc < 1:
            raise DraftlingError(f"--nproc {args.nproc}: expected a positive number of processes")
        if not launched_by_torchrun():
            return relaunch_under_torchrun(args.nproc, args.argv)
    data = Path(args.data)
    check_data_files(data)
    init = _init_draft(cfg.draft)  # a bad --init-from fails before the target loads
    from draftling.target import load_target_from_config, resolve_device
    from draftling.train.rundir import check_run_dir
    from draftling.train.trainer import train

    check_run_dir(Path(args.run_dir), args.resume, args.overwrite)  # before the target loads
    vocab_path = args.vocab or data / "vocab.safetensors"
    _, device = init_distributed(resolve_device(cfg.device))
    cfg = dataclasses.replace(cfg, device=device)
    target = load_target_from_config(cfg)
    source = None
    if args.offline:
        from draftling.draft.vocab import hash_dataset_file, load_vocab
        from draftling.train.offline_teacher import OfflineTeacher

        vocab = load_vocab(vocab_path)
        source = OfflineTeacher(
            args.offline, "train", vocab_hash=vocab.data_hash, data_hash=hash_dataset_file(data / "train.jsonl")
        )
        source.check_target(target)
        log.info(f"offline teacher: {args.offline} ({source.info['num_shards']} train shards)")  # rank 0: logs.py
    train(
        cfg,
        target,
        args.run_dir,
        data / "train.jsonl",
        data / "val.jsonl",
        vocab_path,
        resume=args.resume,
        teacher_source=source,
        init=init,
        overwrite=args.overwrite,
        allow_change=args.allow_change,
    )


def relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    """Run `draftling train` with the same arguments (minus --nproc) on nproc local ranks."""
    import subprocess

    from draftling.train.distributed import NO_MULTICAST_ENV

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "draftling",
        *rest,
    ]
    log.info("launching: " + " ".join(cmd))
    return subprocess.call(cmd, env={**os.environ, **NO_MULTICAST_ENV})


def _init_draft(dc):
    """draft.init_from loaded, in whichever format it is (train/warmstart.py), or None. A run
    directory gives its final draft, or its newest checkpoint while it has none."""
    if not dc.init_from:
        if dc.rebuild_vocab:
            raise DraftlingError("--rebuild-vocab only applies with --init-from")
        return None
    import torch

    from draftling.export.formats import load_any_draft
    from draftling.train.checkpoint import latest_checkpoint
    from draftling.train.warmstart import InitDraft

    path = Path(dc.init_from)
    if not path.is_dir():
        raise DraftlingError(f"--init-from {path}: no such directory")
    if (path / "draft").is_dir():
        path = path / "draft"
    elif (path / "checkpoints").is_dir():
        path = latest_checkpoint(path) or path
    return InitDraft(load_any_draft(path, "cpu", torch.float32), str(path), dc.rebuild_vocab)
